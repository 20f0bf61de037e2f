"""torch's pre-1.0 tar format, which torch.load still tries first on any file that is no zip.

`torch.serialization._legacy_load` opens a real file with `tarfile` before it reads a legacy
pickle stream. When the first 512 bytes pass as a tar header, the tar reading is the one torch
takes. It extracts three members:

- `storages`: a pickled count, then per storage a pickled (key, location, storage type), an
  int64 element count and the raw bytes, then a pickled list of views;
- `tensors`: a pickled count, then per tensor a pickle and packed sizes;
- `pickle`: the saved object.

Any such pickle runs under `weights_only=False`. So a file whose bytes are both a clean legacy
stream and a tar (a polyglot) must be judged as both.

No torch.save since 0.1.10 writes this format: it is read here to list the globals of every
pickle torch would run, within budgets (MAX_MEMBERS headers, MAX_PICKLES pickles a member,
MAX_MEMBER_BYTES of a member read), never to load tensors.
"""

from __future__ import annotations

from cachedoctor.formats.meta import TORCH_LEGACY, FileMeta, number_text
from cachedoctor.formats.source import Source
from cachedoctor.formats.unpickler import MAX_PICKLE_BYTES, StorageType, UnpickleError, load_restricted

MAX_MEMBERS = 10_000  # tar headers walked looking for the three members
MAX_PICKLES = 1_000  # storages or tensors read in one member
MAX_MEMBER_BYTES = MAX_PICKLE_BYTES  # bytes of one member read into memory
MEMBERS = ("storages", "tensors", "pickle")


def looks_like_tar(head: bytes) -> bool:
    """Whether the first 512 bytes carry a header checksum tarfile accepts (its only test of
    the first header); cheap enough to run on every file before importing tarfile."""
    if len(head) < 512:
        return False
    block = head[:512]
    if not block.strip(b"\0"):
        return False
    field = block[148:156]
    if field[:1] in (b"\x80", b"\xff"):
        return True  # base-256: rare, let tarfile decide
    # read as tarfile's nti reads it: up to a NUL, ASCII, Python's int in base 8, which takes
    # what no tar writes but tarfile accepts (a "0o" prefix, a sign, "_" between digits)
    try:
        stored = int(field.split(b"\0", 1)[0].decode("ascii").strip() or "0", 8)
    except (UnicodeDecodeError, ValueError):
        return False
    unsigned = sum(block[:148]) + 256 + sum(block[156:])  # the field counts as 8 spaces
    signed = sum(b - 256 if b > 127 else b for b in block[:148] + block[156:]) + 256
    return stored in (unsigned, signed)


class _SourceFile:
    """A Source as the read-only file tarfile wants; a read past the member budget (a pax
    header that claims gigabytes) is refused rather than allocated."""

    def __init__(self, src: Source) -> None:
        self.src, self.pos = src, 0

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else (self.pos + offset if whence == 1 else
                                               self.src.size + offset)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        if n < 0:
            n = self.src.size - self.pos
        if n > MAX_MEMBER_BYTES:
            raise ValueError(f"a tar header asks to read {number_text(n)} bytes")
        data = self.src.pread(self.pos, n)
        self.pos += len(data)
        return data


def read(src: Source, path: str) -> FileMeta | None:
    """The tar reading of `src`, or None when tarfile does not open it (torch then reads the
    stream as pickles)."""
    import tarfile  # only for files whose first block passes as a tar header

    try:
        tar = tarfile.open(fileobj=_SourceFile(src), mode="r:")  # noqa: SIM115 -- the file is ours
    except (tarfile.TarError, EOFError, ValueError, OverflowError):
        return None
    reader = _Reader(src, path)
    # tarfile's getmember (torch's extract and extractfile) takes a name's last occurrence:
    # every occurrence is judged, so the whole archive is walked
    found: dict[str, list[tarfile.TarInfo]] = {}
    try:
        for count, member in enumerate(iter(tar.next, None)):
            if count >= MAX_MEMBERS:
                reader.errors.append(f"the tar archive holds more than {MAX_MEMBERS:,} members: "
                                     "the rest were not checked")
                break
            if member.name in MEMBERS:
                found.setdefault(member.name, []).append(member)
    except (tarfile.TarError, EOFError, ValueError, OverflowError) as exc:
        reader.errors.append(f"the tar archive is damaged after {len(found)} members: "
                             f"{str(exc)[:80]}")
    for name in MEMBERS:
        members = found.get(name, [])
        if not members and not reader.errors:
            reader.errors.append(
                f"opens as a tar archive (torch.load tries that before reading a pickle "
                f"stream) but holds no '{name}' member: torch.load fails (KeyError)")
        if len(members) > 1:
            reader.errors.append(f"the tar archive holds '{name}' {len(members)} times: torch.load "
                                 "reads the last one (tarfile.getmember)")
        for member in members:
            if not member.isreg() or member.issparse():
                # (tarfile follows a link to another member, torch's extract a symlink out of
                # the archive; no torch.save wrote one)
                reader.errors.append(f"tar member '{name}' is no plain file (tar type "
                                     f"{member.type!r}): its bytes lie elsewhere, not checked")
                continue
            data = src.pread(member.offset_data, min(member.size, MAX_MEMBER_BYTES))
            getattr(reader, name)(data, member.size)
    return FileMeta(path, src.size, TORCH_LEGACY, globals=tuple(reader.globals),
                    unsafe_globals=tuple(reader.unsafe), errors=tuple(reader.errors),
                    notes=("a tar archive: torch.load reads it with its pre-1.0 tar loader",))


