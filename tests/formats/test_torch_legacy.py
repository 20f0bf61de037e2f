"""torch_legacy against torch itself, for `_use_new_zipfile_serialization=False` files, and for
plain pickle streams: globals from every pickle, never anything run."""

from __future__ import annotations

import io
import os
import pickle
import random
import struct
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import torch_samples as samples

from cachedoctor.formats import read_bytes, read_path, torch_legacy
from cachedoctor.formats.meta import PICKLE, TORCH_LEGACY, TORCH_ZIP
from cachedoctor.formats.source import BytesSource


def legacy(obj: object, **kwargs) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer, _use_new_zipfile_serialization=False, **kwargs)
    return buffer.getvalue()


def torch_verdict(data: bytes) -> Exception | None:
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # whatever torch raises is its verdict
        return exc
    return None


# ---- the same metadata as torch --------------------------------------------------------------


@pytest.mark.parametrize("seed", range(0, 200, 25))
def test_random_objects(tmp_path, seed):
    for s in range(seed, seed + 25):
        obj = samples.random_object(random.Random(s), samples.TYPED_DTYPES, nonfinite=True)
        path = tmp_path / f"{s}.pt"
        path.write_bytes(legacy(obj))
        meta = read_path(str(path), deep=s % 2 == 0)
        loaded = torch.load(path, weights_only=True)
        assert meta.format == TORCH_LEGACY and meta.errors == () and meta.unsafe_globals == ()
        assert samples.our_metas(meta) == samples.expected_metas(loaded)
        assert samples.shares_storage_as_torch(meta, loaded)
        if s % 2 == 0:
            assert dict(meta.nonfinite) == samples.nonfinite_counts(loaded)


def test_slice_of_a_batch():
    batch = torch.randn(16, 4, 8, 8).half()
    meta = read_bytes(legacy({"latent": batch[5]}), "x.pt")
    (latent,) = meta.tensors
    assert latent.storage_bytes == batch.numel() * 2 and latent.storage_offset == 5 * 256
    assert latent.location == "cpu" and meta.root == "dict"


@pytest.mark.skipif(not samples.saveable(torch.float8_e4m3fn), reason="this torch cannot save float8")
def test_new_dtypes_fail_like_torch():
    """A legacy file cannot hold an UntypedStorage (float8, uint16): torch.load fails on it."""
    data = legacy({"a": torch.zeros(3, dtype=torch.float8_e4m3fn)})
    assert "no attribute 'dtype'" in str(torch_verdict(data))
    meta = read_bytes(data, "x.pt")
    assert "UntypedStorage" in meta.errors[0]
    assert meta.tensors[0].dtype == "float8_e4m3fn"


def test_device_location(tmp_path):
    torch.serialization.register_package(1, lambda storage: "cuda:0", lambda s, loc: None)
    try:
        data = legacy({"latent": torch.ones(2)})
    finally:
        torch.serialization._package_registry[:] = [
            entry for entry in torch.serialization._package_registry if entry[0] != 1]
    assert [t.location for t in read_bytes(data, "x.pt").tensors] == ["cuda:0"]


# ---- views, as very old torch wrote them -------------------------------------------------------

MAGIC = 0x1950A86A20F9469CFC6C


class _Storage:
    def __init__(self, pid: tuple) -> None:
        self.pid = pid


class _Tensor:
    def __init__(self, *args) -> None:
        self.args = args

    def __reduce__(self):
        return torch._utils._rebuild_tensor_v2, self.args


class _LegacyPickler(pickle.Pickler):
    def persistent_id(self, obj):
        return obj.pid if isinstance(obj, _Storage) else None


