"""torch.save's legacy stream (`_use_new_zipfile_serialization=False`), and any other pickle.

A legacy file is five pickles and then raw storages (torch.serialization._legacy_save):
the magic number, the protocol version 1001, a system-info dict, the saved object (whose
persistent ids name storages), the storage keys in sorted order; then for each key an int64
little-endian element count followed by count x itemsize bytes. The storages are stepped over
by arithmetic, reading only the counts, and the last one must end exactly at the end of the
file: torch.load says "unexpected EOF, expected N more bytes" for a cut-off file and never
notices trailing bytes, which we report too.

Any other stream of pickles (a `.pkl`, or a `.pt` written by pickle itself) is read pickle by
pickle for the globals it names; bytes that are no pickle at all are an error.
"""

from __future__ import annotations

from cachedoctor.formats.meta import PICKLE, TORCH_LEGACY, FileMeta
from cachedoctor.formats.source import Source
from cachedoctor.formats.torch_tensors import clip, nonfinite_counts, tensor_metas
from cachedoctor.formats.unpickler import (
    MAX_PICKLE_BYTES,
    StorageRef,
    Unpickled,
    UnpickleError,
    load_restricted,
    root_kind,
)

MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
PROTOCOL_VERSION = 1001
WINDOW = 64 * 1024  # first read; a pickle running past it is read again with a bigger window
MAX_PICKLES = 1000  # in a plain stream; pickle.load itself reads only the first


def read(src: Source, path: str, deep: bool) -> FileMeta:
    """Metadata of the legacy torch file or pickle stream in `src`; never raises for bad input."""
    reader = _Reader(src, path, deep)
    try:
        return reader.read()
    except OSError:
        raise  # the dispatcher reports I/O failures as such
    except Exception as exc:  # malformed input that slipped past a check: still no traceback
        reader.errors.append(f"cannot read the pickle stream ({type(exc).__name__}: {exc})")
        return reader.meta(reader.format)


