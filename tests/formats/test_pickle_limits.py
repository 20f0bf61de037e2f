"""How much a pickle may make the reader build, how deep its tuples may nest, and how often a
broken one is read.

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
    assert "no latent or embedding holds that much" in meta.errors[0]
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
    assert len(data) > 4 * MEGA  # the old tuple check refused what it could not measure
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


# ---- how deep tuples nest ----------------------------------------------------------------------
#
# A tuple nested ~10^5 deep crashes CPython 3.11 when hashed (a dict key, a set member): the
# guard refuses past MAX_TUPLE_DEPTH before the C unpickler sees the stream, wherever in it the
# nesting is, and reads the millions of shallow tuples a big dataset's aggregate holds.

DEEP = 2 * pickle_guard.MAX_TUPLE_DEPTH
NESTS = f"nests tuples more than {pickle_guard.MAX_TUPLE_DEPTH:,} deep"


def test_a_onetrainer_aggregate_of_100k_samples_reads(tmp_path):
    # OneTrainer (mgds DiskCache) writes one aggregate.pt per variation: a dict per sample
    torch = pytest.importorskip("torch")
    aggregate = [{"crop_resolution": (1024, 768 + i % 5), "image_path": f"/data/photos/img_{i:06d}.png",
                  "crop_offset": (0, i % 3), "original_resolution": (2048, 1536)}
                 for i in range(100_000)]
    path = tmp_path / "aggregate.pt"
    torch.save(aggregate, path)
    started = time.perf_counter()
    meta = read_bytes(path.read_bytes(), str(path))
    assert meta.errors == () and meta.unsafe_globals == () and meta.globals == ()
    assert meta.format == "torch-zip" and meta.root == "list" and meta.tensors == ()
    assert time.perf_counter() - started < 20  # about 1.5 s on a 2-core machine


def test_a_million_small_tuples_read():
    rows = [(i, i + 1) for i in range(1_000_000)]
    data = pickle.dumps(rows)  # 11 MiB, 4 million opcodes
    started = time.perf_counter()
    meta = read_bytes(data, "rows.pkl")
    assert meta.errors == () and meta.root == "list" and meta.unsafe_globals == ()
    assert time.perf_counter() - started < 20  # about 1 s on a 2-core machine


def sane_padding(entries: int = 60_000) -> bytes:
    """List items a real cache holds, over 4 MiB of them: file names, sizes, small tuples."""
    items = []
    for i in range(entries):
        name = f"/data/latents/{i:07d}_{'x' * 40}.pt".encode()
        items.append(b"X" + len(name).to_bytes(4, "little") + name + b"J" + (i * 7919).to_bytes(4, "little")
                     + b"K\x05K\x07\x86" + b"\x87")  # (name, size, (5, 7))
    return b"".join(items)


def deep_list(item: bytes) -> bytes:
    """A protocol-2 list of sane padding, then `item` (opcodes that push one value)."""
    return b"\x80\x02](" + sane_padding() + item + b"e."


HOSTILE = {
    # each pushes one value holding a tuple DEEP levels deep
    "TUPLE1 repeated, as a dict key": b"}" + b"N" + b"\x85" * DEEP + b"Ns",
    "MARK...TUPLE nested, in a set": b"\x8f(" + b"(" * DEEP + b"N" + b"t" * DEEP + b"\x90",
    "TUPLE2 of (tuple, int), ops between": b"}" + b"N" + b"K\x07\x86q\x01N0" * DEEP + b"K\x01s",
    "TUPLE3 with GETs of a string": b"X\x01\x00\x00\x00sq\x02N" + b"h\x02h\x02\x87" * DEEP,
    "through memo PUT and GET": b"N\x85q\x03" + b"h\x03\x85q\x030" * DEEP + b"h\x03",
    "through MEMOIZE and LONG_BINGET, in a FROZENSET": b"(" + b"N\x85\x94" + b"".join(
        b"j" + i.to_bytes(4, "little") + b"\x85\x940" for i in range(DEEP))
        + b"j" + DEEP.to_bytes(4, "little") + b"\x91",
    "past a mark POP pops": b"}" + b"N" + b"\x85(0" * DEEP + b"Ns",
    "DUP and BUILD": b"N" + b"\x85" + b"2\x86Nb" * DEEP,
}


@pytest.mark.parametrize("name", HOSTILE)
def test_deep_nesting_past_4_mib_of_sane_data_is_refused(name, monkeypatch):
    data = deep_list(HOSTILE[name])
    assert len(data) > 4 * MEGA
    measured_depth = pickle_guard._tuple_depth(data, 0, len(data))
    assert measured_depth > pickle_guard.MAX_TUPLE_DEPTH
    monkeypatch.setattr(unpickler, "_RestrictedUnpickler", None)  # never given the stream
    started = time.perf_counter()
    with pytest.raises(UnpickleError, match=NESTS):
        load_restricted(data)
    assert time.perf_counter() - started < 20  # about 0.5 s on a 2-core machine


def test_shallow_nesting_of_every_shape_reads():
    # the same shapes a few levels deep, many times over: measured, and fine
    for item in (b"N\x85\x85\x85", b"(N\x85K\x01t", b"X\x01\x00\x00\x00sq\x020Nh\x02h\x02\x87\x85",
                 b"N\x85q\x030h\x03\x85q\x030h\x03", b"N\x852\x86Nb"):
        data = b"\x80\x02](" + item * (pickle_guard.MAX_TUPLE_DEPTH + 1) + b"e."
        found = load_restricted(data).obj
        assert len(found) == pickle_guard.MAX_TUPLE_DEPTH + 1, item


def test_nesting_too_long_to_measure_is_refused(monkeypatch):
    # past MAX_MEASURED_OPS opcodes that the shape does not bound, the pickle is refused
    monkeypatch.setattr(pickle_guard, "MAX_MEASURED_OPS", 100_000)
    data = deep_list(HOSTILE["through memo PUT and GET"])
    with pytest.raises(UnpickleError, match="too many tuple operations to check"):
        load_restricted(data)
    # and what the shape bounds is read however long it is
    assert len(load_restricted(deep_list(b"N")).obj) == 60_001


def test_a_hostile_stream_under_the_build_cap_is_checked_in_seconds():
    # 14 million opcodes (the most the build cap lets through is about this), a deep chain last
    data = b"\x80\x02" + b"N0" * 14_000_000 + b"N" + b"\x85" * DEEP + b"."
    started = time.perf_counter()
    with pytest.raises(UnpickleError, match="tuple"):
        load_restricted(data)
    assert time.perf_counter() - started < 30  # about 1.5 s on a 2-core machine


def python_depth(obj) -> int:
    # as the guard counts: lists break a chain (unhashable), () is no level
    if type(obj) is tuple and obj:
        return 1 + max(python_depth(v) for v in obj)
    return 0


def deepest_tuple(obj) -> int:
    deepest, stack, seen = 0, [obj], set()
    while stack:
        value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        deepest = max(deepest, python_depth(value))
        if isinstance(value, (tuple, list)):
            stack.extend(value)
        elif isinstance(value, dict):
            stack.extend([*value, *value.values()])
    return deepest


def is_hashable(value) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def random_object(rng: random.Random, shared: list, depth: int = 0):
    roll = rng.random()
    if depth > 12 or roll < 0.25:
        return rng.choice([1, 300, 70_000, 2**40, "s", "t" * 300, None, 1.5])
    if roll < 0.35 and shared:
        return rng.choice(shared)  # pickled once, then by GET
    if roll < 0.75:
        value = tuple(random_object(rng, shared, depth + 1) for _ in range(rng.randint(1, 4)))
    elif roll < 0.9:
        value = [random_object(rng, shared, depth + 1) for _ in range(rng.randint(0, 3))]
    else:
        keys = [random_object(rng, shared, depth + 1) if rng.random() < 0.3 else i
                for i in range(rng.randint(0, 2))]
        value = {key: random_object(rng, shared, depth + 1) for key in keys if is_hashable(key)}
    shared.append(value)
    return value


def test_the_shape_bound_and_the_measure_agree_with_python(monkeypatch):
    # with a small MAX_TUPLE_DEPTH the bound from the shape and the op-by-op measure both
    # decide on thousands of random pickles: neither may pass a tuple nested deeper
    monkeypatch.setattr(pickle_guard, "MAX_TUPLE_DEPTH", 4)
    rng = random.Random(5)
    bounded = refused = 0
    for _ in range(400):
        shared: list = []
        obj = [random_object(rng, shared) for _ in range(rng.randint(1, 4))]
        deepest = deepest_tuple(obj)
        for protocol in (0, 2, 4):
            data = pickle.dumps(obj, protocol=protocol)
            ops = b"".join(piece for piece, _ in pickle_guard._opcode_pieces(data, 0, len(data)))
            measured_depth = pickle_guard._tuple_depth(data, 0, len(data))
            assert measured_depth == deepest or (deepest > 4 and measured_depth == 5)
            if pickle_guard._shallow(ops):
                bounded += 1
                assert deepest <= 4, (obj, protocol)
            try:
                pickle_guard.check_stream(data)
                assert deepest <= 4
            except pickle_guard.StreamError as exc:
                assert deepest > 4 and "nests tuples more than 4 deep" in str(exc)
                refused += 1
    assert bounded > 200 and refused > 100, (bounded, refused)  # both ways are tried


def _repeated_calls(call: bytes, argument: bytes, times: int) -> bytes:
    """One big argument memoized, then handed to the same call `times` times (a few bytes of
    stream each): GLOBAL, GET, TUPLE1 (unless the argument is the call's whole argument tuple),
    REDUCE, POP."""
    wrap = b"" if argument.startswith(b"(") else b"\x85"
    return (b"\x80\x02" + argument + b"q\x00" + b"0"
            + (call + b"h\x00" + wrap + b"R0") * times + b"N.")


@pytest.mark.parametrize(("what", "call", "argument"), [
    ("_codecs.encode of a 1 MiB string", b"c_codecs\nencode\n",
     b"X" + (MEGA).to_bytes(4, "little") + b"a" * MEGA),
    ("a stub called with 256k arguments", b"cevil\nX\n",
     b"(" + b"N" * (256 * 1024) + b"t"),
    ("set() of a list of 64k items", b"c__builtin__\nset\n",
     b"]q\x01(" + b"K\x01" * (64 * 1024) + b"e"),
])
def test_calls_that_copy_one_memoized_argument_again_and_again_are_refused(
        what: str, call: bytes, argument: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 1 MB pickle reached 2 GB: each REDUCE is a few bytes, the copy it makes is not."""
    monkeypatch.setattr(unpickler, "MAX_COPIED_BYTES", 16 * MEGA)
    stream = _repeated_calls(call, argument, 64)  # 64 MiB of copies from ~1 MB
    def refused() -> str:
        with pytest.raises(UnpickleError, match="would copy more than 16 MiB") as caught:
            load_restricted(stream)
        return str(caught.value)

    _, peak, _ = measured(refused)
    assert peak < 40 * MEGA, what
    # the same call a few times is what real files do
    assert load_restricted(_repeated_calls(call, argument, 3)).obj is None
