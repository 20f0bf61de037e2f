"""Property tests: real files of every format, mutated, never break a scan.

Each seed is written by the library that writes it in the wild (torch.save in both formats,
gzip over torch.save as SimpleTuner does, safetensors, np.save / np.savez, a plain pickle).
Hypothesis then truncates, splices, duplicates and case-twins zip entries, and plants huge
numbers; for every mutant the scan must finish with findings, not an exception, within a
bounded time, with bounded messages, and a hostile file beside the mutant must still be
reported.
"""

from __future__ import annotations

import gzip
import io
import pickle
import re
import tempfile
import time
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachedoctor.formats import read_path

from conftest import scan_paths

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

MAX_SECONDS = 5.0  # per mutant: generous, this is about bombs and hangs, not speed
MAX_MESSAGE = 1000  # characters: a finding's message is one line a person reads


class Hostile:
    def __reduce__(self):
        return (print, ("payload",))  # inert here: the scan must only recognise it


def _seeds() -> dict[str, bytes]:
    batch = torch.randn(4, 4, 8, 8)
    seeds: dict[str, bytes] = {}
    buf = io.BytesIO()
    torch.save({"latents": batch[1], "original_size": torch.tensor([64, 64])}, buf)
    seeds["zip.pt"] = buf.getvalue()
    seeds["gz.pt"] = gzip.compress(buf.getvalue())
    buf = io.BytesIO()
    torch.save(batch[2], buf, _use_new_zipfile_serialization=False)
    seeds["legacy.pt"] = buf.getvalue()
    seeds["st.safetensors"] = safetensors_torch.save({"latents": batch[0].contiguous().half()},
                                                     metadata={"format": "pt"})
    buf = io.BytesIO()
    np.save(buf, batch[3].numpy())
    seeds["arr.npy"] = buf.getvalue()
    for name, save in (("plain.npz", np.savez), ("packed.npz", np.savez_compressed)):
        buf = io.BytesIO()
        save(buf, latents=batch[0].numpy(), original_size=np.array([64, 64]),
             crop_ltrb=np.array([0, 0, 64, 64]))
        seeds[name] = buf.getvalue()
    seeds["list.pkl"] = pickle.dumps({"a": [1, 2.5, "x"]}, protocol=0)
    return seeds


SEEDS = _seeds()
HOSTILE = pickle.dumps(Hostile(), protocol=2)
ZIPS = [name for name, data in SEEDS.items() if data[:2] == b"PK"]


def _truncate(data: bytes, at: int) -> bytes:
    return data[: at % (len(data) + 1)]


def _splice(data: bytes, at: int, junk: bytes) -> bytes:
    at %= len(data) + 1
    return data[:at] + junk + data[at + len(junk):]


def _insert(data: bytes, at: int, junk: bytes) -> bytes:
    at %= len(data) + 1
    return data[:at] + junk + data[at:]


def _huge_number(data: bytes, which: int, digits: int) -> bytes:
    """One run of ASCII digits (in a header: a shape, an offset, a length) made enormous."""
    runs = list(re.finditer(rb"\d+", data[:4096]))
    if not runs:
        return data
    run = runs[which % len(runs)]
    return data[: run.start()] + b"9" * digits + data[run.end():]


def _twin_entries(data: bytes, which: int, case_twin: bool) -> bytes:
    """A zip with one entry written twice: the same name, or a name differing only in case,
    holding a hostile pickle (what a loader resolving the other way would run)."""
    src = zipfile.ZipFile(io.BytesIO(data))
    infos = src.infolist()
    victim = infos[which % len(infos)]
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as dst:
        for info in infos:
            dst.writestr(info, src.read(info))
            if info is victim:
                twin = victim.filename.upper() if case_twin else victim.filename
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # zipfile warns of the duplicate name
                    dst.writestr(twin, HOSTILE)
    return out.getvalue()


def mutants():
    seed = st.sampled_from(sorted(SEEDS))
    at = st.integers(min_value=0, max_value=1 << 20)
    junk = st.binary(min_size=1, max_size=64)
    plain = st.one_of(
        st.tuples(seed, at).map(lambda t: (t[0], _truncate(SEEDS[t[0]], t[1]))),
        st.tuples(seed, at, junk).map(lambda t: (t[0], _splice(SEEDS[t[0]], t[1], t[2]))),
        st.tuples(seed, at, junk).map(lambda t: (t[0], _insert(SEEDS[t[0]], t[1], t[2]))),
        st.tuples(seed, at, st.sampled_from([20, 400, 4000])).map(
            lambda t: (t[0], _huge_number(SEEDS[t[0]], t[1], t[2]))),
    )
    twins = st.tuples(st.sampled_from(ZIPS), at, st.booleans()).map(
        lambda t: ("twin-" + t[0], _twin_entries(SEEDS[t[0]], t[1], t[2])))
    return st.one_of(plain, twins)


def _problem(finding) -> bool:
    return finding.name in ("checker-error", "internal-error")


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(mutants())
def test_a_mutant_never_breaks_the_scan(mutant: tuple[str, bytes]) -> None:
    name, data = mutant
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, name)
        path.write_bytes(data)
        Path(tmp, "hostile.pt").write_bytes(HOSTILE)
        started = time.perf_counter()
        meta = read_path(str(path))  # the reader alone: findings as data, never an exception
        report = scan_paths(tmp)
        elapsed = time.perf_counter() - started
    assert elapsed < MAX_SECONDS, f"{name}: {elapsed:.1f} s"
    assert all(len(e) <= MAX_MESSAGE for e in meta.errors)
    assert not [f for f in report.findings if _problem(f)], report.findings
    assert all(len(f.message) <= MAX_MESSAGE for f in report.findings)
    if name.startswith("twin-"):  # a hostile pickle a loader may reach: always an error
        assert any(f.severity.name.lower() == "error" and f.path.endswith(name)
                   for f in report.findings), report.findings
    # the file beside the mutant is still judged
    assert any(f.code == "CD105" and f.path.endswith("hostile.pt") for f in report.findings)