class _Reader:
    def __init__(self, src: Source, path: str, deep: bool) -> None:
        self.src, self.path, self.deep = src, path, deep
        self.format = PICKLE
        self.buffer = src.pread(0, min(src.size, WINDOW))
        self.globals: dict[str, None] = {}  # ordered sets, over every pickle of the stream
        self.unsafe: dict[str, None] = {}
        self.errors: list[str] = []
        self.notes: list[str] = []

    def read(self) -> FileMeta:
        first = self.load(0, "the stream")
        if first is None:
            return self.meta(PICKLE)
        if type(first.obj) is int and first.obj == MAGIC_NUMBER:
            self.format = TORCH_LEGACY
            return self._read_legacy(first.end)
        return self._read_stream(first)

    def load(self, pos: int, what: str, legacy: bool = False) -> Unpickled | None:
        """The pickle at `pos`, its globals recorded; None (and an error) if it is broken."""
        while True:
            try:
                found = load_restricted(self.buffer, pos, legacy=legacy)
                break
            except UnpickleError as exc:
                limit = min(self.src.size, pos + MAX_PICKLE_BYTES)
                if exc.truncated and len(self.buffer) < limit:
                    self.buffer = self.src.pread(0, min(limit, 4 * len(self.buffer)))
                    continue
                self._record(exc.globals, exc.unsafe_globals)
                if exc.truncated and limit < self.src.size:
                    message = (f"runs past the {MAX_PICKLE_BYTES // 2**20} MiB cachedoctor "
                               "unpickles: not checked")
                else:
                    message = f"is damaged: {exc}"
                self.errors.append(f"{what} at offset {pos:,} {message}" if pos else
                                   f"{what} {message}")
                return None
        self._record(found.globals, found.unsafe_globals)
        return found

    def _record(self, names: list[str], unsafe: list[str]) -> None:
        self.globals.update(dict.fromkeys(names))
        self.unsafe.update(dict.fromkeys(unsafe))

    def _read_stream(self, first: Unpickled) -> FileMeta:
        pos, count = first.end, 1
        while pos < self.src.size:
            if count >= MAX_PICKLES:
                self.errors.append(f"the stream holds more than {MAX_PICKLES:,} pickles: the "
                                   f"rest from offset {pos:,} was not checked")
                break
            found = self.load(pos, f"pickle {count + 1}")
            if found is None:
                break
            pos, count = found.end, count + 1
        return self.meta(PICKLE, root=root_kind(first.obj))

    def _read_legacy(self, pos: int) -> FileMeta:
        version = self.load(pos, "the protocol-version pickle")
        if version is None:
            return self.meta(TORCH_LEGACY)
        if version.obj != PROTOCOL_VERSION:
            self.errors.append(f"the protocol version is {_short(version.obj)}, not "
                               f"{PROTOCOL_VERSION} (torch.load: Invalid protocol version)")
            return self.meta(TORCH_LEGACY)
        info = self.load(version.end, "the system-info pickle")
        if info is None:
            return self.meta(TORCH_LEGACY)
        saved = self.load(info.end, "the pickle of the saved object", legacy=True)
        if saved is None:
            return self.meta(TORCH_LEGACY)
        keys = self.load(saved.end, "the storage-key pickle")
        if keys is None:
            return self.meta(TORCH_LEGACY)
        if type(keys.obj) is not list or any(type(k) is not str for k in keys.obj):
            self.errors.append("the storage-key pickle holds no list of keys")
            return self.meta(TORCH_LEGACY, root=root_kind(saved.obj))
        storages = saved.storages
        for ref in storages.values():
            if ref.untyped:
                self.errors.append(
                    f"storage '{clip(ref.key)}' is an UntypedStorage, which torch.load cannot read "
                    "from a legacy file (AttributeError: type object "
                    "'torch.storage.UntypedStorage' has no attribute 'dtype')")
                break
        missing = [k for k, ref in storages.items() if ref.root == k and k not in keys.obj]
        if missing:
            self.errors.append(f"the saved object uses storage '{clip(missing[0])}', which the "
                               "storage-key list omits: the file holds no bytes for it")
        found = self._step_storages(keys.obj, keys.end, storages)
        data_at = {key: at for key, (at, _) in found.items()}
        stored = {key: nbytes for key, (_, nbytes) in found.items()}
        tensors, tensor_errors = tensor_metas(saved.obj, stored)
        self.errors.extend(tensor_errors)
        nonfinite: tuple = ()
        if self.deep:
            self.notes.append("the legacy format records no checksums: bytes cannot be verified")

            def locate(key: str) -> tuple[Source, int] | None:
                ref = storages.get(key)
                if ref is None or ref.root not in data_at:
                    return None
                return self.src, data_at[ref.root] + ref.root_offset

            nonfinite = nonfinite_counts(tensors, locate)
        return self.meta(TORCH_LEGACY, root=root_kind(saved.obj), tensors=tuple(tensors),
                         nonfinite=nonfinite)

    def _step_storages(self, keys: list[str], pos: int, storages: dict[str, StorageRef]
                       ) -> dict[str, tuple[int, int]]:
        """(offset, bytes) of each storage's data, reading only the counts; the last storage
        must end the file."""
        size, found = self.src.size, {}
        for key in keys:
            ref, name = storages.get(key), clip(key)
            if ref is None or ref.root != key:
                self.errors.append(
                    f"the storage-key list names '{name}', which the saved object never uses "
                    f"(torch.load: storage key '{name}' not found in deserialized_objects)")
                return found
            head = self.src.pread(pos, 8)
            if len(head) < 8:
                self.errors.append(
                    f"the file ends at {size:,} bytes, inside the element count of storage "
                    f"'{name}' (torch.load: unexpected EOF, expected {8 - len(head)} more bytes. "
                    "The file might be corrupted.)")
                return found
            count = int.from_bytes(head, "little", signed=True)
            if count < 0:
                self.errors.append(f"storage '{name}' has a negative element count ({count:,})")
                return found
            nbytes = count * ref.itemsize
            if nbytes != ref.nbytes:
                self.errors.append(
                    f"storage '{name}' holds {count:,} elements where the saved object expects "
                    f"{ref.numel:,} (torch.load: storage has wrong byte size: expected "
                    f"{ref.nbytes} got {nbytes})")
            found[key] = (pos + 8, nbytes)
            pos += 8 + nbytes
            if pos > size:
                self.errors.append(
                    f"the file ends at {size:,} bytes, {pos - size:,} bytes short of the end of "
                    f"storage '{name}' (torch.load: unexpected EOF, expected {pos - size} more "
                    "bytes. The file might be corrupted.)")
                del found[key]
                return found
        if pos < size:
            self.errors.append(f"{size - pos:,} bytes follow the last storage, which ends at "
                               f"{pos:,}: trailing data (an appended save, or a damaged file)")
        return found

    def meta(self, fmt: str, **fields) -> FileMeta:
        return FileMeta(self.path, self.src.size, fmt, globals=tuple(self.globals),
                        unsafe_globals=tuple(self.unsafe), errors=tuple(self.errors),
                        notes=tuple(self.notes), deep=self.deep, **fields)


def _short(value: object) -> str:
    text = repr(value) if isinstance(value, (int, str, bytes, float, type(None))) else (
        f"a {type(value).__name__}")
    return text[:60]