class _Reader:
    def __init__(self, src: Source, path: str) -> None:
        self.src, self.path = src, path
        self.globals: dict[str, None] = {}
        self.unsafe: dict[str, None] = {}
        self.errors: list[str] = []

    def load(self, data: bytes, pos: int, what: str) -> tuple[object, int] | None:
        try:
            found = load_restricted(data, pos)
        except UnpickleError as exc:
            self._record(exc.globals, exc.unsafe_globals)
            self.errors.append(f"tar member {what} at offset {pos:,} is damaged: {exc}")
            return None
        self._record(found.globals, found.unsafe_globals)
        return found.obj, found.end

    def _record(self, names: list[str], unsafe: list[str]) -> None:
        self.globals.update(dict.fromkeys(names))
        self.unsafe.update(dict.fromkeys(unsafe))

    def count(self, data: bytes, what: str) -> tuple[int, int] | None:
        first = self.load(data, 0, what)
        if first is None:
            return None
        n, pos = first
        if type(n) is not int or n < 0:
            self.errors.append(f"tar member {what} starts with no count")
            return None
        if n > MAX_PICKLES:
            self.errors.append(f"tar member {what} counts {number_text(n)} entries: the first "
                               f"{MAX_PICKLES:,} are checked")
        return min(n, MAX_PICKLES), pos

    def storages(self, data: bytes, size: int) -> None:
        counted = self.count(data, "'storages'")
        if counted is None:
            return
        n, pos = counted
        for _ in range(n):
            found = self.load(data, pos, "'storages'")
            if found is None:
                return
            args, pos = found
            stype = args[2] if type(args) is tuple and len(args) == 3 else None
            if type(stype) is not StorageType:
                self.errors.append("tar member 'storages' names no storage type for a storage")
                return
            numel = int.from_bytes(data[pos:pos + 8], "little", signed=True)
            if len(data) < pos + 8 or numel < 0:
                self.errors.append("tar member 'storages' ends inside a storage")
                return
            pos += 8 + numel * stype.dtype.itemsize
            if pos > size:
                self.errors.append("tar member 'storages' ends inside a storage")
                return
        if pos >= len(data):
            self.errors.append("tar member 'storages' has no list of views after its storages"
                               if pos >= size else
                               f"tar member 'storages' is larger than the "
                               f"{MAX_MEMBER_BYTES // 2**20} MiB read: the rest was not checked")
            return
        self.load(data, pos, "'storages'")

    def tensors(self, data: bytes, size: int) -> None:
        counted = self.count(data, "'tensors'")
        if counted is None:
            return
        n, pos = counted
        for _ in range(n):
            found = self.load(data, pos, "'tensors'")
            if found is None:
                return
            pos = found[1]
            ndim = int.from_bytes(data[pos:pos + 4], "little", signed=True)
            if len(data) < pos + 8 or not 0 <= ndim <= 64:
                self.errors.append("tar member 'tensors' holds a malformed tensor record")
                return
            pos += 8 + 16 * ndim + 8

    def pickle(self, data: bytes, size: int) -> None:
        # the saved object: its persistent ids are the tar format's own, which the restricted
        # unpickler does not resolve; what matters here is the globals it names
        try:
            found = load_restricted(data, 0)
        except UnpickleError as exc:
            self._record(exc.globals, exc.unsafe_globals)
            return
        self._record(found.globals, found.unsafe_globals)
