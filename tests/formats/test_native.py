"""The compiled checks (native.py, _native.c) answer exactly as the Python ones they stand in
for: nonfinite.holds_none's two numpy reductions and a zip template's regular expressions.
Each test runs where the module was built (pip install with a C compiler) and skips where not;
the Python side of each comparison is the one every install has."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from cachedoctor.formats import native, nonfinite, read_path, zip_templates
from cachedoctor.formats.zip_templates import Templates

torch = pytest.importorskip("torch")
compiled = native.NATIVE
needs_native = pytest.mark.skipif(compiled is None, reason="the C checks were not built here")

EIGHT_BIT = [getattr(torch, n) for n in ("float8_e5m2", "float8_e4m3fn") if hasattr(torch, n)]
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
          torch.complex128, *EIGHT_BIT]


def python_holds_none(monkeypatch, *args) -> bool:
    with monkeypatch.context() as m:
        m.setattr(native, "NATIVE", None)
        return nonfinite.holds_none(*args)


def test_the_module_is_built_where_a_compiler_is():
    """CI and the development machines have gcc and the Python headers: a silent fallback
    there would leave the C untested."""
    import sysconfig
    from shutil import which

    if os.environ.get("CACHEDOCTOR_NO_NATIVE"):
        pytest.skip("turned off")
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not (which("cc") or which("gcc")) or not headers.is_file():
        pytest.skip("no C compiler or no Python headers here: the Python checks run")
    assert compiled is not None


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_element_is_judged_as_numpy_judges_it(monkeypatch, dtype):
    """Each bit pattern of the 1- and 2-byte formats alone, and the special values of the wider
    ones, at every place in a block (the C tests 4096 elements between looks at its answer),
    at odd byte offsets too."""
    name = str(dtype).removeprefix("torch.")
    test = nonfinite.none_test(name)
    unsigned = test[0]
    if unsigned.itemsize <= 2:
        words = range(1 << (8 * unsigned.itemsize))
    else:
        specials = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.0, -2.5, 3e38]
        plain = torch.tensor(specials, dtype=torch.float64).to(
            dtype if not dtype.is_complex else torch.float32 if dtype == torch.complex64
            else torch.float64)
        words = plain.view(torch.uint8).numpy().reshape(-1, unsigned.itemsize)
        words = [int.from_bytes(w.tobytes(), "little") for w in words]
    size = unsigned.itemsize
    for word in words:
        for at, count in ((0, 1), (4095, 8193), (4096, 8193)):
            block = bytearray(count * size + 3)
            block[3 + at * size : 3 + (at + 1) * size] = word.to_bytes(size, "little")
            data = bytes(block)
            for zeros in (False, True):
                expected = bool(python_holds_none(monkeypatch, data, 3, count, test, zeros))
                assert compiled.finite(data, 3, count, size, test[4], test[3], zeros) is \
                    expected, (name, hex(word), at, zeros)
                assert nonfinite.holds_none(data, 3, count, test, zeros) is expected
            if size > 2 or word % 97:  # (every pattern once at each place is enough)
                break


@needs_native
def test_big_endian_stays_with_numpy(monkeypatch):
    """The C reads little-endian words: a big-endian proof is numpy's; zeros are either's."""
    data = torch.tensor([1.0, float("nan")], dtype=torch.float16).view(torch.uint8).numpy()
    swapped = data.reshape(-1, 2)[:, ::-1].tobytes()
    big = nonfinite.none_test("float16", big_endian=True)
    assert big[4] == 0 and not nonfinite.holds_none(swapped, 0, 2, big)
    small = nonfinite.none_test("float16")
    clean = torch.ones(4, dtype=torch.float16).view(torch.uint8).numpy().tobytes()
    assert nonfinite.holds_none(clean, 0, 4, small)
    zero = torch.tensor([1.0, 0.0], dtype=torch.float16).view(torch.uint8).numpy().tobytes()
    assert not nonfinite.holds_none(zero, 0, 2, small, zeros=True)


@needs_native
@pytest.mark.parametrize("args", [
    (b"\0" * 8, 0, 5, 2, 0x8000, 0x7C00, False),  # past the end
    (b"\0" * 8, -1, 1, 2, 0x8000, 0x7C00, False),
    (b"\0" * 8, 9, 0, 2, 0x8000, 0x7C00, False),
    (b"\0" * 8, 0, 1, 3, 0x8000, 0x7C00, False),  # no such width
    (b"\0" * 8, 0, -1, 2, 0x8000, 0x7C00, False),
    (b"\0" * 8, 2, 1 << 62, 4, 0x8000_0000, 0x7F80_0000, True),  # bytes that overflow
])
def test_a_range_outside_the_buffer_is_an_error_not_a_read(args):
    with pytest.raises(ValueError):
        compiled.finite(*args)


def _saved(folder: Path, n: int, stem: str = "") -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(1)
    paths = []
    for i in range(n):
        path = folder / f"{stem}{i:04d}.pt"
        torch.save(torch.randn(4, 8, 8, generator=gen).half(), path)
        paths.append(path)
    return paths


def _both(template: zip_templates.Template, windows) -> tuple:
    """(the patterns' answer, the compiled match's) for a file's `windows`."""
    saved = template._compiled
    template._compiled = None  # (prefix() then runs the regular expressions)
    try:
        expected = template.prefix(windows)
    finally:
        template._compiled = saved
    return expected, template.prefix(windows)


