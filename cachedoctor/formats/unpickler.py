"""A restricted unpickler: reads torch's pickles into inert stand-ins, imports and runs nothing.

`find_class` answers from a fixed table that mirrors torch 2.13's weights-only allow-list
(`torch/_weights_only_unpickler.py::_get_allowed_globals`), with our own factories in place of
torch's: a tensor becomes a TensorRef (dtype, shape, stride, offset, storage), a storage a
StorageRef. Every other global is recorded as unsafe and becomes an inert Stub class that accepts
any call, BUILD, APPEND or SETITEM and does nothing else; nothing is ever imported or resolved.

Before the C unpickler sees a stream, pickle_guard checks it for what the C unpickler would
survive badly (huge memo indices, deeply nested tuples, lying lengths, more objects than any
cache holds). A stream that cannot be read is scanned for the globals it names, once.
"""

from __future__ import annotations

import _compat_pickle
import functools
import io
import pickle
import pickletools
import re
import warnings
from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from cachedoctor.formats.meta import INT64_MAX, number_text
from cachedoctor.formats.pickle_guard import OPS, StreamError, check_stream, token_patterns

MAX_PICKLE_BYTES = 64 * 1024 * 1024
MAX_GLOBALS = 10_000  # distinct globals one pickle may name (each costs a stub class)
MAX_WALK_DEPTH = 256
MAX_WALK_ITEMS = 10_000_000
MAX_TENSORS = 100_000


class UnpickleError(Exception):
    """The stream is not a pickle we can read; str() is a sentence for a user.

    `globals` and `unsafe_globals` hold what was seen before the failure: a hostile pickle that
    breaks halfway is still reported for the globals it named.
    """

    def __init__(self, message: str, globals: list[str] | None = None,
                 unsafe_globals: list[str] | None = None, *, truncated: bool = False,
                 scan: tuple[bytes, int] | None = None) -> None:
        super().__init__(message)
        self._globals = globals or []
        self._unsafe = unsafe_globals or []
        self._scan = scan  # (data, offset): scanned for globals when they are first asked for
        self.truncated = truncated

    @property
    def globals(self) -> list[str]:
        self._scan_once()
        return self._globals

    @property
    def unsafe_globals(self) -> list[str]:
        self._scan_once()
        return self._unsafe

    def _scan_once(self) -> None:
        # A reader that retries with more data never asks: the stream is scanned once, at most.
        if self._scan is not None:
            names, unsafe = scan_globals(*self._scan)
            self._scan = None
            self._globals = list(dict.fromkeys([*self._globals, *names]))
            self._unsafe = list(dict.fromkeys([*self._unsafe, *unsafe]))


class _Inert:
    """Base of our shared objects: BUILD must not change them for the next file."""

    __slots__ = ()

    def __setstate__(self, state: object) -> None:
        raise pickle.UnpicklingError(f"the pickle tries to change {self!r} (BUILD)")


class DType(_Inert):
    __slots__ = ("itemsize", "name")

    def __init__(self, name: str, itemsize: int) -> None:
        self.name, self.itemsize = name, itemsize

    def __repr__(self) -> str:
        return f"torch.{self.name}"


class StorageType(_Inert):
    __slots__ = ("dtype", "name")

    def __init__(self, name: str, dtype: DType) -> None:
        self.name, self.dtype = name, dtype

    def __repr__(self) -> str:
        return f"torch.{self.name}"


class StorageRef(_Inert):
    """A storage named by a persistent id. A legacy file can also name a view into one: then
    `root` is the key of the storage whose bytes the file holds and `root_offset` (bytes) says
    where the view starts in it."""

    __slots__ = ("dtype", "itemsize", "key", "location", "nbytes", "numel", "root",
                 "root_offset", "untyped")

    def __init__(self, key: str, stype: StorageType, location: str, numel: int,
                 root: str | None = None, root_offset: int = 0) -> None:
        self.key, self.location, self.numel = key, location, numel
        self.dtype, self.itemsize = stype.dtype.name, stype.dtype.itemsize
        self.nbytes = numel * self.itemsize
        self.untyped = stype is UNTYPED_STORAGE
        self.root, self.root_offset = key if root is None else root, root_offset

    def __repr__(self) -> str:
        return f"StorageRef({self.key!r}, {self.dtype}, {self.nbytes} B, {self.location!r})"


