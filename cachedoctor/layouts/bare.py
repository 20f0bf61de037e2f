"""A cache directory (or file) given with no trainer config: one dataset named for it."""

from __future__ import annotations

import os

from cachedoctor.layouts.base import Dataset, Layout


def layout(path: str) -> Layout:
    path = os.path.abspath(path)
    name = os.path.basename(path.rstrip(os.sep)) or path
    return Layout("bare", None, (Dataset(name, (path,)),))
