"""numpy `.npz` (kohya's latent and text-encoder caches): a zip of `<key>.npy` members.

np.savez stores members, np.savez_compressed deflates them; either way only each member's
header bytes are read (and inflated) by default, and the member's size from the central
directory must equal header + numel × itemsize. With `deep`, each member is read whole: its
CRC32 is compared with the directory (np.load would fail with "Bad CRC-32") and its floats
are counted for NaN/Inf.
"""

from __future__ import annotations

import zlib

from cachedoctor.formats import numpy_npy as npy
from cachedoctor.formats.meta import NPZ, FileMeta, TensorMeta
from cachedoctor.formats.nonfinite import FLOAT_DTYPES, count_nonfinite
from cachedoctor.formats.source import Source
from cachedoctor.formats.zipdir import DamagedEntry, ZipDirectory, ZipEntry, ZipError, crc_mismatch, read_entry


class _Member:
    """What one member contributes to the file's FileMeta."""

    __slots__ = ("crc_error", "error", "globals", "nonfinite", "notes", "tensor")

    def __init__(self) -> None:
        self.tensor: TensorMeta | None = None
        self.error: str | None = None
        self.notes: list[str] = []
        self.globals: tuple[str, ...] = ()
        self.crc_error: str | None = None
        self.nonfinite = 0  # NaN/Inf among the tensor's values (--deep)


def read(src: Source, path: str, deep: bool, directory: ZipDirectory) -> FileMeta:
    """Every `<key>.npy` member of the archive whose central directory is `directory`."""
    tensors, errors, notes, crc_errors, nonfinite = [], [], [], [], []
    globals_: dict[str, None] = {}
    seen: set[str] = set()
    for entry in directory.entries:
        if entry.name in seen:
            notes.append(f"member '{entry.name}' appears twice: numpy reads the last one")
        seen.add(entry.name)
        member = _read_member(src, entry, deep)
        notes += member.notes
        globals_.update(dict.fromkeys(member.globals))
        if member.error:
            errors.append(member.error)
        if member.crc_error:
            crc_errors.append(member.crc_error)
        if member.tensor is not None:
            tensors.append(member.tensor)
            if member.nonfinite:
                nonfinite.append((member.tensor.path, member.nonfinite))
    if directory.trailing_bytes:
        notes.append(f"{directory.trailing_bytes:,} bytes after the zip end record")
    found = tuple(globals_)
    return FileMeta(
        path,
        src.size,
        NPZ,
        root="dict",
        tensors=tuple(tensors),
        globals=found,
        unsafe_globals=found,
        errors=tuple(errors),
        crc_errors=tuple(crc_errors),
        nonfinite=tuple(nonfinite),
        notes=tuple(notes),
        deep=deep,
    )


def _read_member(src: Source, entry: ZipEntry, deep: bool) -> _Member:
    member = _Member()
    name = entry.name
    if not name.endswith(".npy"):
        member.error = f"member '{name}' is not an .npy array (np.savez writes only those)"
        return member
    key = name[:-4]
    whole = _read_whole(src, entry, member) if deep else None
    try:
        data = whole if whole is not None else _read_head(src, entry)
        header = npy.parse_header(data)
        if header.dtype.has_object and whole is None:
            data = read_entry(src, entry, header.data_offset + npy.PICKLE_READ)
    except (npy.NpyError, ZipError) as exc:  # DamagedEntry included
        member.error = f"member '{name}': {exc}"
        return member
    size = entry.size - header.data_offset
    if header.dtype.has_object:
        member.globals, error = npy.pickle_globals(data, header.data_offset)
    else:
        error = npy.size_error(header, size)
        if not error and whole is not None and header.dtype.name in FLOAT_DTYPES:
            values = memoryview(whole)[header.data_offset : header.data_offset + header.nbytes]
            member.nonfinite = count_nonfinite(values, header.dtype.name, header.dtype.big_endian)
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


def _read_whole(src: Source, entry: ZipEntry, member: _Member) -> bytes | None:
    """--deep: the member's bytes, with a CRC or inflate failure recorded as a crc_error."""
    try:
        data = read_entry(src, entry)
    except DamagedEntry as exc:
        member.crc_error = f"member '{entry.name}': {exc}"
        return None
    except ZipError:
        return None  # an unsupported method or a huge entry: the header read reports it
    if len(data) != entry.size:
        member.crc_error = (
            f"member '{entry.name}' inflates to {len(data):,} bytes, "
            f"the directory says {entry.size:,}"
        )
    elif (actual := zlib.crc32(data)) != entry.crc:
        member.crc_error = crc_mismatch(entry.name, entry.crc, actual)
    return data