class TensorRef:
    """A tensor as pickled: never any values. `storage` is None for meta and wrapper tensors."""

    __slots__ = ("dtype", "itemsize", "location", "requires_grad", "shape", "storage",
                 "storage_offset", "stride")

    def __init__(self, storage: StorageRef | None, storage_offset: int, shape: tuple[int, ...],
                 stride: tuple[int, ...], dtype: DType, requires_grad: bool,
                 location: str) -> None:
        self.storage, self.storage_offset = storage, storage_offset
        self.shape, self.stride = shape, stride
        self.dtype, self.itemsize = dtype.name, dtype.itemsize
        self.requires_grad, self.location = requires_grad, location

    def __setstate__(self, state: object) -> None:
        """torch accepts BUILD on a tensor (legacy `set_`); nothing of it is metadata."""

    def copy(self, **changes: Any) -> TensorRef:
        new = object.__new__(TensorRef)
        for name in TensorRef.__slots__:
            setattr(new, name, changes.get(name, getattr(self, name)))
        return new

    def __repr__(self) -> str:
        key = self.storage.key if self.storage is not None else None
        return (f"TensorRef({self.dtype}, shape={self.shape}, stride={self.stride}, "
                f"offset={self.storage_offset}, storage={key!r}, {self.location!r})")


# What the calls of one load may copy of their arguments. Each REDUCE costs the stream a few
# bytes, however big the memoized argument it is given: a 1 MB string encoded 2,000 times, or a
# tuple of a million items handed to a stub again and again, builds gigabytes from a megabyte.
# pickle_guard's estimate counts what opcodes build; this counts what calls copy. Each load
# has its own count (the calls reach it through a context variable, since they are the
# globals' stand-ins, not the unpickler's methods), so loads in threads never share one.
MAX_COPIED_BYTES = 256 * 1024 * 1024


class _Copied:
    __slots__ = ("bytes",)

    def __init__(self) -> None:
        self.bytes = 0


_copied: ContextVar[_Copied] = ContextVar("cachedoctor_unpickler_copied")


def _charge(value: object, per_item: int = 8) -> None:
    """Count a call's copy of `value` (its characters or bytes; `per_item` per entry of a
    container) against MAX_COPIED_BYTES."""
    copied = _copied.get(None)
    if copied is None:  # a stand-in called outside a load: nothing to count against
        return
    if isinstance(value, (str, bytes, bytearray)):
        copied.bytes += len(value)
    elif isinstance(value, (tuple, list, dict, set, frozenset)):
        copied.bytes += per_item * len(value)
    if copied.bytes > MAX_COPIED_BYTES:
        raise pickle.UnpicklingError(
            f"the pickle's calls would copy more than {MAX_COPIED_BYTES // 2**20} MiB of their "
            "arguments (one memoized value handed to a call again and again)")


class Stub:
    """Stand-in for a global we do not interpret: keeps what the pickle gave it, runs nothing."""

    __slots__ = ("args", "items", "kwargs", "mapping", "state")
    global_name = "?"
    unsafe = True

    def __new__(cls, *args: Any, **kwargs: Any) -> Stub:
        _charge(args)  # *args repacks them: a copy of every reference
        _charge(kwargs)
        self = object.__new__(cls)
        self.args, self.kwargs = args, kwargs
        self.state, self.items, self.mapping = None, [], {}
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Stub:
        return type(self)(*args, **kwargs)

    def __setstate__(self, state: object) -> None:
        self.state = state

    def append(self, item: object) -> None:
        self.items.append(item)

    def extend(self, items: list) -> None:
        self.items.extend(items)

    def add(self, item: object) -> None:
        self.items.append(item)

    def __setitem__(self, key: object, value: object) -> None:
        self.mapping[key] = value

    def __repr__(self) -> str:
        return f"<stub {self.global_name}>"

    def children(self) -> Iterator[tuple[object, object]]:
        """What this object holds, under the names the walk puts in a path."""
        yield from enumerate(self.args)
        yield from self.kwargs.items()
        states = self.state if isinstance(self.state, tuple) else (self.state,)
        for state in states:
            if isinstance(state, dict):
                yield from state.items()
            elif state is not None:
                yield "__state__", state
        yield from enumerate(self.items)
        yield from self.mapping.items()


def _stub_class(full_name: str, unsafe: bool) -> type[Stub]:
    return type(f"Stub[{full_name}]", (Stub,),
                {"__slots__": (), "global_name": full_name, "unsafe": unsafe})


class _Factory(_Inert):
    """One of our functions, callable by REDUCE, unchangeable by BUILD."""

    __slots__ = ("fn",)

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<factory {self.fn.__name__}>"


# ---- dtypes and storage types, as torch 2.13 allows them ----------------------------------

_DTYPE_SIZES = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "complex32": 4, "complex64": 8, "complex128": 16,
    "qint8": 1, "quint8": 1, "qint32": 4, "quint4x2": 1, "quint2x4": 1,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1,
    "bits1x8": 1, "bits2x4": 1, "bits4x2": 1, "bits8": 1, "bits16": 2,
    "uint16": 2, "uint32": 4, "uint64": 8,
    **{f"uint{n}": 1 for n in range(1, 8)}, **{f"int{n}": 1 for n in range(1, 8)},
}
DTYPES = {name: DType(name, size) for name, size in _DTYPE_SIZES.items()}
_UINT8 = DTYPES["uint8"]

