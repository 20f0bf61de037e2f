"""Path comparisons as the file system sees them, and relative paths as a trainer resolves them.

Two spellings name one directory when they agree after resolving symlinks, `..`, `.`, repeated
and trailing slashes (os.path.realpath), and, on a case-insensitive file system (macOS APFS and
HFS+ by default, Windows, some network shares), after case folding. Whether a file system folds
case is measured at run time, once per existing directory: the directory is looked up again
with its name's case swapped. `CACHEDOCTOR_CASE_INSENSITIVE=1` (or `0`) overrides the
measurement, for file systems that cannot be probed and for tests.
"""

from __future__ import annotations

import functools
import os

CASE_SWITCH = "CACHEDOCTOR_CASE_INSENSITIVE"


def resolve(base: str, path: str) -> str:
    """`path` (with `~`) made absolute against `base`, normalised but with symlinks kept."""
    path = os.path.expanduser(path)
    return os.path.normpath(os.path.join(base, path))


def case_insensitive(path: str) -> bool:
    """Whether the file system holding `path` (or its nearest existing ancestor) folds case."""
    forced = os.environ.get(CASE_SWITCH)
    if forced is not None:
        return forced.strip().lower() in ("1", "true", "yes")
    probe = path
    while probe and not os.path.isdir(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    return _folds_case(probe)


@functools.lru_cache(maxsize=256)
def _folds_case(directory: str) -> bool:
    # Swap the case of the last component that has letters; a directory with none (/, /1/2)
    # tells nothing, so walk up until one does.
    probe = directory
    while True:
        parent, name = os.path.split(probe)
        if name.swapcase() != name:
            other = os.path.join(parent, name.swapcase())
            try:
                return os.path.samefile(probe, other)
            except OSError:
                return False
        if not name or parent == probe:
            return False
        probe = parent


def canonical(path: str) -> str:
    """The one spelling of `path` that comparisons use."""
    real = os.path.realpath(path)
    return os.path.normcase(real).casefold() if case_insensitive(real) else os.path.normcase(real)


def under(path: str, root: str) -> bool:
    """Whether `path` is `root` or lies within it, as spelt (no link resolved)."""
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def relation(a: str, b: str) -> str | None:
    """'same' when a and b are one directory, 'inside' when a lies within b, 'contains' when b
    lies within a, else None."""
    ca, cb = canonical(a), canonical(b)
    if ca == cb:
        return "same"
    if ca.startswith(cb.rstrip(os.sep) + os.sep):
        return "inside"
    if cb.startswith(ca.rstrip(os.sep) + os.sep):
        return "contains"
    return None
