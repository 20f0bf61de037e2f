"""The restricted unpickler: torch's allow-list, inert stubs, and hostile streams that must end
quickly in an error or a result, never in an import, a crash, a hang or gigabytes of memory."""

from __future__ import annotations

import io
import os
import pickle
import random
import struct
import subprocess
import sys
import time
import tracemalloc
import zipfile
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import torch_samples as samples
from torch import _weights_only_unpickler as torch_unpickler

from cachedoctor.formats.unpickler import (
    ALLOWED_GLOBALS,
    DTYPES,
    TensorRef,
    UnpickleError,
    load_restricted,
    root_kind,
    walk_tensors,
)

REPO = Path(__file__).resolve().parents[2]


def data_pkl(obj: object, protocol: int = 2) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer, pickle_protocol=protocol)
    with zipfile.ZipFile(buffer) as archive:
        return archive.read("archive/data.pkl")


def global_pickle(module: str, name: str) -> bytes:
    return b"\x80\x02c" + module.encode() + b"\n" + name.encode() + b"\n."


def torch_refuses(module: str, name: str) -> bool:
    """Whether torch's weights-only unpickler refuses the global. The exception is not compared:
    torch 2.4 raises RuntimeError, later releases pickle.UnpicklingError."""
    try:
        torch_unpickler.Unpickler(io.BytesIO(global_pickle(module, name))).load()
    except Exception:
        return True
    return False


# ---- the allow-list -------------------------------------------------------------------------


def test_allow_list_is_torchs():
    """The table mirrors torch 2.13's allow-list; an older torch allows fewer globals (2.4.1: no
    float8_e8m0fnu, no _codecs.encode), and none that the table lacks."""
    torchs = set(torch_unpickler._get_allowed_globals())
    assert torchs <= set(ALLOWED_GLOBALS), torchs - set(ALLOWED_GLOBALS)
    if torch.__version__.split("+")[0] == "2.13.0":
        assert set(ALLOWED_GLOBALS) == torchs


@pytest.mark.parametrize("full", sorted(torch_unpickler._get_allowed_globals()))
def test_every_global_torch_allows_is_safe(full):
    module, name = full.rsplit(".", 1)
    found = load_restricted(global_pickle(module, name))
    assert found.globals == [full]
    assert found.unsafe_globals == []


@pytest.mark.parametrize("full", [
    "posix.system", "os.system", "builtins.eval", "builtins.getattr", "builtins.exec",
    "copyreg._reconstructor", "numpy._core.multiarray._reconstruct", "torch.load",
    "torch.UntypedStorage", "torch.xpu.FloatStorage", "subprocess.Popen", "builtins.object",
    "torch.nn.modules.linear.Linear", "collections.defaultdict", "functools.partial",
])
def test_globals_torch_refuses_are_unsafe(full):
    module, name = full.rsplit(".", 1)
    assert torch_refuses(module, name)
    found = load_restricted(global_pickle(module, name))
    assert found.unsafe_globals == [full]


def test_protocol_2_builtin_names_map_to_builtins():
    found = load_restricted(pickle.dumps({1, 2}, protocol=2))
    assert found.globals == ["builtins.set"] and found.unsafe_globals == []
    assert found.obj == {1, 2}


@pytest.mark.skipif(not samples.saveable(torch.float8_e5m2), reason="this torch cannot save float8")
def test_globals_in_order_of_first_appearance():
    # float8 (torch >= 2.1) is saved as every dtype without a typed storage is: _rebuild_tensor_v3
    found = load_restricted(data_pkl({"a": torch.ones(2), "b": torch.zeros(1).to(torch.float8_e5m2)}))
    assert found.globals == [
        "torch._utils._rebuild_tensor_v2", "torch.FloatStorage", "collections.OrderedDict",
        "torch._utils._rebuild_tensor_v3", "torch.storage.UntypedStorage", "torch.float8_e5m2",
    ]


def test_dtype_sizes_are_torchs():
    """Every dtype this torch has; the table also knows newer ones (float8_e8m0fnu), which
    files from a newer torch carry."""
    present = [name for name in DTYPES if hasattr(torch, name)]
    assert {"float16", "bfloat16", "float32", "float8_e4m3fn", "int64", "bool"} <= set(present)
    for name in present:
        assert DTYPES[name].itemsize == getattr(torch, name).itemsize, name


# ---- what tensors become -----------------------------------------------------------------------