_STORAGE_DTYPES = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16",
    "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16",
    "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool",
    "BFloat16Storage": "bfloat16", "ComplexDoubleStorage": "complex128",
    "ComplexFloatStorage": "complex64",
}
_QUANTIZED_STORAGE_DTYPES = {
    "QInt8Storage": "qint8", "QUInt8Storage": "quint8", "QInt32Storage": "qint32",
    "QUInt4x2Storage": "quint4x2", "QUInt2x4Storage": "quint2x4",
}
UNTYPED_STORAGE = StorageType("UntypedStorage", _UINT8)

# ---- factories for the allowed callables ----------------------------------------------------


def _ints(value: object, what: str) -> tuple[int, ...]:
    if type(value) is not tuple:
        if type(value) is not list:
            raise pickle.UnpicklingError(f"a tensor's {what} is not a tuple of integers")
        value = tuple(value)
    for v in value:
        if type(v) is not int or not 0 <= v <= INT64_MAX:
            raise pickle.UnpicklingError(f"a tensor's {what} holds {_kind_of(v)}")
    return value


def _kind_of(v: object) -> str:
    if type(v) is int:  # torch keeps sizes, strides and offsets in int64
        return "a negative number" if v < 0 else f"{number_text(v)}, more than int64 holds"
    return f"a {type(v).__name__}, not an integer"


# torch.Tensor, and what a tensor becomes when it is built from a global we do not interpret
# (its storage pickled by torch.storage._load_from_bytes, say): that global is reported
# unsafe, and the tensor has no metadata to give, which is no error in the file.
_OpaqueTensor = _stub_class("torch.Tensor", unsafe=False)


def _tensor(storage: object, storage_offset: object, size: object, stride: object,
            dtype: object, requires_grad: object) -> TensorRef | Stub:
    if type(storage) is not StorageRef or type(dtype) is not DType:
        if isinstance(storage, Stub) or isinstance(dtype, Stub):
            return _OpaqueTensor(storage, storage_offset, size, stride, dtype)
        if type(storage) is not StorageRef:
            raise pickle.UnpicklingError("a tensor's storage is not a torch storage reference")
        raise pickle.UnpicklingError("a tensor's dtype is not a torch dtype")
    if type(storage_offset) is not int or storage_offset < 0:
        raise pickle.UnpicklingError("a tensor's storage offset is not a non-negative integer")
    if type(requires_grad) is not bool:
        raise pickle.UnpicklingError("a tensor's requires_grad is not True or False")
    shape, strides = _ints(size, "shape"), _ints(stride, "stride")
    if len(shape) != len(strides):
        raise pickle.UnpicklingError(
            f"a tensor has {len(shape)} dimensions but {len(strides)} strides")
    return TensorRef(storage, storage_offset, shape, strides, dtype, requires_grad,
                     storage.location)


def _storage_dtype(storage: object) -> DType | None:
    return DTYPES[storage.dtype] if type(storage) is StorageRef else None


def _rebuild_tensor(storage, storage_offset, size, stride):
    return _tensor(storage, storage_offset, size, stride, _storage_dtype(storage), False)


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, backward_hooks,
                       metadata=None):
    return _tensor(storage, storage_offset, size, stride, _storage_dtype(storage), requires_grad)


def _rebuild_tensor_v3(storage, storage_offset, size, stride, requires_grad, backward_hooks,
                       dtype, metadata=None):
    return _tensor(storage, storage_offset, size, stride, dtype, requires_grad)


def _rebuild_qtensor(storage, storage_offset, size, stride, quantizer_params, requires_grad,
                     backward_hooks):
    return _tensor(storage, storage_offset, size, stride, _storage_dtype(storage), requires_grad)


def _as_parameter(data: object, requires_grad: object) -> TensorRef | Stub:
    if isinstance(data, Stub):
        return data
    if type(data) is not TensorRef:
        raise pickle.UnpicklingError("an nn.Parameter wraps something that is not a tensor")
    if type(requires_grad) is not bool:
        raise pickle.UnpicklingError("an nn.Parameter's requires_grad is not True or False")
    return data.copy(requires_grad=requires_grad)


def _rebuild_parameter(data, requires_grad, backward_hooks):
    return _as_parameter(data, requires_grad)


def _rebuild_parameter_with_state(data, requires_grad, backward_hooks, state):
    return _as_parameter(data, requires_grad)


class _Parameter(_Inert):
    """torch.nn.parameter.Parameter: a type, so that NEWOBJ works as well as REDUCE."""

    __slots__ = ()

    def __new__(cls, data: object = None, requires_grad: object = True) -> TensorRef:  # type: ignore[misc]
        return _as_parameter(data, requires_grad)


