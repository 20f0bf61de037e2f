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
from cachedoctor.formats.zipdir import ZipDirectory, ZipEntry, ZipError, read_entry


class _Member:
    """What one member contributes to the file's FileMeta."""

    __slots__ = ("crc_error", "errors", "globals", "nonfinite", "notes", "tensor")

    def __init__(self) -> None:
        self.tensor: TensorMeta | None = None
        self.errors: list[str] = []
        self.notes: list[str] = []
        self.globals: tuple[str, ...] = ()
        self.crc_error: str | None = None
        self.nonfinite = 0


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
        errors += member.errors
        notes += member.notes
        globals_.update(dict.fromkeys(member.globals))
        if member.tensor is not None:
            tensors.append(member.tensor)
        if member.crc_error:
            crc_errors.append(member.crc_error)
        if member.nonfinite:
            nonfinite.append(((entry.name.removesuffix(".npy"),), member.nonfinite))
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
        member.errors.append(f"member '{name}' is not an .npy array (np.savez writes only those)")
        return member
    key = name[:-4]
    whole = _read_whole(src, entry, member) if deep else None
    try:
        data = whole if whole is not None else _read_head(src, entry)
        header = npy.parse_header(data)
        size = entry.size - header.data_offset
        if header.dtype.has_object and whole is None and size <= npy.MAX_PICKLE_BYTES:
            whole = read_entry(src, entry)
    except npy.NpyError as exc:
        member.errors.append(f"member '{name}': {exc}")
        return member
    except ZipError as exc:
        member.errors.append(f"member '{name}': {exc}")
        return member
    except zlib.error as exc:
        member.errors.append(f"member '{name}': deflate stream is damaged ({exc})")
        return member
    if header.dtype.has_object:
        _scan_object_array(entry, header, whole, member)
    else:
        error = npy.size_error(header, size)
        if error:
            member.errors.append(f"member '{name}': {error}")
        elif whole is not None and header.dtype.name in FLOAT_DTYPES:
            values = memoryview(whole)[header.data_offset : header.data_offset + header.nbytes]
            member.nonfinite = count_nonfinite(values, header.dtype.name, header.dtype.big_endian)
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
    except zlib.error as exc:
        member.crc_error = f"member '{entry.name}': deflate stream is damaged ({exc})"
        return None
    except ZipError:
        return None  # an unsupported method: the header read reports it
    if len(data) != entry.size:
        member.crc_error = (
            f"member '{entry.name}' inflates to {len(data):,} bytes, "
            f"the directory says {entry.size:,}"
        )
    elif (actual := zlib.crc32(data)) != entry.crc:
        member.crc_error = (
            f"CRC32 mismatch in '{entry.name}' (recorded 0x{entry.crc:08x}, actual 0x{actual:08x})"
        )
    return data


def _scan_object_array(
    entry: ZipEntry, header: npy.NpyHeader, data: bytes | None, member: _Member
) -> None:
    if data is None:
        size = entry.size - header.data_offset
        member.errors.append(
            f"member '{entry.name}': object array pickle of {size:,} bytes is too large to scan"
        )
        return
    member.globals, error = npy.pickle_globals(data, header.data_offset)
    if error:
        member.errors.append(f"member '{entry.name}': {error}")