def test_tensors_and_storages():
    batch = torch.randn(4, 3, 8).half()
    found = load_restricted(data_pkl({"latent": batch[2], "ids": [torch.arange(5), (batch[1].t(),)]}))
    assert list(found.storages) == ["0", "1"]
    assert found.storages["0"].nbytes == batch.numel() * 2
    walked = [(path, t.dtype, t.shape, t.stride, t.storage_offset, t.storage.key)
              for path, t in walk_tensors(found.obj)]
    assert walked == [
        (("latent",), "float16", (3, 8), (8, 1), 48, "0"),
        (("ids", 0), "int64", (5,), (1,), 0, "1"),
        (("ids", 1, 0), "float16", (8, 3), (1, 8), 24, "0"),
    ]
    assert root_kind(found.obj) == "dict"


def test_parameter_requires_grad_and_new_dtypes():
    float8 = samples.saveable(torch.float8_e5m2)  # torch 2.1 cannot save float8
    obj = [torch.nn.Parameter(torch.ones(2, 2)), torch.ones(3, requires_grad=True),
           *[torch.zeros(4).to(torch.float8_e5m2)] * float8, torch.empty(2, device="meta")]
    tensors = [t for _, t in walk_tensors(load_restricted(data_pkl(obj)).obj)]
    assert [(t.dtype, t.requires_grad, t.location) for t in tensors] == [
        ("float32", True, "cpu"), ("float32", True, "cpu"), *[("float8_e5m2", False, "cpu")] * float8,
        ("float32", False, "meta")]
    assert tensors[-1].storage is None


@pytest.mark.parametrize("obj, kind", [(torch.ones(1), "tensor"), ([], "list"), ((), "tuple"),
                                       (OrderedDict(), "dict"), (3, "other")])
def test_root_kind(obj, kind):
    assert root_kind(load_restricted(data_pkl(obj)).obj) == kind


def test_walk_is_cycle_safe_and_keeps_shared_tensors():
    found = load_restricted(b"\x80\x02]q\x00h\x00a.")  # a list that holds itself
    assert list(walk_tensors(found.obj)) == []
    t = torch.ones(2)
    walked = [path for path, _ in walk_tensors(load_restricted(data_pkl([t, {"x": t}])).obj)]
    assert walked == [(0,), (1, "x")]


def test_file_like_is_left_after_the_pickle():
    stream = io.BytesIO(pickle.dumps(1, 2) + pickle.dumps("two", 2))
    assert load_restricted(stream).obj == 1
    assert load_restricted(stream).obj == "two"


def test_offset_and_end():
    data = b"junk" + pickle.dumps([1, 2], 2) + b"more"
    found = load_restricted(data, 4)
    assert found.obj == [1, 2] and data[found.end:] == b"more"


# ---- hostile pickles ---------------------------------------------------------------------------


class Marker:
    """Pickles as a call that would create a marker file."""

    def __init__(self, path: Path, via: str = "system") -> None:
        self.path, self.via = path, via

    def __reduce__(self):
        if self.via == "system":
            return os.system, (f"touch {self.path}",)
        return subprocess.call, (["touch", str(self.path)],)


@pytest.mark.parametrize("protocol", [0, 1, 2, 3, 4, 5])
def test_reduce_to_os_system_is_never_run(tmp_path, protocol):
    marker = tmp_path / "pwned"
    data = pickle.dumps({"x": Marker(marker), "y": [Marker(marker, "subprocess")]},
                        protocol=protocol)
    found = load_restricted(data)
    assert found.unsafe_globals == ["posix.system", "subprocess.call"]
    assert not marker.exists()
    assert list(walk_tensors(found.obj)) == []


class Everything:
    """Exercises NEWOBJ, BUILD with slot state, APPENDS and SETITEMS on an unknown class."""

    def __reduce_ex__(self, protocol):
        return (Everything, ("arg",), ({"latent": torch.ones(2)}, {"slot": 1}),
                iter([torch.zeros(1)]), iter([("k", torch.ones(3))]))


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])  # torch.save cannot write its ids in 0 or 1
def test_stubs_survive_every_opcode_and_keep_their_tensors(protocol):
    found = load_restricted(data_pkl({"obj": Everything(), "set": {1, 2}}, protocol))
    assert "test_unpickler.Everything" in found.unsafe_globals
    paths = [path for path, _ in walk_tensors(found.obj)]
    assert paths == [("obj", "latent"), ("obj", 0), ("obj", "k")]