def handmade_legacy(obj: object, storages: dict[str, tuple[bytes, int]]) -> bytes:
    """The legacy layout, written by hand so that storage views can be made."""
    out = io.BytesIO()
    for value in (MAGIC, 1001, {"protocol_version": 1001, "little_endian": True,
                                "type_sizes": {"short": 2, "int": 4, "long": 4}}):
        pickle.dump(value, out, protocol=2)
    _LegacyPickler(out, protocol=2).dump(obj)
    pickle.dump(sorted(storages), out, protocol=2)
    for key in sorted(storages):
        body, itemsize = storages[key]
        out.write(struct.pack("<q", len(body) // itemsize) + body)
    return out.getvalue()


def test_storage_views_read_like_torch():
    root = torch.tensor([1.0, 2.0, float("nan"), 4.0, 5.0, float("inf"), 7.0, 8.0])
    view = _Storage(("storage", torch.FloatStorage, "r", "cpu", 8, ("v", 2, 4)))
    obj = {"t": _Tensor(view, 1, (3,), (1,), False, OrderedDict())}
    data = handmade_legacy(obj, {"r": (root.numpy().tobytes(), 4)})
    loaded = torch.load(io.BytesIO(data), weights_only=True)
    meta = read_bytes(data, "x.pt", deep=True)
    assert meta.errors == ()
    assert samples.our_metas(meta) == samples.expected_metas(loaded)
    assert dict(meta.nonfinite) == samples.nonfinite_counts(loaded) == {("t",): 1}


def test_view_past_its_storage():
    view = _Storage(("storage", torch.FloatStorage, "r", "cpu", 4, ("v", 2, 4)))
    data = handmade_legacy([_Tensor(view, 0, (1,), (1,), False, OrderedDict())],
                           {"r": (bytes(16), 4)})
    assert "runs past the end of storage 'r'" in read_bytes(data, "x.pt").errors[0]


# ---- corruption --------------------------------------------------------------------------------


def test_truncated_at_every_offset():
    data = legacy({"latent": torch.ones(3, 2), "ids": torch.arange(4)})
    for cut in range(1, len(data)):
        meta = read_bytes(data[:cut], "x.pt")
        assert meta.errors, cut
        assert meta.format in (TORCH_LEGACY, PICKLE, TORCH_ZIP)  # 1 byte: no legacy magic yet
        assert torch_verdict(data[:cut]) is not None


def test_truncated_storage_says_how_much_is_missing():
    data = legacy({"latent": torch.ones(256)})
    meta = read_bytes(data[:-100], "x.pt")
    assert "unexpected EOF, expected 100 more bytes" in meta.errors[0]
    assert "unexpected EOF, expected 100 more bytes" in str(torch_verdict(data[:-100]))


def test_trailing_bytes():
    meta = read_bytes(legacy(torch.ones(4)) + b"\0" * 10, "x.pt")
    assert meta.errors[0].startswith("10 bytes follow the last storage")


def test_wrong_element_count():
    data = bytearray(legacy(torch.ones(4)))
    at = len(data) - 16 - 8
    assert struct.unpack_from("<q", data, at)[0] == 4
    struct.pack_into("<q", data, at, 3)
    meta = read_bytes(bytes(data), "x.pt")
    assert "expects 4" in meta.errors[0]
    assert torch_verdict(bytes(data)) is not None


def test_random_damage_never_escapes():
    rng = random.Random(5)
    base = legacy({"latent": torch.randn(4, 8).half(), "size": (64, 64)})
    for _ in range(1500):
        data = bytearray(base)
        for _ in range(rng.randint(1, 6)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        meta = read_bytes(bytes(data), "x.pt", deep=True)
        assert all(isinstance(e, str) and e for e in meta.errors)


def test_key_list_names_an_unknown_storage():
    data = legacy(torch.ones(2))
    keys = pickle.dumps([str(k) for k in (1, 2)], protocol=2)
    start = data.index(b"\x80\x02]")
    end = data.index(b".", start) + 1
    meta = read_bytes(data[:start] + keys + data[end:], "x.pt")
    assert any("never uses" in e for e in meta.errors)


# ---- plain pickle streams ---------------------------------------------------------------------


def test_plain_pickle():
    meta = read_bytes(pickle.dumps({"a": [1, 2], "b": OrderedDict(x=1)}, protocol=4), "x.pkl")
    assert meta.format == PICKLE and meta.errors == () and meta.root == "dict"
    assert meta.globals == ("collections.OrderedDict",) and meta.unsafe_globals == ()


@pytest.mark.parametrize("protocol", [0, 2, 5])
def test_tensors_pickled_by_pickle_itself(protocol):
    """pickle.dumps(tensor) stores the storage through torch.storage._load_from_bytes: unsafe
    (it runs torch.load), not damaged."""
    meta = read_bytes(pickle.dumps({"latent": torch.ones(2)}, protocol=protocol), "x.pkl")
    assert meta.errors == () and meta.unsafe_globals == ("torch.storage._load_from_bytes",)
    assert meta.format == PICKLE and meta.root == "dict"


def test_every_pickle_of_a_stream_is_read():
    stream = (pickle.dumps([1], protocol=2) + pickle.dumps({1, 2}, protocol=2)
              + b"cposix\nsystem\n(S'true'\ntR.")
    meta = read_bytes(stream, "x.pkl")
    assert meta.globals == ("builtins.set", "posix.system")
    assert meta.unsafe_globals == ("posix.system",) and meta.errors == ()


def test_bytes_after_a_pickle_that_are_no_pickle():
    meta = read_bytes(pickle.dumps([1], protocol=2) + b"\xff\xfe", "x.pkl")
    assert meta.errors and "pickle 2 at offset" in meta.errors[0]


@pytest.mark.parametrize("data", [b"hello world\n", b"\x00\x01\x02", "é".encode("latin-1") * 9])
def test_not_a_pickle(data):
    meta = torch_legacy.read(BytesSource(data), "x.pkl", False)
    assert meta.errors and meta.globals == ()


class Marker:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


@pytest.mark.parametrize("protocol", [0, 1, 2, 4, 5])
def test_hostile_plain_pickles_are_reported_not_run(tmp_path, protocol):
    marker = tmp_path / "pwned"
    data = pickle.dumps({"x": Marker(marker)}, protocol=protocol)
    for name in ("x.pkl", "x.pt"):  # a .pt without magic goes through the same reader
        meta = read_bytes(data, name)
        assert meta.unsafe_globals == ("posix.system",), (protocol, name)
    assert not marker.exists()


def test_hostile_legacy_torch_file(tmp_path):
    marker = tmp_path / "pwned"
    meta = read_bytes(legacy({"latent": torch.ones(2), "x": Marker(marker)}), "x.pt", deep=True)
    assert meta.format == TORCH_LEGACY and meta.unsafe_globals == ("posix.system",)
    assert meta.tensors[0].path == ("latent",) and meta.errors == ()
    assert not marker.exists()


def test_many_tiny_pickles_stop_at_the_cap():
    meta = read_bytes(b"\x80\x02N." * 5000, "x.pkl")
    assert "more than 1,000 pickles" in meta.errors[0]


def test_big_first_window_is_grown(tmp_path):
    """A pickle longer than the first read window is read again, whole."""
    obj = {f"key{i}": f"{i:06}" * 20 for i in range(2000)}
    data = legacy({"meta": obj, "latent": torch.ones(3)})
    assert data.index(b"\x80\x02]") > torch_legacy.WINDOW
    path = tmp_path / "big.pt"
    path.write_bytes(data + bytes(300_000))  # big enough to be read at head and tail
    meta = read_path(str(path))
    assert meta.format == TORCH_LEGACY and meta.tensors[0].path == ("latent",)
    assert meta.errors[0].startswith("300,000 bytes follow the last storage")
