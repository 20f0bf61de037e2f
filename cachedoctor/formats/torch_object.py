"""The object a small torch.save file holds, for trainer metadata kept in torch files
(OneTrainer's `aggregate.pt`: a list of dicts of paths and sizes).

Read through the restricted unpickler, so nothing is imported or run: tensors come back as
inert TensorRefs, unknown classes as Stubs. Only the zip format (torch >= 1.6), plain or gzip.
"""

from __future__ import annotations

import gzip
import zlib

from cachedoctor.formats.source import BytesSource
from cachedoctor.formats.unpickler import MAX_PICKLE_BYTES, UnpickleError, load_restricted
from cachedoctor.formats.zipdir import ZipError, read_directory, read_entry

MAX_FILE_BYTES = 256 * 1024 * 1024


class ObjectError(Exception):
    """The file holds no object we can read; str() says why."""


def read_object(path: str) -> object:
    """The unpickled object of the torch file at `path`; raises ObjectError (or OSError)."""
    with open(path, "rb") as f:
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise ObjectError(f"larger than {MAX_FILE_BYTES // 2**20} MiB")
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as exc:
            raise ObjectError(f"broken gzip stream ({exc})") from None
    if not data.startswith(b"PK"):
        raise ObjectError("not a torch zip file")
    src = BytesSource(data)
    try:
        directory = read_directory(src)
        pkl = next((e for e in directory.entries if e.name.endswith("/data.pkl")), None)
        if pkl is None:
            raise ObjectError("the archive has no data.pkl")
        raw = read_entry(src, pkl, MAX_PICKLE_BYTES + 1)
    except ZipError as exc:
        raise ObjectError(str(exc)) from None
    try:
        return load_restricted(raw).obj
    except UnpickleError as exc:
        raise ObjectError(str(exc)) from None
