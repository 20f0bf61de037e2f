"""What torch's zip and legacy formats share: the tensors of an unpickled object, checked against
the bytes the file stores for their storages, and (--deep) the NaN/Inf among their values."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from cachedoctor.formats.meta import TensorMeta, contiguous_stride
from cachedoctor.formats.nonfinite import FLOAT_DTYPES, count_nonfinite, count_nonfinite_at
from cachedoctor.formats.source import Source
from cachedoctor.formats.unpickler import UnpickleError, walk_tensors

# storage key -> (source, offset) of its bytes, or None when the file holds none
Locate = Callable[[str], "tuple[Source, int] | None"]


def clip(name: str, limit: int = 80) -> str:
    """A name from the file, short enough for a message (a hostile file can make it huge)."""
    return name if len(name) <= limit else f"{name[:limit]}... ({len(name):,} characters)"


def tensor_metas(obj: object, stored: Mapping[str, int]) -> tuple[list[TensorMeta], list[str]]:
    """A TensorMeta per tensor in `obj`, and an error per tensor that reaches past the bytes
    stored for its storage (`stored`: bytes the file holds by storage key; a key it lacks has
    been reported missing, and its tensors get storage_bytes None)."""
    tensors: list[TensorMeta] = []
    errors: list[str] = []
    try:
        for path, ref in walk_tensors(obj):
            storage = ref.storage
            key, nbytes = "", None
            if storage is not None:
                key = storage.key
                if storage.root == key:
                    nbytes = stored.get(key)
                elif storage.root in stored:  # a legacy view: its slice of the stored bytes
                    nbytes = storage.nbytes
            huge = _beyond_int64(ref.shape, ref.stride, ref.storage_offset)
            if huge is not None:
                errors.append(f"tensor {clip(_display(path))} has {huge}, beyond the 64-bit "
                              "integers torch keeps sizes in (torch.load: Overflow when "
                              "unpacking long)")
                continue
            meta = TensorMeta(path, ref.dtype, ref.shape, ref.stride, ref.storage_offset, key,
                              nbytes, ref.itemsize, ref.location, ref.requires_grad)
            tensors.append(meta)
            if nbytes is not None and _reach(meta) > nbytes:
                errors.append(_past_end_message(meta))
    except UnpickleError as exc:
        errors.append(str(exc))
    return tensors, errors


INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def number(value: int) -> str:
    """An integer from the file as a message shows it: a pickle can hold a 10**400."""
    text = f"{value:,}"
    return text if len(text) <= 32 else f"a {len(str(abs(value)))}-digit number"


def _beyond_int64(shape: tuple[int, ...], stride: tuple[int, ...], offset: int) -> str | None:
    """What of a tensor's sizes does not fit torch's int64 (None when all do)."""
    for what, values in (("size", shape), ("stride", stride), ("storage offset", (offset,))):
        for v in values:
            if not INT64_MIN <= v <= INT64_MAX:
                return f"{what} {number(v)}"
    numel = 1
    for n in shape:
        numel *= n
        if numel > INT64_MAX:  # (each size fits, their product does not)
            return f"sizes {clip(str(list(shape)))} multiplying to more than 2**63 elements"
    return None


def _display(path: tuple[str | int, ...]) -> str:
    return "".join(f"[{p!r}]" for p in path) or "<root>"


def _reach(meta: TensorMeta) -> int:
    """Bytes of storage the tensor needs; 0 for no elements (torch's set_ accepts any offset)."""
    last = meta.storage_offset
    for n, s in zip(meta.shape, meta.stride, strict=True):
        if n == 0:
            return 0
        last += (n - 1) * s
    return (last + 1) * meta.itemsize


def _past_end_message(meta: TensorMeta) -> str:
    return (
        f"tensor {clip(meta.display_path)} runs past the end of its storage "
        f"'{clip(meta.storage_key)}': it "
        f"needs {_reach(meta):,} bytes, the file stores {meta.storage_bytes:,} (torch.load: "
        f"sizes {list(meta.shape)}, strides {list(meta.stride)}, storage offset "
        f"{meta.storage_offset} and itemsize {meta.itemsize} ... are out of bounds for storage "
        f"of size {meta.storage_bytes})"
    )


def nonfinite_counts(tensors: list[TensorMeta], locate: Locate, big_endian: bool = False
                     ) -> tuple[tuple[tuple[str | int, ...], int], ...]:
    """--deep: (path, count) for each float tensor with NaN or Inf among the elements it reaches.

    A dense tensor is counted straight from the file in chunks; a strided view is gathered
    with numpy first. Tensors that reach past their storage were reported and are skipped.
    """
    found = []
    for meta in tensors:
        if meta.dtype not in FLOAT_DTYPES or meta.numel == 0 or meta.storage_bytes is None:
            continue
        where = locate(meta.storage_key)
        if where is None or _reach(meta) > meta.storage_bytes:
            continue
        src, offset = where
        begin, end = meta.extent()
        if is_dense(meta):
            count = count_nonfinite_at(src, offset + begin, end - begin, meta.dtype, big_endian)
        else:
            count = _count_strided(src.pread(offset + begin, end - begin), meta, big_endian)
        if count:
            found.append((meta.path, count))
    return tuple(found)


def is_dense(meta: TensorMeta) -> bool:
    """Whether the tensor's elements are exactly the bytes of its extent, in storage order."""
    dims = [(n, s) for n, s in zip(meta.shape, meta.stride, strict=True) if n != 1]
    expected = contiguous_stride(tuple(n for n, _ in dims))
    return all(s == e for (_, s), e in zip(dims, expected, strict=True))


def _count_strided(data: bytes, meta: TensorMeta, big_endian: bool) -> int:
    import numpy as np
    from numpy.lib.stride_tricks import as_strided

    isz = meta.itemsize
    base = np.frombuffer(data, np.uint8)
    # each element as a row of its bytes; the gathered copy is the tensor in row-major order
    view = as_strided(base, (*meta.shape, isz), (*(s * isz for s in meta.stride), 1),
                      writeable=False)
    return count_nonfinite(np.ascontiguousarray(view).tobytes(), meta.dtype, big_endian)