def test_stub_accepts_any_call_and_state():
    # GLOBAL evil.X; call it, call the result, BUILD, append, setitem, newobj
    data = (b"\x80\x02cevil\nX\nq\x00)R)R}b(K\x01K\x02e(K\x01K\x02uh\x00)\x81K\x05\x85R.")
    found = load_restricted(data)
    assert found.unsafe_globals == ["evil.X"]


def test_build_cannot_change_shared_objects():
    # BUILD with slot state on torch.float16 would change every later file's itemsize
    data = b"\x80\x02ctorch\nfloat16\n}}X\x08\x00\x00\x00itemsizeK\x07s\x86b."
    with pytest.raises(UnpickleError):
        load_restricted(data)
    assert DTYPES["float16"].itemsize == 2
    # ...and a function's defaults
    data = b"\x80\x02ctorch\ndevice\nN}X\x0c\x00\x00\x00__defaults__K\x05\x85s\x86b."
    with pytest.raises(UnpickleError):
        load_restricted(data)


def test_bytearray_never_allocates_from_an_int():
    with pytest.raises(UnpickleError, match="allocate"):
        load_restricted(b"\x80\x02c__builtin__\nbytearray\nJ\xff\xff\xff\x7f\x85R.")
    assert load_restricted(pickle.dumps(bytearray(b"ab"), 2)).obj == bytearray(b"ab")


def test_codecs_encode_only_for_torchs_codecs():
    assert load_restricted(pickle.dumps(b"\xff\x00", 2)).obj == b"\xff\x00"
    with pytest.raises(UnpickleError):
        load_restricted(b"\x80\x02c_codecs\nencode\nX\x01\x00\x00\x00aX\x04\x00\x00\x00zlib\x86R.")


def test_persistent_ids_other_than_storages_are_refused():
    with pytest.raises(UnpickleError, match="not a torch storage"):
        load_restricted(b"\x80\x02X\x03\x00\x00\x00abcQ.")
    with pytest.raises(UnpickleError, match="not a torch storage"):
        load_restricted(b"Pabc\n.")


def test_partial_globals_survive_a_broken_stream():
    data = pickle.dumps(Marker(Path("/nonexistent/x")), 2)[:-1] + b"R."  # REDUCE on an empty stack
    with pytest.raises(UnpickleError) as info:
        load_restricted(data)
    assert "posix.system" in info.value.unsafe_globals


MEGA = 1 << 20


@pytest.mark.parametrize("name, data", [
    ("LONG_BINPUT to slot 2^32-1", b"\x80\x02Nr\xff\xff\xff\xff."),
    ("LONG_BINPUT to slot 2^31", b"\x80\x02Nr\x00\x00\x00\x80."),
    ("PUT to slot 10^12", b"Np1000000000000\n."),
    ("PUT with spaces", b"Np 99999999999\n."),
    ("BINBYTES8 of 2^60", b"\x80\x05\x8e" + struct.pack("<Q", 1 << 60) + b"x."),
    ("BINBYTES8 of 50 GiB", b"\x80\x05\x8e" + struct.pack("<Q", 50 << 30) + b"x."),
    ("BYTEARRAY8 of 50 GiB", b"\x80\x05\x96" + struct.pack("<Q", 50 << 30) + b"x."),
    ("BINUNICODE8 of 50 GiB", b"\x80\x04\x8d" + struct.pack("<Q", 50 << 30) + b"x."),
    ("BINUNICODE of 4 GiB", b"\x80\x02X\xff\xff\xff\xffx."),
    ("LONG4 of 2 GiB", b"\x80\x02\x8b\xff\xff\xff\x7fx."),
    ("LONG4 negative", b"\x80\x02\x8b\xff\xff\xff\xffx."),
    ("FRAME of 2^63", b"\x80\x04\x95" + struct.pack("<Q", 1 << 63) + b"N."),
    ("decimal LONG of 10^5 digits", b"L" + b"9" * 100_000 + b"L\n."),
    ("tuple 10^6 deep as a dict key", b"\x80\x02})" + b"\x85" * 1_000_000 + b"Ns."),
    ("tuple 10^6 deep in a set", b"\x80\x04\x8f(" + b")" + b"\x85" * 1_000_000 + b"\x90."),
    ("marks 10^5 deep", b"\x80\x02" + b"(" * 100_000 + b"t" * 100_000 + b"."),
    ("lists 10^5 deep", b"\x80\x02" + b"]" * 100_000 + b"a" * 99_999 + b"."),
    ("dicts 10^5 deep", b"\x80\x02" + b"}K\x01" * 100_000 + b"s" * 99_999 + b"."),
    ("stubs 10^5 deep", b"\x80\x02cevil\nX\nq\x00" + b"h\x00" * 100_000
     + b"h\x00\x85R" * 0 + b")R" + b"\x85R" * 99_999 + b"."),
    ("self-referencing dict", b"\x80\x02}q\x00h\x00K\x01h\x00s."),
    ("memo slots 10^6", b"\x80\x04N" + b"\x94" * MEGA + b"."),
    ("many distinct globals", b"\x80\x02" + b"".join(b"cm\nn%d\n0" % i for i in range(20_000))
     + b"N."),
    ("a million tensors references", None),
])
def test_hostile_streams_end_quickly(name, data):
    if data is None:  # one tensor, referenced from a million list slots
        one = data_pkl(torch.ones(1))[2:-1]  # the tensor's opcodes, without PROTO and STOP
        data = b"\x80\x02]q\x00" + one + b"q\x01(" + b"h\x01" * MEGA + b"e."
    started = time.perf_counter()
    try:
        found = load_restricted(data)
        sum(1 for _ in walk_tensors(found.obj))
    except UnpickleError as exc:
        assert str(exc)
    assert time.perf_counter() - started < 5, name


