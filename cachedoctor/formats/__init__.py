"""Readers: one file in, one FileMeta out, metadata only and without importing torch.

Formats are sniffed by their magic bytes; the file extension only breaks ties (a `.pt` of
garbage is read as a broken torch file, a `.txt` of garbage as a foreign file). Every reader
is a module with `read(src, path, deep) -> FileMeta` (the Reader protocol) registered in
READERS by the format sniff() names, so a new format is one module plus one line there.
Zip-based readers also take the parsed central directory (ZipReader); _read_zip picks one by
the member names. No reader raises for bad input: what is broken comes back in
`FileMeta.errors`.
"""

from __future__ import annotations

import dataclasses
import errno
import os
from typing import Protocol, runtime_checkable

from cachedoctor.formats import (
    arrow_ipc,
    gzipped,
    numpy_npy,
    numpy_npz,
    parquet,
    safetensors_header,
    torch_legacy,
    torch_tar,
    torch_zip,
    zip_members,
    zip_templates,
)
from cachedoctor.formats.meta import (
    APPLEDOUBLE,
    ARROW,
    EMPTY,
    IMAGE,
    JSON,
    NPY,
    NPZ,
    PARQUET,
    PICKLE,
    SAFETENSORS,
    TEXT,
    TORCH_LEGACY,
    TORCH_ZIP,
    UNKNOWN,
    ZEROED,
    ZIP,
    FileMeta,
)
from cachedoctor.formats.source import BytesSource, Source, open_source
from cachedoctor.formats.zip_templates import Templates
from cachedoctor.formats.zipdir import ZipDirectory, ZipError, read_directory

UNREADABLE = "unreadable"  # the file could not be opened or read at all (permissions, I/O)
GZIP = "gzip"


@runtime_checkable
class Reader(Protocol):
    """A reader module: one file's bytes in, its FileMeta out; never raises for bad input."""

    def read(self, src: Source, path: str, deep: bool) -> FileMeta: ...


@runtime_checkable
class ZipReader(Protocol):
    """A reader of a zip's members, given the central directory already parsed."""

    def read(self, src: Source, path: str, deep: bool, directory: ZipDirectory) -> FileMeta: ...


READERS: dict[str, Reader] = {
    TORCH_LEGACY: torch_legacy,
    PICKLE: torch_legacy,
    SAFETENSORS: safetensors_header,
    NPY: numpy_npy,
    ARROW: arrow_ipc,
    PARQUET: parquet,
}
ZIP_READERS: dict[str, ZipReader] = {TORCH_ZIP: torch_zip, NPZ: numpy_npz}

# Extensions that promise a cache format: garbage under one of these names is a broken cache
# file (CD101), garbage under any other name is a foreign file (CD107).
EXTENSION_FORMATS = {
    ".pt": TORCH_ZIP, ".pth": TORCH_ZIP, ".bin": TORCH_ZIP, ".ckpt": TORCH_ZIP,
    ".pkl": PICKLE, ".pickle": PICKLE,
    ".safetensors": SAFETENSORS, ".npz": NPZ, ".npy": NPY, ".arrow": ARROW, ".parquet": PARQUET,
}
IMAGE_MAGIC = (
    b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF87a", b"GIF89a", b"BM", b"II*\x00", b"MM\x00*",
)


# Extensions whose loader unpickles what is no zip: torch.load (a tar first, then a pickle
# stream), pickle.load, and np.load(allow_pickle=True) for what is neither npy nor zip.
TORCH_EXTENSIONS = frozenset({".pt", ".pth", ".bin", ".ckpt", ".pkl", ".pickle"})
NUMPY_EXTENSIONS = frozenset({".npy", ".npz"})
NOT_A_CACHE = frozenset({IMAGE, TEXT, JSON, UNKNOWN, ZEROED})


def extension_format(path: str) -> str | None:
    return EXTENSION_FORMATS.get(os.path.splitext(path)[1].lower())


SNIFF_BYTES = 4096  # what sniff() looks at, at most
APPLEDOUBLE_MAGIC = b"\x00\x05\x16\x07"  # AppleDouble's magic number (RFC 1740)


def _padded_safetensors(head: bytes, size: int) -> bool:
    """A safetensors header with JSON whitespace before its `{`, which safetensors' own parser
    (serde_json) accepts: a length that fits the file, then whitespace, then `{`."""
    n = int.from_bytes(head[:8], "little")
    return 0 < n <= size - 8 and head[8:8 + min(n, 64)].lstrip(b" \t\r\n")[:1] == b"{" \
        and head[8:9] in (b" ", b"\t", b"\r", b"\n")