@needs_native
def test_the_layout_match_agrees_with_the_patterns_on_every_mutation(tmp_path):
    """Files of one layout, each byte of one of them changed in turn (to a "/", to a digit, to
    anything): the compiled match and the regular expressions take and refuse the same files
    with the same prefix; and whole other layouts are refused alike."""
    paths = _saved(tmp_path / "a", 3)
    templates = Templates()
    for p in paths:
        read_path(str(p), templates=templates)
    (template,) = [t for ts in templates.by_size.values() for t in ts]
    assert template._compiled is not None
    data = paths[1].read_bytes()
    assert _both(template, ((0, data),)) == ("0001", "0001")
    rng = random.Random(0)
    outcomes = set()
    for at in range(len(data)):
        for value in {ord("/"), ord("7"), rng.randrange(256), data[at] ^ 0x01}:
            mutated = bytearray(data)
            mutated[at] = value
            expected, got = _both(template, ((0, bytes(mutated)),))
            assert got == expected, (at, value)
            outcomes.add(expected)
    assert outcomes == {None, "0001"}  # (both taken and refused: one prefix byte changed is refused)
    # another stem of the same length: the same layout, its own prefix
    other = _saved(tmp_path / "b", 1, stem="x")[0]
    renamed = tmp_path / "b" / "y001.pt"
    torch.save(torch.randn(4, 8, 8).half(), renamed)
    for p in (other, renamed):
        expected, got = _both(template, ((0, p.read_bytes()),))
        assert got == expected


@needs_native
def test_head_and_tail_windows_match_alike(tmp_path):
    """A big file is matched on the head and tail windows a metadata read keeps; a window
    that misses a span matches nothing."""
    folder = tmp_path / "big"
    folder.mkdir()
    paths = []
    for i in range(3):
        path = folder / f"{i:04d}.pt"
        torch.save(torch.zeros(64 * 1024, dtype=torch.float16) + i, path)  # 128 KiB storage
        paths.append(path)
    templates = Templates()
    for p in paths:
        read_path(str(p), templates=templates)
    (template,) = [t for ts in templates.by_size.values() for t in ts]
    data = paths[2].read_bytes()
    windows = tuple((at, data[at : at + n]) for at, n in template.spans)
    assert len(windows) == 2
    assert _both(template, windows) == ("0002", "0002")
    assert _both(template, windows[:1]) == (None, None)


@needs_native
@pytest.mark.parametrize("bad", [
    lambda d, lit, mask: (d, -1, lit, mask, (), 0, (), None),
    lambda d, lit, mask: (d, len(d), lit, mask, (), 0, (), None),
    lambda d, lit, mask: (d, 0, lit, mask[:-1], (), 0, (), None),
    lambda d, lit, mask: (d, 0, lit, mask, (len(lit) - 1,), 4, (), None),
    lambda d, lit, mask: (d, 0, lit, mask, (), 0, ((3, len(lit) + 1),), None),
    lambda d, lit, mask: (d, 0, lit, mask, (0,), 2, (), b"abc"),
])
def test_a_span_outside_the_buffer_is_an_error_not_a_read(bad):
    data = bytes(64)
    with pytest.raises(ValueError):
        compiled.span(*bad(data, bytes(16), b"\xff" * 16))


def test_a_deep_scan_reports_alike_with_and_without_the_compiled_checks(tmp_path):
    """The CLI both ways (CACHEDOCTOR_NO_NATIVE=1 turns the C off) on twins with a NaN, an Inf,
    a wrong CRC32 and clean files of three dtypes: the same report."""
    cache = tmp_path / "cache"
    cache.mkdir()
    gen = torch.Generator().manual_seed(2)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for i in range(6):
            t = torch.randn(4, 16, 16, generator=gen).to(dtype)
            if i == 3:
                t[0, 0, 5] = float("nan")
            if i == 4:
                t[1, 2, 3] = -float("inf")
            path = cache / f"{str(dtype)[6:]}_{i:03d}.pt"
            torch.save(t, path)
    bad = cache / "float16_005.pt"
    with zipfile.ZipFile(bad) as z:
        member = next(i for i in z.infolist() if "/data/" in i.filename)
    data = bytearray(bad.read_bytes())
    data[member.header_offset + 30 + len(member.filename.encode()) + len(member.extra) + 7] ^= 1
    bad.write_bytes(bytes(data))
    reports = []
    for off in ("", "1"):
        env = {**os.environ, "CACHEDOCTOR_NO_NATIVE": off}
        done = subprocess.run([sys.executable, "-m", "cachedoctor", "scan", str(cache), "--deep",
                               "--no-index", "--format", "json", "--fail-on", "never"],
                              capture_output=True, text=True, env=env, check=True)
        reports.append(done.stdout)
    assert reports[0] == reports[1]
    assert '"CD' in reports[0]
