"""The compiled checks (_native.c), when they were built and are wanted, else None.

They do what nonfinite.holds_none and zip_templates' regular expressions do, several times
faster on the files --deep reads by the million. `pip install` builds them where a C compiler
is present and goes on without them where none is; CACHEDOCTOR_NO_NATIVE=1 turns them off
(the tests run both ways).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType


def _load() -> ModuleType | None:
    if os.environ.get("CACHEDOCTOR_NO_NATIVE"):
        return None
    try:  # (by name: the package's __init__ imports the readers that import this module)
        return importlib.import_module("cachedoctor.formats._native")
    except ImportError:
        return None


NATIVE = _load()