def sniff(head: bytes, size: int) -> str:
    """The format the first bytes announce (UNKNOWN when they announce none)."""
    if size == 0:
        return EMPTY
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        return ZIP
    if head.startswith(b"\x1f\x8b"):
        return GZIP
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return PICKLE
    if head.startswith(b"\x93NUMPY"):
        return NPY
    if arrow_ipc.sniff(head):
        return ARROW
    if parquet.sniff(head):
        return PARQUET
    if len(head) >= 9 and (head[8:9] == b"{" or _padded_safetensors(head, size)):
        return SAFETENSORS
    if head.startswith(IMAGE_MAGIC) or (head[:4] == b"RIFF" and head[8:12] == b"WEBP"):
        return IMAGE
    head = head[:SNIFF_BYTES]
    if not head.strip(b"\x00"):
        return ZEROED
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        # a multi-byte character cut by the head window is still text
        try:
            text = head[:-3].decode("utf-8")
        except UnicodeDecodeError:
            return UNKNOWN
    if "\x00" in text:
        return UNKNOWN
    return JSON if text.lstrip()[:1] in ("{", "[") else TEXT


def read_path(path: str, *, deep: bool = False, templates: Templates | None = None) -> FileMeta:
    """Read one file's metadata; I/O failures come back as format UNREADABLE. A scan passes
    its `templates` (zip_templates), which this read may match and learn from."""
    try:
        # a file the size of a torch layout seen before: only the bytes that decide it are read
        fd, src = open_source(path, None if deep or templates is None else templates.spans,
                              deep=deep)
    except OSError as exc:
        return FileMeta(path, 0, UNREADABLE, errors=(describe_os_error(exc),))
    try:
        meta = read_source(src, path, deep=deep, templates=templates)
    except OSError as exc:
        meta = FileMeta(path, src.size, UNREADABLE, errors=(describe_os_error(exc),))
    finally:
        os.close(fd)
    meta.mtime, meta.stat = src.mtime, src.stat
    return meta


def read_bytes(data: bytes, path: str = "<bytes>", *, deep: bool = False,
               templates: Templates | None = None) -> FileMeta:
    return read_source(BytesSource(data), path, deep=deep, templates=templates)


def read_source(src: Source, path: str, *, deep: bool = False, top: bool = True,
                templates: Templates | None = None) -> FileMeta:
    """Every reading a loader could take of `src`, the worst of them reported. `top` is False
    for the bytes inside a gzip stream (SimpleTuner hands torch.load a BytesIO: no tar try)."""
    at, head = src.windows[0]  # what the source holds from byte 0: no copy
    if at != 0 or (len(head) < min(src.size, SNIFF_BYTES) and not head.startswith(b"PK")):
        head = src.pread(0, SNIFF_BYTES)  # (spans of a zip layout, but no zip)
    fmt = sniff(head, src.size)
    if fmt == GZIP and not top:
        # SimpleTuner gunzips once and hands the rest to torch.load, which reads no gzip: the
        # inner stream is never opened (and nesting is never walked down, however deep)
        return FileMeta(path, src.size, extension_format(path) or TORCH_ZIP,
                        errors=("a gzip stream inside the gzip stream: the loader decompresses "
                                "once, and torch.load cannot read what is left",))
    if fmt == UNKNOWN and head.startswith(APPLEDOUBLE_MAGIC) and os.path.basename(path).startswith("._"):
        # a cache-like name the walk keeps (a trainer listing by extension reads it); these
        # bytes are the resource fork Finder wrote, which no loader gets anything from
        return FileMeta(path, src.size, APPLEDOUBLE)
    if fmt == GZIP:
        return _read_gzip(src, path, deep, templates)
    if fmt == ZIP:
        return _read_zip(src, path, deep, templates)  # torch.load and np.load read a zip as nothing else
    meta = _read_as_sniffed(src, path, deep, fmt, head, templates)
    ext, promised = os.path.splitext(path)[1].lower(), extension_format(path)
    if fmt == EMPTY or promised is None:
        return meta  # a foreign name meets no loader
    if fmt != PICKLE and (ext in TORCH_EXTENSIONS or (
            fmt != NPY if ext in NUMPY_EXTENSIONS else fmt != promised)):
        # the loader unpickles these bytes whatever they look like (an image header, a
        # safetensors length, text): a protocol-0 pickle needs no magic
        pickled = torch_legacy.read(src, path, deep)
        meta = _with_pickle(meta, pickled)
        if meta.errors and promised == PICKLE and pickled.ok:
            meta = pickled  # a sound protocol-0/1 pickle under a pickle name: pickle.load reads it
    if top and ext in TORCH_EXTENSIONS and torch_tar.looks_like_tar(head):
        tar = torch_tar.read(src, path)
        if tar is not None:  # torch.load reads the tar; pickle.load would read the stream
            meta = _merged(tar, meta) if meta.globals else tar
    return meta


def _read_as_sniffed(src: Source, path: str, deep: bool, fmt: str, head: bytes,
                     templates: Templates | None = None) -> FileMeta:
    if fmt == SAFETENSORS and templates is not None:  # files with one header: parsed once
        return safetensors_header.read(src, path, deep, templates.headers)
    if fmt in READERS:
        return READERS[fmt].read(src, path, deep)
    if fmt in (EMPTY, IMAGE):
        return FileMeta(path, src.size, fmt)
    promised = extension_format(path)
    if promised is None:
        return FileMeta(path, src.size, fmt)
    if fmt == ZEROED and src.size <= 64 * 1024 * 1024 and not src.pread(0, src.size).strip(b"\0"):
        why = f"every one of its {src.size:,} bytes is zero: the data never reached the disk"
    else:
        why = f"no {promised} signature: it starts with {head[:8].hex(' ')}"
    return FileMeta(path, src.size, promised, errors=(why,))