def _rebuild_meta_tensor_no_storage(dtype, size, stride, requires_grad):
    if isinstance(dtype, Stub):
        return _OpaqueTensor(dtype, size, stride)
    if type(dtype) is not DType:
        raise pickle.UnpicklingError("a tensor's dtype is not a torch dtype")
    if type(requires_grad) is not bool:
        raise pickle.UnpicklingError("a tensor's requires_grad is not True or False")
    return TensorRef(None, 0, _ints(size, "shape"), _ints(stride, "stride"), dtype,
                     requires_grad, "meta")


def _rebuild_wrapper_subclass(cls, dtype, size, stride, storage_offset, layout, device,
                              requires_grad):
    if isinstance(dtype, Stub):
        return _OpaqueTensor(dtype, size, stride)
    if type(dtype) is not DType or type(device) is not str:
        raise pickle.UnpicklingError("a wrapper tensor's dtype or device is malformed")
    return TensorRef(None, 0, _ints(size, "shape"), _ints(stride, "stride"), dtype,
                     bool(requires_grad), device)


def _rebuild_device_tensor_from_cpu_tensor(data, dtype, device, requires_grad):
    if isinstance(data, Stub):
        return data
    if type(data) is not TensorRef or type(device) is not str:
        raise pickle.UnpicklingError("a device tensor's data or device is malformed")
    return data.copy(location=device, requires_grad=bool(requires_grad))


def _rebuild_from_type_v2(func, new_type, args, state):
    if type(args) is not tuple:
        raise pickle.UnpicklingError("_rebuild_from_type_v2 got arguments that are no tuple")
    return func(*args)


def _size(*args: object) -> tuple[int, ...]:
    if not args:
        return ()
    if type(args[0]) not in (tuple, list) or any(type(v) is not int for v in args[0]):
        raise pickle.UnpicklingError("torch.Size holds something other than integers")
    if any(abs(v) > INT64_MAX for v in args[0]):
        raise pickle.UnpicklingError("torch.Size holds a number past int64")
    _charge(args[0])
    return tuple(args[0])


def _device(kind: object, index: object = None) -> str:
    if type(kind) is not str or (index is not None and type(index) is not int):
        raise pickle.UnpicklingError("torch.device is given something other than a name")
    return kind if index is None else f"{kind}:{index}"


_CODECS = {"latin1", "latin-1", "iso-8859-1", "utf-8", "utf8", "ascii"}


def _encode(obj: object, encoding: object = "utf-8", errors: object = "strict") -> bytes:
    # _codecs.encode looks codecs up by name, which can import modules: allow torch's own.
    if (type(obj) is not str or type(encoding) is not str or type(errors) is not str
            or encoding.lower().replace("_", "-") not in _CODECS):
        raise pickle.UnpicklingError("_codecs.encode is asked for something other than text")
    _charge(obj)
    return obj.encode(encoding, errors)


def _bytearray(*args: object) -> bytearray:
    if args and isinstance(args[0], int):
        raise pickle.UnpicklingError(
            f"the pickle asks bytearray() to allocate {args[0]:,} bytes")
    if args:
        _charge(args[0])
    return bytearray(*args)


def _counter(*args: object, **kwargs: object) -> Counter:
    # collections.Counter is a Python class a BUILD could modify: hand out instances only.
    if args:
        _charge(args[0], per_item=_HASHED)
    return Counter(*args, **kwargs)


_HASHED = 64  # bytes per entry of a set or dict built from a container


def _set(*args: object) -> set:
    if args:
        _charge(args[0], per_item=_HASHED)
    return set(*args)


def _ordered_dict(*args: object, **kwargs: object) -> OrderedDict:
    if args:
        _charge(args[0], per_item=_HASHED)
    return OrderedDict(*args, **kwargs)


