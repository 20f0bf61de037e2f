"""numpy `.npz` (kohya's latent and text-encoder caches): a zip of `<key>.npy` members.

np.savez stores members, np.savez_compressed deflates them; either way only each member's
header bytes are read (and inflated) by default, and the member's size from the central
directory must equal header + numel × itemsize. With `deep`, each member is streamed once,
in chunks of bounded size (never whole in memory): its CRC32 is compared with the directory
(np.load would fail with "Bad CRC-32") and its floats are counted for NaN/Inf in the same
pass. A member that inflates past its recorded size (a zip bomb) is an error, not a hang.
"""

from __future__ import annotations

from cachedoctor.formats import crc as checksum
from cachedoctor.formats import numpy_npy as npy
from cachedoctor.formats.meta import NPZ, FileMeta, TensorMeta
from cachedoctor.formats.nonfinite import FLOAT_DTYPES, Counter
from cachedoctor.formats.source import Source
from cachedoctor.formats.zip_members import MAX_PICKLE_TOTAL, PickleScan, scan_members
from cachedoctor.formats.zipdir import (
    DamagedEntry,
    OversizedEntry,
    ZipDirectory,
    ZipEntry,
    ZipError,
    crc_mismatch,
    entry_chunks,
    read_entry,
)


class _Member:
    """What one member contributes to the file's FileMeta."""

    __slots__ = ("crc_error", "deep_error", "error", "globals", "nonfinite", "notes", "tensor", "unsafe")

    def __init__(self) -> None:
        self.tensor: TensorMeta | None = None
        self.error: str | None = None
        self.notes: list[str] = []
        self.globals: tuple[str, ...] = ()
        self.unsafe: tuple[str, ...] = ()
        self.crc_error: str | None = None
        self.deep_error: str | None = None  # --deep: it inflates past its size, or too far
        self.nonfinite = 0  # NaN/Inf among the tensor's values (--deep)


def read(src: Source, path: str, deep: bool, directory: ZipDirectory) -> FileMeta:
    """Every `<key>.npy` member of the archive whose central directory is `directory`."""
    tensors, errors, notes, crc_errors, nonfinite = [], [], [], [], []
    globals_: dict[str, None] = {}
    unsafe_: dict[str, None] = {}
    seen: set[str] = set()
    # the archive's pickles, object arrays and other members alike: one MAX_PICKLE_TOTAL budget
    found = PickleScan()
    for entry in directory.entries:
        if entry.name in seen:
            notes.append(f"member '{entry.name}' appears twice: numpy reads the last one")
        seen.add(entry.name)
        member = _read_member(src, entry, deep, found)
        notes += member.notes
        globals_.update(dict.fromkeys(member.globals))
        unsafe_.update(dict.fromkeys(member.unsafe))
        if member.error:
            errors.append(member.error)
        if member.deep_error:
            errors.append(member.deep_error)
        if member.crc_error:
            crc_errors.append(member.crc_error)
        if member.tensor is not None:
            tensors.append(member.tensor)
            if member.nonfinite:
                nonfinite.append((member.tensor.path, member.nonfinite))
    if directory.trailing_bytes:
        notes.append(f"{directory.trailing_bytes:,} bytes after the zip end record")
    # np.load hands such members back as bytes, but another tool may unpickle them
    scan_members(src, [e for e in directory.entries if not e.name.endswith(".npy")], found)
    errors += found.errors
    globals_.update(found.unsafe)
    unsafe_.update(found.unsafe)
    return FileMeta(
        path,
        src.size,
        NPZ,
        root="dict",
        tensors=tuple(tensors),
        globals=tuple(globals_),
        unsafe_globals=tuple(unsafe_),
        errors=tuple(errors),
        crc_errors=tuple(crc_errors),
        nonfinite=tuple(nonfinite),
        notes=tuple(notes),
        deep=deep,
    )


def _read_member(src: Source, entry: ZipEntry, deep: bool, found: PickleScan) -> _Member:
    member = _Member()
    name = entry.name
    if not name.endswith(".npy"):
        member.error = f"member '{name}' is not an .npy array (np.savez writes only those)"
        return member
    key = name[:-4]
    try:
        data = _read_head(src, entry)
        header = npy.parse_header(data)
        if header.dtype.has_object:
            # (each deflated member may inflate to PICKLE_READ: the archive's pickles together
            # are bounded as zip_members bounds them)
            want = min(entry.size, header.data_offset + npy.PICKLE_READ)
            if found.read + want > MAX_PICKLE_TOTAL:
                member.error = (f"member '{name}' is an object array past the "
                                f"{MAX_PICKLE_TOTAL // 2**20} MiB of pickles a scan reads in one "
                                "archive: not checked")
                return member
            found.read += want
            data = read_entry(src, entry, want)
    except (npy.NpyError, ZipError) as exc:  # DamagedEntry included
        if deep:
            _check_whole(src, entry, member, None)
        member.error = f"member '{name}': {exc}"
        return member
    size = entry.size - header.data_offset
    if header.dtype.has_object:
        member.globals, member.unsafe, error = npy.pickle_globals(data, header.data_offset)
        error = error or npy.object_array_error(f"'{key}'")
    else:
        error = npy.size_error(header, size)
    if deep:
        values = not error and not header.dtype.has_object and header.dtype.name in FLOAT_DTYPES
        _check_whole(src, entry, member, header if values else None)
    if error:
        member.error = f"member '{name}': {error}"
    member.notes += npy.dtype_notes(header, f"'{key}'")
    storage = None if header.dtype.has_object else size
    member.tensor = npy.tensor_meta(header, (key,), name, storage)
    return member


def _read_head(src: Source, entry: ZipEntry) -> bytes:
    """The member's first bytes, enough to hold its npy header (inflating only those)."""
    data = read_entry(src, entry, npy.HEAD_READ)
    end = npy.header_size(data)
    if end > len(data) and len(data) < entry.size:
        data = read_entry(src, entry, end)
    return data


def _check_whole(src: Source, entry: ZipEntry, member: _Member, header: npy.NpyHeader | None
                 ) -> None:
    """--deep: the member's bytes, streamed once in chunks (never whole in memory): a CRC or
    inflate failure recorded as a crc_error, and the NaN/Inf among the values `header`
    describes (when given) counted into member.nonfinite."""
    crc, done = 0, 0
    counter = begin = end = None
    if header is not None:
        counter = Counter(header.dtype.name, header.dtype.big_endian)
        begin, end = header.data_offset, header.data_offset + header.nbytes
    try:
        for chunk in entry_chunks(src, entry, entry.size):  # as np.load: no byte past it
            crc = checksum.crc32(chunk, crc)
            at, done = done, done + len(chunk)
            if counter is not None and at < end and done > begin:
                counter.feed(memoryview(chunk)[max(begin - at, 0) : end - at])
    except DamagedEntry as exc:
        member.crc_error = f"member '{entry.name}': {exc}"
        return
    except OversizedEntry as exc:  # more than --deep inflates
        member.deep_error = f"member '{entry.name}': {exc}"
        return
    except ZipError:
        return  # an unsupported method: the header read reports it
    if done != entry.size:
        member.crc_error = (
            f"member '{entry.name}' inflates to {done:,} bytes, "
            f"the directory says {entry.size:,}"
        )
    elif crc != entry.crc:
        member.crc_error = crc_mismatch(entry.name, entry.crc, crc)
    if counter is not None:
        member.nonfinite = counter.total