def _with_pickle(meta: FileMeta, pickled: FileMeta) -> FileMeta:
    """`meta`, judged also by what its bytes name when unpickled: a hostile reading is CD105
    however the file looks (an image, garbage, a valid safetensors header)."""
    if not pickled.globals:
        return meta  # no pickle, or one that imports nothing: the file is what it looks like
    if meta.format in NOT_A_CACHE or meta.errors:
        return pickled  # the pickle is all there is to the file
    return _merged(meta, pickled)


def _merged(meta: FileMeta, other: FileMeta) -> FileMeta:
    """`meta` with the globals another reading of the same bytes names."""
    note = f"it also reads as a {other.format} stream naming {len(other.globals):,} globals"
    return dataclasses.replace(
        meta,
        same_as=None,  # (facts of its own now: no other file's verdict fits it)
        globals=tuple(dict.fromkeys(meta.globals + other.globals)),
        unsafe_globals=tuple(dict.fromkeys(meta.unsafe_globals + other.unsafe_globals)),
        notes=(*meta.notes, note),
    )


_NO_PLAN = object()


def _read_zip(src: Source, path: str, deep: bool, templates: Templates | None) -> FileMeta:
    # a torch file laid out like one already read needs no directory parse, and one that also
    # holds the same data.pkl no read (--deep: no read but of its CRCs and values)
    windows = None if templates is None else src.windows
    seen = templates.match(src.size, windows) if windows is not None else None
    if seen is not None:
        template, prefix = seen
        records = template.record_bytes(windows)
        twin = template.twin(records, path, deep)
        if deep and twin is not None and prefix.isascii():
            plan = template.plans.get(records, _NO_PLAN)
            if plan is _NO_PLAN:  # what to read of its twins, worked out once
                plan = template.plans[records] = torch_zip.twin_plan(
                    src, twin, template.directory, template.constant)
            crcs = template.crcs(windows)
            whole = src.buffer
            if crcs is not None and plan is not None and whole is not None and \
                    len(whole) == src.size and torch_zip.clean(whole, plan, crcs):
                return twin.renamed(path)  # (read_twin's answer, at the cost of the checks)
            if crcs is not None:
                return torch_zip.read_twin(src, path, twin, template.directory, crcs, prefix,
                                           plan)
        if not deep:  # (--deep reads this file's own directory: its own CRCs)
            if twin is not None:
                return twin
            meta = torch_zip.read(src, path, deep, template.directory, prefix=prefix)
            template.learn(records, meta)
            return meta
    try:
        directory = read_directory(src)
    except ZipError as exc:
        fmt = NPZ if extension_format(path) == NPZ else TORCH_ZIP
        return FileMeta(path, src.size, fmt, errors=(str(exc),))
    names = [e.name for e in directory.entries]
    folded = [zip_members.ascii_fold(n) for n in names]  # as torch (miniz) matches names
    if templates is not None and windows is not None and names and \
            names[0].endswith("/data.pkl"):
        meta = torch_zip.read(src, path, deep, directory)
        # a template reads only the standard records: a file with any other entry (another
        # tool's pickle, a second reading of a record) is read in full every time
        if seen is not None:  # (--deep: laid out as one seen, but no twin yet)
            seen[0].learn(records, meta)
        elif meta.ok and zip_templates.standard(directory):
            templates.remember(src.size, windows, directory, meta)
        return meta
    if names and all(n.endswith(".npy") for n in names):
        return numpy_npz.read(src, path, deep, directory)
    if any(n.endswith("/data.pkl") or n == "data.pkl" for n in folded) or extension_format(
        path
    ) in (TORCH_ZIP,):
        return torch_zip.read(src, path, deep, directory)
    if extension_format(path) == NPZ:
        return numpy_npz.read(src, path, deep, directory)
    return zip_members.read(src, path, deep, directory)


def _read_gzip(src: Source, path: str, deep: bool, templates: Templates | None) -> FileMeta:
    limit = gzipped.DEEP_MAX_INFLATED if deep else gzipped.MAX_INFLATED
    with gzipped.inflated(src, limit) as (inner, error):
        if inner is None:
            promised = extension_format(path) or TORCH_ZIP
            return FileMeta(path, src.size, promised, compression=GZIP, errors=(error,))
        meta = read_source(inner, path, deep=deep, top=False, templates=templates)
    return dataclasses.replace(meta, size=src.size, compression=GZIP)


def describe_os_error(exc: OSError) -> str:
    reasons = {
        errno.EACCES: "permission denied",
        errno.EPERM: "permission denied",
        errno.ELOOP: "symlink loop",
        errno.ENOENT: "vanished while scanning",
        errno.EIO: "I/O error from the device",
    }
    return f"cannot read: {reasons.get(exc.errno or 0, exc.strerror or str(exc))}"