@pytest.mark.parametrize("data", [
    b"\x80\x02Nr\x00\x00\x00\x40.", b"Np500000000\n.",
    b"\x80\x05\x8e" + struct.pack("<Q", 8 << 30) + b"x.",
    b"\x80\x05\x96" + struct.pack("<Q", 8 << 30) + b"x.",
    b"\x80\x02X\x00\x00\x00\x40x.",
    b"\x80\x02c__builtin__\nbytearray\nJ\xff\xff\xff\x7f\x85R.",
])
def test_allocation_attacks_allocate_nothing(data):
    """Not even address space: tracemalloc sees the C unpickler's memo and bytes requests."""
    tracemalloc.start()
    try:
        with pytest.raises(UnpickleError):
            load_restricted(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 10 * MEGA


def test_truncated_at_every_offset():
    data = data_pkl({"latent": torch.ones(2, 3).half(), "size": (64, 64)})
    for cut in range(len(data)):
        with pytest.raises(UnpickleError) as info:
            load_restricted(data[:cut])
        assert str(info.value)


def test_random_damage_never_escapes():
    rng = random.Random(7)
    base = data_pkl({"latent": torch.ones(2, 3).half(), "ids": torch.arange(4), "x": (1, "a")})
    for _ in range(3000):
        data = bytearray(base)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            found = load_restricted(bytes(data))
            list(walk_tensors(found.obj))
        except UnpickleError as exc:
            assert str(exc)
    for _ in range(300):
        try:
            load_restricted(os.urandom(rng.randint(0, 300)))
        except UnpickleError as exc:
            assert str(exc)


def test_not_a_pickle_says_so():
    with pytest.raises(UnpickleError, match="no pickle data"):
        load_restricted(b"")
    with pytest.raises(UnpickleError, match="not a pickle opcode"):
        load_restricted(b"\x00\x00\x00")
    with pytest.raises(UnpickleError, match="truncated"):
        load_restricted(b"\x80\x02K")


def test_tensor_arguments_are_checked():
    good = data_pkl(torch.ones(2))
    bad_shape = good.replace(b"K\x02\x85", b"J\xff\xff\xff\xff\x85", 1)  # shape (-1,)
    with pytest.raises(UnpickleError, match="negative"):
        load_restricted(bad_shape)


def test_reading_never_imports_torch():
    code = (
        "import sys, pickle\n"
        "from cachedoctor.formats.unpickler import load_restricted, walk_tensors\n"
        f"data = {data_pkl({'a': torch.ones(2)})!r}\n"
        "found = load_restricted(data); list(walk_tensors(found.obj))\n"
        "load_restricted(pickle.dumps({1, 2}, 2))\n"
        "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, sorted(sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr


def test_tensor_ref_types():
    tensors = [t for _, t in walk_tensors(load_restricted(data_pkl(torch.ones(3))).obj)]
    assert type(tensors[0]) is TensorRef
