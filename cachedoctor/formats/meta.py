"""What a reader learns about one file: metadata, never tensor values (unless --deep asks).

Readers fill these and decide nothing: severity and wording of findings belong to checks/.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from math import prod
from operator import attrgetter
from types import MappingProxyType

# Formats a reader can report. `compression` says what wraps them (only "gzip" today).
TORCH_ZIP = "torch-zip"
TORCH_LEGACY = "torch-legacy"
PICKLE = "pickle"  # a pickle stream that is no torch file
SAFETENSORS = "safetensors"
NPZ = "npz"
NPY = "npy"
EMPTY = "empty"
ZEROED = "zeroed"  # same size as a file, but every byte is zero: a write that never reached disk
ZIP = "zip"  # a zip archive of neither torch nor numpy
IMAGE = "image"
TEXT = "text"
JSON = "json"
UNKNOWN = "unknown"
# Finder's `._<name>` beside a file copied to exFAT or an SMB share: its resource fork. Every
# loader fails on its first byte (no zip, no pickle opcode, a safetensors length past the file).
APPLEDOUBLE = "appledouble"
ARROW = "arrow"  # an Arrow IPC stream or file (🤗 datasets caches): a table, no tensors
PARQUET = "parquet"  # a Parquet file (diffusers' flux_lora_quantization embeddings): a table

TENSOR_FORMATS = frozenset({TORCH_ZIP, TORCH_LEGACY, SAFETENSORS, NPZ, NPY})
PICKLE_FORMATS = frozenset({TORCH_ZIP, TORCH_LEGACY, PICKLE})


INT64_MAX = 2**63 - 1  # what torch's and numpy's sizes, strides and offsets hold at most


def number_text(n: int) -> str:
    """`n` with thousands separators, or "a 400-digit number" when it is too long to print:
    a hostile header's numbers must not make a message of thousands of characters (and Python
    refuses to print an int of more than 4,300 digits)."""
    if -(10**24) < n < 10**24:
        return f"{n:,}"
    digits = int(abs(n).bit_length() * 0.30102999566398120) + 1  # log10(2): exact or one over
    if abs(n) < 10 ** (digits - 1):
        digits -= 1
    return f"a {digits:,}-digit {'negative ' if n < 0 else ''}number"


def contiguous_stride(shape: tuple[int, ...], column_major: bool = False) -> tuple[int, ...]:
    """Strides (in elements) of a dense tensor, as torch and numpy lay it out (0-size dims
    count as 1); column-major for numpy's fortran_order."""
    stride = [0] * len(shape)
    step = 1
    for i in range(len(shape)) if column_major else range(len(shape) - 1, -1, -1):
        stride[i] = step
        step *= max(shape[i], 1)
    return tuple(stride)


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """One tensor as stored: enough to tell its size, its storage and where it will load."""

    path: tuple[str | int, ...]  # where it sits in the saved object: (), ("latent",), (1, 0)
    dtype: str  # torch's name without "torch.": float16, bfloat16, float8_e4m3fn, bool
    shape: tuple[int, ...]
    stride: tuple[int, ...]  # in elements
    storage_offset: int  # in elements
    storage_key: str  # zip "data/<key>" key, safetensors tensor name, npz member name
    storage_bytes: int | None  # bytes stored for the storage this tensor views; None if unknown
    itemsize: int  # bytes per element (1 for packed sub-byte dtypes)
    location: str = "cpu"  # "cpu", "cuda:3", "mps", "meta"
    requires_grad: bool = False

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def extent(self) -> tuple[int, int]:
        """Byte range [begin, end) of the storage this tensor can reach (exact when contiguous)."""
        begin = self.storage_offset * self.itemsize
        if self.numel == 0:
            return begin, begin
        last = self.storage_offset + sum((n - 1) * s for n, s in zip(self.shape, self.stride, strict=True))
        return begin, (last + 1) * self.itemsize

    @property
    def display_path(self) -> str:
        return "".join(f"[{p!r}]" for p in self.path) or "<root>"


@dataclass(slots=True)
class FileMeta:
    """Everything the readers know about one file. Readers build it; nothing changes it after
    read_path has stamped the file's mtime (kept mutable for that one cheap assignment)."""

    path: str
    size: int
    format: str
    compression: str | None = None  # "gzip" when the bytes are gzip around `format`
    root: str | None = None  # type of the saved object: tensor, dict, list, tuple, other
    tensors: tuple[TensorMeta, ...] = ()
    globals: tuple[str, ...] = ()  # every GLOBAL a pickle names, in order of first appearance
    unsafe_globals: tuple[str, ...] = ()  # the ones torch.load(weights_only=True) would refuse
    errors: tuple[str, ...] = ()  # why the file cannot load as its format; first is the headline
    crc_errors: tuple[str, ...] = ()  # --deep: entries whose bytes do not match their CRC32
    nonfinite: tuple[tuple[tuple[str | int, ...], int], ...] = ()  # --deep: (tensor path, count)
    # --deep, safetensors: (tensor path, exact zeros, elements) of float tensors holding zeros
    zeros: tuple[tuple[tuple[str | int, ...], int, int], ...] = ()
    notes: tuple[str, ...] = ()  # facts that are no problem ("CRC32 not recorded")
    metadata: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    deep: bool = False  # whether CRC and values were read
    mtime: float = 0.0  # from the fstat of the open file (read_path sets it)
    # (size, mtime_ns, inode, device, ctime_ns) from that same fstat, taken before any byte was
    # read: what the incremental index keys this verdict on (no second stat per file)
    stat: tuple[int, int, int, int, int] | None = field(default=None, compare=False, repr=False)
    # an earlier file whose facts these are, but for path and mtime (zip_templates): whoever
    # judges files may reuse what it found for that one
    same_as: FileMeta | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.metadata, MappingProxyType):
            self.metadata = MappingProxyType(dict(self.metadata))

    def __reduce__(self):
        # MappingProxyType does not pickle; metas cross process boundaries.
        values = [getattr(self, f) for f in self.__dataclass_fields__]
        values[list(self.__dataclass_fields__).index("metadata")] = dict(self.metadata)
        return (FileMeta, tuple(values))

    def renamed(self, path: str) -> FileMeta:
        """The same facts for a file at `path` whose bytes say the same (zip_templates); its
        mtime is the caller's to stamp."""
        return FileMeta(path, *_FACTS(self), mtime=0.0, same_as=self.same_as or self)

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def is_tensor_file(self) -> bool:
        return self.format in TENSOR_FORMATS

    def storages(self) -> Iterator[tuple[str, int | None, tuple[TensorMeta, ...]]]:
        """Each distinct storage with its stored bytes and the tensors that view it."""
        groups: dict[str, list[TensorMeta]] = {}
        for t in self.tensors:
            groups.setdefault(t.storage_key, []).append(t)
        for key, views in groups.items():
            yield key, views[0].storage_bytes, tuple(views)

    @property
    def locations(self) -> tuple[str, ...]:
        return tuple(sorted({t.location for t in self.tensors}))


# every field but path and the file's own stamps, in order (mtime, stat and same_as are the
# last three): what a renamed twin shares
_FACTS = attrgetter(*[f for f in FileMeta.__dataclass_fields__
                      if f not in ("path", "mtime", "stat", "same_as")])