def _allowed_globals() -> dict[str, object]:
    table: dict[str, object] = {
        "collections.OrderedDict": _Factory(_ordered_dict),
        "collections.Counter": _Factory(_counter),
        "builtins.set": _Factory(_set),
        "builtins.complex": complex,
        "builtins.bytearray": _Factory(_bytearray),
        "_codecs.encode": _Factory(_encode),
        "torch.Size": _Factory(_size),
        "torch.device": _Factory(_device),
        "torch.nn.parameter.Parameter": _Parameter,
        "torch._tensor._rebuild_from_type_v2": _Factory(_rebuild_from_type_v2),
        "torch.storage.UntypedStorage": UNTYPED_STORAGE,
    }
    for fn in (_rebuild_tensor, _rebuild_tensor_v2, _rebuild_tensor_v3, _rebuild_qtensor,
               _rebuild_parameter, _rebuild_parameter_with_state, _rebuild_meta_tensor_no_storage,
               _rebuild_wrapper_subclass, _rebuild_device_tensor_from_cpu_tensor):
        table[f"torch._utils.{fn.__name__}"] = _Factory(fn)
    for name, dtype in DTYPES.items():
        table[f"torch.{name}"] = dtype
    for name, dtype in (_STORAGE_DTYPES | _QUANTIZED_STORAGE_DTYPES).items():
        table[f"torch.{name}"] = StorageType(name, DTYPES[dtype])
    for name, dtype in _STORAGE_DTYPES.items():
        table[f"torch.cuda.{name}"] = StorageType(name, DTYPES[dtype])
    # Allowed by torch but nothing we read metadata from: inert, and not unsafe.
    kinds = ("BFloat16", "Byte", "Char", "Double", "Float", "Half", "Int", "Long", "Short")
    table["torch.Tensor"] = _OpaqueTensor
    opaque = ["torch.storage.TypedStorage", "torch.serialization._get_layout",
              "torch._utils._rebuild_sparse_tensor", "torch._utils._rebuild_nested_tensor",
              "torch._utils._rebuild_device_tensor_from_numpy"]
    opaque += [f"torch.{q}" for q in ("per_tensor_affine", "per_tensor_symmetric",
                                      "per_channel_affine", "per_channel_symmetric",
                                      "per_channel_affine_float_qparams")]
    for module in ("torch", "torch.cuda"):
        opaque += [f"{module}.{k}Tensor" for k in (*kinds, "Bool")]
    for module in ("torch.sparse", "torch.cuda.sparse"):
        opaque += [f"{module}.{k}Tensor" for k in kinds]
    for name in opaque:
        table[name] = _stub_class(name, unsafe=False)
    return table


ALLOWED_GLOBALS = _allowed_globals()
# (module, name) as a pickle writes them -> (full name, object), for allowed globals only: the
# old names that map to them (`__builtin__ set`) are few, so this stays small.
_ALLOWED_BY_RAW_NAME = {tuple(full.rsplit(".", 1)): (full, obj)
                        for full, obj in ALLOWED_GLOBALS.items()}
# torch refuses these under weights_only, but they name a storage type and nothing else: the
# file is reported unsafe, and its tensors are still read.
_TOLERATED = {"torch.UntypedStorage": UNTYPED_STORAGE}


# ---- the unpickler ---------------------------------------------------------------------------


class _Input:
    """A file for the C unpickler whose peek() hands over the whole pickle at once: without
    peek it calls read() once per opcode, three times slower."""

    __slots__ = ("_data", "_pos")

    def __init__(self, data: bytes) -> None:
        self._data, self._pos = data, 0

    def peek(self, n: int = 0) -> bytes:
        return self._data[self._pos:]

    def read(self, n: int = -1) -> bytes:
        start = self._pos
        self._pos = len(self._data) if n < 0 else min(len(self._data), start + n)
        return self._data[start:self._pos]

    def readinto(self, buffer: memoryview) -> int:
        chunk = self.read(len(buffer))
        buffer[: len(chunk)] = chunk
        return len(chunk)

    def readline(self) -> bytes:
        start = self._pos
        end = self._data.find(b"\n", start)
        self._pos = len(self._data) if end < 0 else end + 1
        return self._data[start:self._pos]


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, legacy: bool) -> None:
        super().__init__(_Input(data), encoding="utf-8")
        self.legacy = legacy
        self.pid_fields = 6 if legacy else 5
        self.found: dict[tuple[str, str], tuple[str, object]] = {}  # unsafe, this pickle only
        self.names: dict[str, None] = {}  # ordered sets
        self.unsafe: dict[str, None] = {}
        self.storages: dict[str, StorageRef] = {}  # views too, under their own keys

    def find_class(self, module: str, name: str) -> object:
        hit = _ALLOWED_BY_RAW_NAME.get((module, name))
        if hit is None:
            hit = self._unknown(module, name)
        full, obj = hit
        self.names[full] = None
        return obj

    def _unknown(self, module: str, name: str) -> tuple[str, object]:
        key = (module, name)
        hit = self.found.get(key)
        if hit is not None:
            return hit
        full, allowed = classify_global(module, name)  # protocol 2 writes __builtin__.set
        obj = ALLOWED_GLOBALS.get(full)
        if allowed:  # allowed under an old name: remembered for every later file
            _ALLOWED_BY_RAW_NAME[key] = (full, obj)
            return full, obj
        if len(self.found) >= MAX_GLOBALS:
            raise pickle.UnpicklingError(f"the pickle names more than {MAX_GLOBALS:,} globals")
        self.unsafe[full] = None
        hit = self.found[key] = (full, _TOLERATED.get(full) or _stub_class(full, unsafe=True))
        return hit

    def persistent_load(self, pid: object) -> StorageRef:
        if type(pid) is not tuple or not pid or (pid[0] != "storage" and pid[0] != b"storage"):
            raise pickle.UnpicklingError(
                "the pickle refers to an external object that is not a torch storage")
        if len(pid) != self.pid_fields:
            raise pickle.UnpicklingError(
                f"a storage reference has {len(pid)} fields instead of {self.pid_fields}")
        stype, key, location, numel = pid[1], pid[2], pid[3], pid[4]
        if type(key) is not str or type(location) is not str:  # py2-era files hold bytes
            key, location = _text(key), _text(location)
        root = self.storages.get(key)  # type: ignore[arg-type]
        if root is None:
            if type(stype) is not StorageType:
                raise pickle.UnpicklingError("a storage reference names no torch storage type")
            if key is None or location is None or type(numel) is not int or numel < 0:
                raise pickle.UnpicklingError(
                    "a storage reference has a malformed key, location or size")
            if numel * stype.dtype.itemsize > INT64_MAX:
                raise pickle.UnpicklingError(
                    f"storage '{key[:60]}' holds {number_text(numel)} elements, more bytes than "
                    "int64 holds")
            root = self.storages[key] = StorageRef(key, stype, location, numel)
        # like torch, the first reference to a key decides; later ones reuse it
        return root if not self.legacy or pid[5] is None else self._view(root, pid[5], stype)

    def _view(self, root: StorageRef, view: object, stype: object) -> StorageRef:
        if type(stype) is not StorageType or type(view) is not tuple or len(view) != 3:
            raise pickle.UnpicklingError("a storage view is malformed")
        key, offset, size = _text(view[0]), view[1], view[2]
        if key is None or type(offset) is not int or type(size) is not int or min(offset, size) < 0:
            raise pickle.UnpicklingError("a storage view is malformed")
        if max(offset, size) > INT64_MAX:
            raise pickle.UnpicklingError("a storage view's offset or size is past int64")
        isz = stype.dtype.itemsize
        if (offset + size) * isz > root.nbytes:
            raise pickle.UnpicklingError(
                f"storage view '{key}' runs past the end of storage '{root.key}'")
        ref = self.storages.get(key)
        if ref is None:
            ref = self.storages[key] = StorageRef(key, stype, root.location, size, root.root,
                                                  root.root_offset + offset * isz)
        return ref


