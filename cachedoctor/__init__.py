"""cachedoctor: find and repair broken training caches of diffusion trainers.

`cachedoctor.scan(targets, **options) -> Report` and `cachedoctor.preflight(targets, ...)`
(raising `CacheProblems`) are the API for training scripts and CI; see `cachedoctor.api`.
They load on first use, so `import cachedoctor` stays cheap and never imports torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "scan": "cachedoctor.api",
    "preflight": "cachedoctor.api",
    "CacheProblems": "cachedoctor.api",
    "Report": "cachedoctor.findings",
    "Finding": "cachedoctor.findings",
    "Severity": "cachedoctor.findings",
    "ConfigError": "cachedoctor.config",
    "BaselineError": "cachedoctor.baseline",
    "TargetError": "cachedoctor.layouts",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
