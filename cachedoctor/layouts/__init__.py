"""Turn scan targets into Layouts: trainer configs become datasets, a bare dir one dataset."""

from __future__ import annotations

import os
from collections.abc import Iterable

from cachedoctor.layouts import bare
from cachedoctor.layouts.base import Dataset, Layout, TargetError

__all__ = ["Dataset", "Layout", "TargetError", "resolve"]


def resolve(targets: Iterable[str]) -> list[Layout]:
    """One Layout per target; a target that does not exist is a TargetError."""
    layouts = []
    for target in targets:
        if not os.path.lexists(target):
            raise TargetError(f"{target}: no such file or directory")
        layouts.append(bare.layout(target))
    return layouts