def _text(value: object) -> str | None:
    """A key or tag as text: py2-era pickles store them as bytes, torch writes str."""
    if type(value) is str:
        return value
    if type(value) is bytes:
        return value.decode("ascii", "replace")
    if type(value) is int:
        return str(value)
    return None


@dataclass
class Unpickled:
    """What a restricted unpickle gives: the object, the globals named and the storages."""

    obj: Any
    globals: list[str] = field(default_factory=list)  # in order of first appearance
    unsafe_globals: list[str] = field(default_factory=list)
    storages: dict[str, StorageRef] = field(default_factory=dict)  # by key; views have root != key
    end: int = 0  # offset just past this pickle's STOP in the data given


def load_restricted(data: bytes | bytearray | memoryview | BinaryIO, offset: int = 0, *,
                    legacy: bool = False) -> Unpickled:
    """Unpickle the one pickle at `offset` of `data` without importing or running anything.

    `legacy` selects torch's non-zip storage references (with view metadata). A file-like
    `data` is read from its position and left just past the pickle. Raises UnpickleError.
    """
    stream = None
    if not isinstance(data, (bytes, bytearray, memoryview)):
        stream, start = data, data.tell()
        data = data.read(MAX_PICKLE_BYTES + 1)
    data = bytes(data)
    try:
        end = check_stream(data, offset, MAX_PICKLE_BYTES)
    except StreamError as exc:
        if exc.truncated and len(data) - offset > MAX_PICKLE_BYTES:
            raise UnpickleError(f"the pickle runs past the {MAX_PICKLE_BYTES // 2**20} MiB "
                                "cachedoctor unpickles") from None
        raise UnpickleError(str(exc), truncated=exc.truncated, scan=(data, offset)) from None
    unpickler = _RestrictedUnpickler(data[offset:end] if offset or end < len(data) else data,
                                     legacy)
    budget = _copied.set(_Copied())
    try:
        obj = unpickler.load()
    except Exception as exc:  # whatever a malformed stream makes the C unpickler or us raise
        # the globals after the point of failure count too: a payload may sit there
        raise UnpickleError(_describe(exc), list(unpickler.names), list(unpickler.unsafe),
                            scan=(data, offset)) from None
    finally:
        _copied.reset(budget)
    if stream is not None:
        stream.seek(start + end)
    return Unpickled(obj, list(unpickler.names), list(unpickler.unsafe), unpickler.storages, end)


_STRING_OPS = frozenset({"STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE",
                         "SHORT_BINUNICODE", "BINUNICODE8"})
