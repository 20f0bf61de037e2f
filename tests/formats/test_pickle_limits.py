"""How much a pickle may make the reader build, and how often a broken one is read.

A cache can be hostile: one opcode byte can build a 224-byte set, so a 64 MiB pickle could ask
for 15 GiB. The guard counts what the opcodes would build before anything is built and refuses
past pickle_guard.MAX_BUILD_BYTES, and a damaged stream is scanned for its globals once, mostly
at C speed. Bounds here are loose (CI machines are slow): memory is asserted, time only by a
wide margin, and work by counting calls.
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import random
import time
import tracemalloc
import warnings
import zipfile

import pytest

from cachedoctor.formats import pickle_guard, read_bytes, unpickler
from cachedoctor.formats.unpickler import (
    UnpickleError,
    classify_global,
    load_restricted,
    scan_globals,
    walk_tensors,
)

MEGA = 1 << 20
BUILD_MIB = pickle_guard.MAX_BUILD_BYTES // MEGA


def torch_zip(pkl: bytes) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("archive/data.pkl", pkl)
        archive.writestr("archive/version", "3\n")
    return buffer.getvalue()


def flood(code: bytes, builds: int, times: float = 2) -> bytes:
    """Enough of one opcode to build `times` the cap."""
    return b"\x80\x04" + code * int(times * pickle_guard.MAX_BUILD_BYTES // builds) + b"."


def measured(fn):
    tracemalloc.start()
    started = time.perf_counter()
    try:
        result = fn()
        return result, tracemalloc.get_traced_memory()[1], time.perf_counter() - started
    finally:
        tracemalloc.stop()


# ---- what a pickle may build --------------------------------------------------------------------

FLOODS = {
    "EMPTY_SET": flood(b"\x8f", 240),  # 2.1 MiB of opcodes, 500 MiB if built
    "FROZENSET": flood(b"(\x91", 256),
    "EMPTY_DICT": flood(b"}", 80),
    "EMPTY_LIST": flood(b"]", 80),
    "TUPLE1": b"\x80\x04N" + b"\x85" * (2 * pickle_guard.MAX_BUILD_BYTES // 80) + b".",
    "stubs": b"\x80\x02cevil\nX\nq\x00" + flood(b"h\x00)R", 272, times=1.25)[2:],
}


@pytest.mark.parametrize("name", FLOODS)
@pytest.mark.parametrize("container", ["x.pkl", "x.pt", "torch zip"])
def test_container_floods_are_refused_before_anything_is_built(name, container):
    data = FLOODS[name]
    if container == "torch zip":
        data = torch_zip(data)
    path = "x.pt" if container == "torch zip" else container
    if name == "stubs":  # tracemalloc would trace each of the million tokens counted
        meta, peak, seconds = read_bytes(data, path), 0, 0.0
        assert meta.unsafe_globals == ("evil.X",)  # the payload is still named
    else:
        meta, peak, seconds = measured(lambda: read_bytes(data, path))
    assert len(meta.errors) == 1, meta.errors
    assert f"would build more than {BUILD_MIB} MiB of objects" in meta.errors[0]
    assert "no cache holds that much" in meta.errors[0]
    # what was built: the reader's own buffers, not hundreds of MiB of sets
    assert peak < 2 * len(data) + 16 * MEGA, f"{peak / MEGA:.0f} MiB"
    assert seconds < 20  # about 0.05 s on a laptop


def test_the_count_is_of_opcodes_not_of_bytes_in_arguments():
    # 2,000,000 one-byte bytes holding the set opcode byte: 6 MiB, and no set at all
    data = b"\x80\x04(" + b"C\x01\x8f" * 2_000_000 + b"l."
    found = load_restricted(data)
    assert len(found.obj) == 2_000_000


def test_a_memo_index_counts_the_slots_it_makes(monkeypatch):
    # LONG_BINPUT to slot N makes the C unpickler's memo 2N slots, whatever comes before
    slot = 3 * MEGA
    data = b"\x80\x02N" + b"N0" * (slot // 2) + b"r" + slot.to_bytes(4, "little") + b"."
    monkeypatch.setattr(pickle_guard, "MAX_BUILD_BYTES", 32 * MEGA)  # 3 Mi slots: 48 MiB
    with pytest.raises(UnpickleError, match="would build more than 32 MiB"):
        load_restricted(data)
    monkeypatch.setattr(pickle_guard, "MAX_BUILD_BYTES", 128 * MEGA)
    assert load_restricted(data).obj is None


def test_a_large_sane_pickle_still_reads():
    # a big dataset's aggregate: 200,000 file names, each with its size and bucket; the
    # names hold "t" (the TUPLE opcode) and the binary arguments every tuple opcode byte
    aggregate = {f"/data/latents/{i:07d}.pt": [i * 7919 % 100_003, i % 17]
                 for i in range(200_000)}
    data = pickle.dumps(aggregate, protocol=2)
    assert len(data) > pickle_guard.MAX_MEASURED_BYTES  # the old tuple check refused it
    meta = read_bytes(data, "aggregate.pkl")
    assert meta.errors == () and meta.root == "dict"
    assert meta.unsafe_globals == ()


def test_many_small_tuples_are_measured_not_refused():
    # more tuple opcodes than MAX_TUPLE_DEPTH, each one deep: measured, and fine
    rows = [(i, i + 1) for i in range(50_000)]
    data = pickle.dumps({"rows": rows, "pad": "x" * pickle_guard.MAX_TUPLE_DEPTH}, protocol=2)
    assert load_restricted(data).obj["rows"] == rows


def test_walk_keeps_one_stack_entry_per_shared_container():
    shared = [1.0, 2.0]
    obj = [shared] * 100_000 + [{"a": shared}] * 100_000
    paths, peak, _ = measured(lambda: list(walk_tensors(obj)))
    assert paths == []
    assert peak < MEGA, f"{peak / MEGA:.1f} MiB"  # an entry per reference: 20 MiB


# ---- a damaged stream is scanned once -----------------------------------------------------------


def damaged(pairs: int, payload: bytes = b"") -> bytes:
    return b"\x80\x02" + b"N0" * pairs + payload + b"\xff"


@pytest.mark.parametrize("path", ["x.pkl", "x.pt", "zip"])
def test_a_damaged_stream_is_scanned_for_globals_once(monkeypatch, path):
    calls = []
    real = unpickler.scan_globals
    monkeypatch.setattr(unpickler, "scan_globals", lambda *a: calls.append(a) or real(*a))
    # 8 MiB: the legacy reader reads 64 KiB, 256 KiB, ... 16 MiB before it sees the damage
    data = damaged(4 * MEGA, b"cposix\nsystem\n")
    if path == "zip":
        data, path = torch_zip(data), "x.pt"
    started = time.perf_counter()
    meta = read_bytes(data, path)
    assert time.perf_counter() - started < 20  # about 0.05 s on a laptop
    assert "is not a pickle opcode" in meta.errors[0]
    assert meta.unsafe_globals == ("posix.system",)
    assert len(calls) == 1


def test_a_stream_that_names_no_global_is_not_read_one_opcode_at_a_time(monkeypatch):
    def refuse(*args):
        raise AssertionError("read opcode by opcode")

    monkeypatch.setattr(unpickler, "_quiet_run", refuse)
    assert scan_globals(damaged(MEGA)) == ([], [])


def test_runs_without_strings_or_memo_are_stepped_over_in_c(monkeypatch):
    # only the opcodes that push a string, use the memo or name a global are read in Python
    reads = []
    real = pickletools.read_stringnl_noescape_pair
    monkeypatch.setattr(pickle_guard.OPS[ord("c")].arg, "reader",
                        lambda f: reads.append(1) or real(f))
    data = b"\x80\x02" + b"]K\x05a" * MEGA + b"cposix\nsystem\n)R" + b"\xff"
    assert scan_globals(data) == (["posix.system"], ["posix.system"])
    assert reads == [1]


def reference_scan(data: bytes, offset: int = 0) -> tuple[list[str], list[str]]:
    """scan_globals as it was: pickletools.genops over every opcode."""
    names, unsafe, strings, fresh, memo, memo_next = {}, {}, [], False, {}, 0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for op, arg, _ in pickletools.genops(io.BytesIO(data[offset:])):
                kind, pushed = op.name, None
                if kind in unpickler._STRING_OPS:
                    pushed = arg if isinstance(arg, str) else str(arg)
                elif kind in unpickler._GET_OPS:
                    pushed = memo.get(int(arg))
                elif kind in unpickler._MEMO_OPS:
                    index = memo_next if kind == "MEMOIZE" else int(arg)
                    memo_next = max(memo_next, index + 1)
                    if fresh:
                        memo[index] = strings[-1]
                    continue
                elif kind in ("GLOBAL", "INST") or (kind == "STACK_GLOBAL" and len(strings) == 2):
                    module, name = str(arg).split(" ", 1) if arg is not None else strings
                    full, allowed = classify_global(module, name)
                    names[full] = None
                    if not allowed:
                        unsafe[full] = None
                fresh = pushed is not None
                if fresh:
                    strings = [*strings[-1:], pushed]
    except Exception:
        pass
    return list(names), list(unsafe)


class Payload:
    def __reduce__(self):
        return os.system, ("true",)


class Other:
    def __reduce__(self):
        return eval, ("1",)


def test_scan_finds_what_genops_finds_in_damaged_streams():
    bases = [pickle.dumps({"a": [1, (2, "x")], "b": Payload(), "c": [Other(), "os", "system"],
                           "d": 1.5, "e": 10**30, "f": b"bytes"}, protocol=p) for p in range(6)]
    rng = random.Random(11)
    for _ in range(3000):
        data = bytearray(rng.choice(bases))
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(data))
            if rng.random() < 0.6:
                data[at] = rng.randrange(256)
            elif rng.random() < 0.5:
                del data[at:at + rng.randint(1, 5)]
            else:
                data[at:at] = os.urandom(rng.randint(1, 4))
        offset = 0 if rng.random() < 0.8 else rng.randrange(len(data))
        assert scan_globals(bytes(data), offset) == reference_scan(bytes(data), offset)


def test_scan_memory_is_capped(monkeypatch):
    # one string memoized into 50,000 slots: only MAX_SCAN_MEMO are remembered
    monkeypatch.setattr(unpickler, "MAX_SCAN_MEMO", 1_000)
    data = b"\x80\x04\x8c\x05posix\x94" + b"\x94" * 50_000 + b"\x8c\x06system\x93\xff"
    (names, _), peak, _ = measured(lambda: scan_globals(data))
    assert names == ["posix.system"]
    assert peak < MEGA, f"{peak / MEGA:.1f} MiB"  # 50,000 slots: 5 MiB


def test_scan_work_is_capped(monkeypatch):
    # past MAX_SCAN_STEPS opcodes read one by one (about 1 µs each) the scan stops: a stream
    # that long with no tensor in it is reported damaged all the same
    monkeypatch.setattr(unpickler, "MAX_SCAN_STEPS", 100_000)
    data = b"\x80\x04\x8c\x05posix\x94" + b"h\x00" * 200_000 + b"\x8c\x06system\x93\xff"
    assert scan_globals(data) == ([], [])
    monkeypatch.setattr(unpickler, "MAX_SCAN_STEPS", 300_000)
    assert scan_globals(data) == (["posix.system"], ["posix.system"])
