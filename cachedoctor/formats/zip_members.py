"""Pickles hidden in zip members: every member that is or claims to be a pickle, whatever its
name, is read by the restricted unpickler. So is the pickle of a member holding an object
array: np.load reads any member that starts with the npy magic as an array, whatever its name,
and unpickles an object array's data with allow_pickle=True.

torch.load reads only `<prefix>/data.pkl`, but other tools open other members (a peer scanner
such as picklescan flags them, and an archive of `model/config.pkl` exists to be unpickled by
someone). A member counts as a pickle when its bytes start with a pickle protocol marker (2 to
5), or its name ends like a pickle file (`.pkl`, `.pickle`, `.joblib`, `.dat`, `.data`): a
protocol 0/1 pickle has no marker (its first byte must still be an opcode). The member's flags
(an "encrypted" bit included) are not trusted: its bytes are judged as stored.

Bounded work per archive: at most MAX_PICKLE_MEMBERS members unpickled, each at most the
unpickler's MAX_PICKLE_BYTES, and MAX_PICKLE_TOTAL bytes in all; beyond that the archive is an
error (not checked), never a silent pass.
"""

from __future__ import annotations

import pickletools
from collections.abc import Iterable
from dataclasses import dataclass, field

from cachedoctor.formats import numpy_npy as npy
from cachedoctor.formats.meta import ZIP, FileMeta
from cachedoctor.formats.source import Source
from cachedoctor.formats.torch_tensors import clip
from cachedoctor.formats.unpickler import MAX_PICKLE_BYTES, UnpickleError, load_restricted
from cachedoctor.formats.zipdir import ZipDirectory, ZipEntry, ZipError, read_entry

PICKLE_SUFFIXES = (".pkl", ".pickle", ".joblib", ".dat", ".data")
MAX_PICKLE_MEMBERS = 1_000
MAX_PICKLE_TOTAL = 256 * 1024 * 1024


def ascii_fold(name: str) -> str:
    """A member name as miniz (torch's zip reader) compares it: A-Z folded, nothing else."""
    return name.lower() if name.isascii() else name.translate(_FOLD)  # (lower(): fast path)


_FOLD = {c: c + 32 for c in range(ord("A"), ord("Z") + 1)}


# bytes a protocol 0/1 pickle can start with (an opcode those protocols have)
_OLD_OPCODES = frozenset(ord(op.code) for op in pickletools.opcodes if op.proto <= 1)


def looks_like_pickle(head: bytes, name: str) -> bool:
    """Whether a member's first bytes say pickle, or its name does and its first byte could
    start one (so a large data file named `.dat` is not read whole for nothing)."""
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return True
    return (bool(name) and head[:1] != b"" and head[0] in _OLD_OPCODES
            and ascii_fold(name).endswith(PICKLE_SUFFIXES))


@dataclass
class PickleScan:
    """The globals the pickle members name, and what could not be checked."""

    globals: dict[str, None] = field(default_factory=dict)
    unsafe: dict[str, None] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    members: int = 0  # pickle members unpickled
    read: int = 0  # their bytes

    def add(self, names: Iterable[str], unsafe: Iterable[str]) -> None:
        self.globals.update(dict.fromkeys(names))
        self.unsafe.update(dict.fromkeys(unsafe))


def scan_members(src: Source, entries: Iterable[ZipEntry], found: PickleScan) -> None:
    """Unpickle (restricted) every member of `entries` that looks like a pickle into `found`."""
    for entry in entries:
        name = clip(entry.name)
        try:
            head = read_entry(src, entry, len(npy.MAGIC))
        except ZipError:
            continue  # no readable bytes: no pickle a loader could run
        if head == npy.MAGIC:
            if not _scan_array(src, entry, found):
                return  # (over budget: said once)
            continue
        marked = looks_like_pickle(head, "")
        if not marked and not looks_like_pickle(head, entry.name):
            continue
        if found.members >= MAX_PICKLE_MEMBERS or found.read + entry.size > MAX_PICKLE_TOTAL:
            found.errors.append(
                f"more than {MAX_PICKLE_MEMBERS:,} pickle members or "
                f"{MAX_PICKLE_TOTAL // 2**20} MiB of them: '{name}' and the rest not checked")
            return
        if entry.size > MAX_PICKLE_BYTES:
            if marked:
                found.errors.append(
                    f"member '{name}' is a pickle of {entry.size:,} bytes, more than the "
                    f"{MAX_PICKLE_BYTES // 2**20} MiB cachedoctor unpickles: not checked")
            continue
        found.members += 1
        found.read += entry.size
        try:
            data = read_entry(src, entry)
        except ZipError as exc:
            if marked:
                found.errors.append(f"pickle member '{name}' cannot be read: {exc}")
            continue
        try:
            unpickled = load_restricted(data)
        except UnpickleError as exc:
            found.add(exc.globals, exc.unsafe_globals)
            if marked or exc.globals:
                found.errors.append(f"pickle member '{name}' is damaged: {exc}")
            continue
        found.add(unpickled.globals, unpickled.unsafe_globals)


def _scan_array(src: Source, entry: ZipEntry, found: PickleScan) -> bool:
    """The globals of the pickle an npy member holds, when it is an object array; False when
    the budget of pickles is spent (the rest of the archive is not checked)."""
    name = clip(entry.name)
    try:
        data = read_entry(src, entry, npy.HEAD_READ)
        end = npy.header_size(data)
        header = npy.parse_header(data if end <= len(data) else read_entry(src, entry, end))
        if not header.dtype.has_object:
            return True
        want = min(entry.size, header.data_offset + npy.PICKLE_READ)
        if found.members >= MAX_PICKLE_MEMBERS or found.read + want > MAX_PICKLE_TOTAL:
            found.errors.append(
                f"more than {MAX_PICKLE_MEMBERS:,} pickle members or "
                f"{MAX_PICKLE_TOTAL // 2**20} MiB of them: '{name}' and the rest not checked")
            return False
        found.members += 1
        found.read += want
        data = read_entry(src, entry, want)
    except (npy.NpyError, ZipError) as exc:  # np.load may still read what this cannot
        found.errors.append(f"member '{name}' starts like an npy array but cannot be checked: "
                            f"{exc}")
        return True
    names, unsafe, error = npy.pickle_globals(data, header.data_offset)
    found.add(names, unsafe)
    if error:
        found.errors.append(f"member '{name}': {error}")
    return True


def read(src: Source, path: str, deep: bool, directory: ZipDirectory) -> FileMeta:
    """A zip of neither torch nor numpy: what its pickle members name."""
    found = PickleScan()
    scan_members(src, directory.entries, found)
    return FileMeta(path, src.size, ZIP, globals=tuple(found.globals),
                    unsafe_globals=tuple(found.unsafe), errors=tuple(found.errors), deep=deep)