_MEMO_OPS = frozenset({"MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"})
_GET_OPS = frozenset({"GET", "BINGET", "LONG_BINGET"})
_GLOBAL_OPS = frozenset({"GLOBAL", "INST", "STACK_GLOBAL"})
# Runs of the opcodes scan_globals only steps over, matched in C: all but the above, STOP and
# those with a decimal or text argument (which pickletools may refuse, ending the scan).
_QUIET = frozenset(code for code, op in OPS.items()
                   if op.name in _STRING_OPS | _MEMO_OPS | _GET_OPS | _GLOBAL_OPS | {"STOP"}
                   or (op.arg is not None and op.arg.n == pickletools.UP_TO_NEWLINE))


_BINGETS = frozenset({ord("h"), ord("j")})  # BINGET, LONG_BINGET


@functools.cache
def _quiet_run(gets: bool = False) -> re.Pattern[bytes]:
    """Compiled on first use: most files never need it. With `gets`, BINGET and LONG_BINGET
    are stepped over too: while the memo holds no string, they push nothing that matters."""
    plain, args = token_patterns(_QUIET - _BINGETS if gets else _QUIET)
    return re.compile(b"(?:" + b"|".join([plain + b"++", *args]) + b")*+", re.DOTALL)


_GLOBAL_BYTES = (b"c", b"i", b"\x93")  # GLOBAL, INST, STACK_GLOBAL
# BINGET, BINPUT, LONG_BINGET, LONG_BINPUT, MEMOIZE -> bytes of their index
_MEMO_WIDTHS = {ord("h"): 1, ord("q"): 1, ord("j"): 4, ord("r"): 4, 0x94: 0}
MAX_SCAN_STEPS = 2_000_000  # opcodes scan_globals reads one by one (about 1 µs each)
MAX_SCAN_MEMO = 1_000_000  # strings it remembers by memo slot


def scan_globals(data: bytes, offset: int = 0) -> tuple[list[str], list[str]]:
    """Every global a (possibly broken) pickle names, read from its opcodes alone.

    Used when the stream cannot be unpickled: a cut-off or damaged pickle must still show the
    payload it carries. Nothing is built or run; STACK_GLOBAL's operands are the last two
    strings pushed (directly or from the memo), which is how picklers write them.

    The opcodes are those pickletools.genops reads, up to STOP or the first it cannot read, but
    only those that push a string, touch the memo or name a global are read one by one: runs
    of the others are stepped over by a regex. A stream with no byte that could name a global
    is not read at all. A hostile stream is read for MAX_SCAN_STEPS such opcodes at most.
    """
    stop = min(len(data), offset + MAX_PICKLE_BYTES)
    if all(data.find(code, offset, stop) < 0 for code in _GLOBAL_BYTES):
        return [], []
    view = data if offset == 0 and stop == len(data) else data[offset:stop]
    names: dict[str, None] = {}
    unsafe: dict[str, None] = {}
    strings: list[str] = []  # the last two strings pushed
    fresh = False  # whether the opcode before this one pushed a string
    memo: dict[int, str] = {}
    memo_next = 0
    stream = io.BytesIO(view)
    quiet, quiet_gets = _quiet_run().match, _quiet_run(gets=True).match
    pos, size = 0, len(view)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # genops warns about bad escapes in STRING opcodes
            for _ in range(MAX_SCAN_STEPS):
                after = (quiet if memo else quiet_gets)(view, pos).end()
                if after != pos:
                    fresh, pos = False, after
                if pos >= size:
                    break
                code = view[pos]
                op = OPS.get(code)
                if op is None:
                    break
                width = _MEMO_WIDTHS.get(code)
                if width is not None:  # the commonest, read here: a memo index, or none
                    if pos + width >= size:
                        break  # genops would find the stream cut off
                    arg = int.from_bytes(view[pos + 1:pos + 1 + width], "little")
                    pos += 1 + width
                elif op.arg is None:
                    arg, pos = None, pos + 1
                else:
                    stream.seek(pos + 1)
                    arg = op.arg.reader(stream)
                    pos = stream.tell()
                kind, pushed = op.name, None
                if kind in _STRING_OPS:
                    pushed = arg if isinstance(arg, str) else str(arg)
                elif kind in _GET_OPS:
                    pushed = memo.get(int(arg))
                elif kind in _MEMO_OPS:
                    index = memo_next if kind == "MEMOIZE" else int(arg)
                    memo_next = max(memo_next, index + 1)
                    if fresh and (len(memo) < MAX_SCAN_MEMO or index in memo):
                        memo[index] = strings[-1]
                    continue  # memoizing leaves the stack as it was
                elif kind in ("GLOBAL", "INST") or (kind == "STACK_GLOBAL" and len(strings) == 2):
                    module, name = str(arg).split(" ", 1) if arg is not None else strings
                    full, allowed = classify_global(module, name)
                    names[full] = None
                    if not allowed:
                        unsafe[full] = None
                elif kind == "STOP":
                    break
                fresh = pushed is not None
                if fresh:
                    strings = [*strings[-1:], pushed]
    except Exception:
        pass  # the stream ends or breaks: keep what was found before that point
    return list(names), list(unsafe)


