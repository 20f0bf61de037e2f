"""torch files in and out, in the container they came in (imports torch: repair actions only).

A file is loaded only after the scan's own reader, run over the very bytes that torch will
read, found it whole and free of globals outside the tensor allow-list (CD105): a hostile
pickle is never handed to torch, not even with weights_only=True. A zip with two members whose
names differ only in case (`archive/data.pkl` and `archive/DATA.PKL`) is refused too: torch's
zip reader looks names up ignoring case, so it may read the member the scan did not judge.
"""

from __future__ import annotations

import gzip
import io
from typing import Any

# SimpleTuner's writer, as the fixtures reproduce it: zip, gzip (level 9, mtime 0: the same
# object always gives the same bytes) or legacy.
from cachedoctor.fixtures.latents import to_bytes as dumps
from cachedoctor.formats import read_bytes
from cachedoctor.formats.meta import FileMeta
from cachedoctor.layouts.entries import GZIP, LEGACY, TORCH_CONTAINERS, ZIP, container_of
from cachedoctor.repair.errors import RepairError

__all__ = ["GZIP", "LEGACY", "ZIP", "Unloadable", "checked", "container", "dumps", "load"]


class Unloadable(RepairError):
    """A file that must not, or cannot, be loaded."""


def container(meta: FileMeta) -> str:
    """zip, gzip (gzip around a torch zip) or legacy; Unloadable for anything else."""
    kind = container_of(meta)
    if kind in TORCH_CONTAINERS:
        return kind
    wrapped = f"{meta.compression}+{meta.format}" if meta.compression else meta.format
    raise Unloadable(f"not a torch file this action can rewrite ({wrapped})")


def checked(data: bytes, path: str) -> FileMeta:
    """The reader's verdict on `data`; Unloadable when it is broken or names unsafe globals."""
    meta = read_bytes(data, path)
    if meta.unsafe_globals:
        raise Unloadable("its pickle imports globals outside the tensor allow-list (CD105): "
                         f"{', '.join(meta.unsafe_globals[:4])}; never loaded")
    if meta.errors:
        raise Unloadable(f"cannot be parsed: {meta.errors[0]}")
    kind = container(meta)
    if kind in (ZIP, GZIP):
        twins = case_twins(gzip.decompress(data) if kind == GZIP else data)
        if twins:
            raise Unloadable(f"its zip holds members whose names differ only in case ({', '.join(twins)}): "
                             "torch may read one the check did not; never loaded")
    return meta


def case_twins(data: bytes) -> tuple[str, ...]:
    """Names of zip members that another member's name equals ignoring case (or exactly)."""
    from cachedoctor.formats.source import BytesSource
    from cachedoctor.formats.zipdir import ZipError, read_directory

    try:
        entries = read_directory(BytesSource(data)).entries
    except ZipError:
        return ()  # the reader has judged it already
    seen: dict[str, str] = {}
    twins: list[str] = []
    for entry in entries:
        key = entry.name.lower()
        if key in seen:
            twins += [n for n in (seen[key], entry.name) if n not in twins]
        else:
            seen[key] = entry.name
    return tuple(twins)


def load(data: bytes, meta: FileMeta) -> Any:
    """torch.load(weights_only=True, map_location="cpu") of bytes `checked` has passed."""
    import torch

    raw = gzip.decompress(data) if meta.compression == "gzip" else data
    return torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")

