"""torch files in and out, in the container they came in (imports torch: repair actions only).

A file is loaded only after the scan's own reader, run over the very bytes that torch will
read, found it whole and free of globals outside the tensor allow-list (CD105): a hostile
pickle is never handed to torch, not even with weights_only=True.
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
    container(meta)
    return meta


def load(data: bytes, meta: FileMeta) -> Any:
    """torch.load(weights_only=True, map_location="cpu") of bytes `checked` has passed."""
    import torch

    raw = gzip.decompress(data) if meta.compression == "gzip" else data
    return torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")