def classify_global(module: str, name: str) -> tuple[str, bool]:
    """The global's canonical name (py2 names mapped) and whether torch's weights_only allows it."""
    key = (module, name)
    if key in _compat_pickle.NAME_MAPPING:
        module, name = _compat_pickle.NAME_MAPPING[key]
    elif module in _compat_pickle.IMPORT_MAPPING:
        module = _compat_pickle.IMPORT_MAPPING[module]
    full = f"{module}.{name}"
    return full, full in ALLOWED_GLOBALS


def _describe(exc: Exception) -> str:
    if isinstance(exc, MemoryError):
        return "the pickle asks for more memory than there is"
    if isinstance(exc, RecursionError):
        return "the pickle nests objects too deeply to compare"
    text = str(exc) or type(exc).__name__
    if len(text) > 200:
        text = text[:200] + "..."
    if isinstance(exc, pickle.UnpicklingError):
        return text
    return f"the pickle is malformed ({type(exc).__name__}: {text})"


# ---- reading the result -----------------------------------------------------------------------

_SCALARS = frozenset({str, int, float, bool, bytes, type(None), complex, DType, StorageRef})


def walk_tensors(obj: object) -> Iterator[tuple[tuple[str | int, ...], TensorRef]]:
    """Each tensor in `obj` with its path, depth first in container order.

    Iterative and cycle-safe: a container is entered once even if it appears at many places
    or inside itself. Raises UnpickleError past MAX_WALK_DEPTH levels, MAX_WALK_ITEMS items or
    MAX_TENSORS tensors; only a hostile file gets there.
    """
    if type(obj) is TensorRef:  # the commonest file: one bare latent
        yield (), obj
        return
    # A path is a linked list (parent_link, key) until a tensor is found: building tuples
    # for every container entry would cost depth x entries.
    stack: list[tuple[object, object, int]] = [(obj, None, 0)]
    seen: set[int] = set()
    items = tensors = 0
    while stack:
        value, link, depth = stack.pop()
        kind = type(value)
        if kind is TensorRef:
            tensors += 1
            if tensors > MAX_TENSORS:
                raise UnpickleError(f"the file holds more than {MAX_TENSORS:,} tensors")
            yield _path(link), value
            continue
        if kind in _SCALARS or id(value) in seen:
            continue
        children: Iterable[tuple[object, object]]
        if isinstance(value, dict):
            count, children = len(value), value.items()
        elif kind is list or kind is tuple or isinstance(value, (list, tuple, set, frozenset)):
            count, children = len(value), enumerate(value)
        elif isinstance(value, Stub):
            children = list(value.children())
            count = len(children)
        else:
            continue
        seen.add(id(value))
        if depth >= MAX_WALK_DEPTH:
            raise UnpickleError(f"the object nests containers more than {MAX_WALK_DEPTH} deep")
        items += count
        if items > MAX_WALK_ITEMS:
            raise UnpickleError(f"the object holds more than {MAX_WALK_ITEMS:,} items")
        # Only what may hold a tensor goes on the stack, and an object once per container: its
        # first place is walked first, and every later one would be skipped as seen. (A million
        # references to one list would otherwise take a million stack entries.)
        found: list[tuple[object, object]] = []
        taken: set[int] = set()
        for key, child in children:
            if type(child) not in _SCALARS:
                if type(child) is not TensorRef:
                    ident = id(child)
                    if ident in seen or ident in taken:
                        continue
                    taken.add(ident)
                found.append((key, child))
        for key, child in reversed(found):
            stack.append((child, (link, key), depth + 1))


def _path(link: object) -> tuple[str | int, ...]:
    keys = []
    while link is not None:
        link, key = link  # type: ignore[misc]
        keys.append(key if type(key) in (str, int) else _key_text(key))
    return tuple(reversed(keys))


def _key_text(key: object) -> str:
    if isinstance(key, bytes):
        return repr(key[:80])
    if isinstance(key, (float, bool, type(None))):
        return repr(key)
    return f"<{type(key).__name__}>"


def root_kind(obj: object) -> str:
    """The saved object's type as FileMeta.root names it."""
    if type(obj) is TensorRef:
        return "tensor"
    if isinstance(obj, dict):
        return "dict"
    if isinstance(obj, list):
        return "list"
    if isinstance(obj, tuple):
        return "tuple"
    return "other"


__all__ = [
    "ALLOWED_GLOBALS", "DTYPES", "MAX_PICKLE_BYTES", "DType", "StorageRef", "StorageType", "Stub",
    "TensorRef", "UnpickleError", "Unpickled", "load_restricted", "root_kind", "walk_tensors",
]
