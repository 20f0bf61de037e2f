"""Helpers the layout modules share: typed reads of config keys that collect ConfigProblems,
the working directory a trainer resolves relative paths against, unique dataset ids, folder
listings."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from cachedoctor.layouts.base import INVALID, MISSING_PATH, ConfigProblem, Origin, frozen
from cachedoctor.layouts.sources import KINDS, ConfigFile, type_name

EXPECTED = {bool: "true or false", int: "a whole number", str: "a string", list: "a list",
            dict: "a mapping"}


class Problems:
    """ConfigProblems collected while a layout reads its configs."""

    def __init__(self) -> None:
        self.items: list[ConfigProblem] = []

    def invalid(self, origin: Origin, message: str, dataset: str | None = None,
                **details: Any) -> None:
        self.items.append(ConfigProblem(origin, message, INVALID, dataset, frozen(details)))

    def missing(self, origin: Origin, what: str, value: str, path: str, base_reason: str,
                dataset: str | None = None) -> None:
        """A configured path that does not exist, or is not the kind of thing the caller
        looked for (a folder, or a file to read) there."""
        shown = f'"{value}"' + (f" ({path})" if os.path.normpath(value) != path else "")
        found = _found(path)
        message = f"{what} {shown} {found or 'does not exist'}"
        if found is None and not os.path.isabs(os.path.expanduser(value)):
            message += f"; relative paths resolve against {base_reason}"
        self.items.append(ConfigProblem(origin, message, MISSING_PATH, dataset,
                                        frozen({"value": value, "resolved": path})))


def _found(path: str) -> str | None:
    """What is at `path` where a caller found no folder, or no file, to use: None when nothing
    is. (A FIFO or a device in a jsonl file's place is there; saying it does not exist sends
    the user looking for a typo.)"""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):  # gone, a dangling symlink, a NUL in the name
        return None
    if stat.S_ISDIR(mode):
        return "is a folder, not a file"
    if stat.S_ISREG(mode):
        return "is a file, not a folder"
    kind = "FIFO" if stat.S_ISFIFO(mode) else "socket" if stat.S_ISSOCK(mode) else "device"
    return f"is a {kind}, neither a file nor a folder"


def typed(config: ConfigFile, problems: Problems, where: tuple, obj: Mapping, key: str,
          kind: type | tuple[type, ...], default: Any, dataset: str | None = None,
          expected: str | None = None) -> Any:
    """obj[key] when it has the expected type, else `default` (and a problem when present)."""
    if not isinstance(obj, Mapping) or key not in obj or obj[key] is None:
        return default
    value = obj[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    if not ok:
        want = expected or " or ".join(EXPECTED.get(k, k.__name__) for k in kinds)
        problems.invalid(config.origin(*where, key), f"{key} is {type_name(value)} "
                         f"({_short(value)}): expected {want}", dataset, key=key, expected=want)
        return default
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def working_dir(path: str, marker: str) -> str:
    """The directory a trainer runs in, judged from where its config lives: the parent of the
    nearest ancestor folder called `marker` (SimpleTuner's and ai-toolkit's `config/`,
    OneTrainer's `training_presets/`), else the config's own folder."""
    found = parent_named(path, marker)
    return os.path.dirname(found) if found else os.path.dirname(os.path.abspath(path))


def parent_named(path: str, name: str) -> str | None:
    """The nearest ancestor directory of `path` called `name`, if any."""
    directory = os.path.dirname(os.path.abspath(path))
    while True:
        if os.path.basename(directory) == name:
            return directory
        parent = os.path.dirname(directory)
        if parent == directory:
            return None
        directory = parent


def unique(ids: Iterable[str]) -> list[str]:
    """The ids with repeats made unique: photos, photos (2), ... A made-up id never takes one
    given as such: ids already unique per config ("videos (2)") meet again across configs."""
    names = list(ids)
    taken = set(names)
    seen: dict[str, int] = {}
    used: set[str] = set()
    out = []
    for name in names:
        count = seen.get(name, 0) + 1
        candidate = name if count == 1 and name not in used else f"{name} ({count})"
        while candidate in used or (count > 1 and candidate in taken):
            count += 1
            candidate = f"{name} ({count})"
        seen[name] = count
        used.add(candidate)
        out.append(candidate)
    return out


# Listings made while targets resolve: every trainer looks into a project folder, and a bare
# cache dir is searched for kohya, ai-toolkit and OneTrainer layouts; listed once each, a flat
# cache of a million files costs one listing, not six. A listing keeps the names layouts look
# for (folders, configs, npz, images, videos), not a flat cache's million `<sha256>.pt` entries.
KEPT_SUFFIXES = frozenset(KINDS) | {".npz", ".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif",
                                    ".tif", ".tiff", ".jxl", ".avif", ".mp4", ".webm", ".avi",
                                    ".mkv", ".mov", ".flv", ".wmv", ".m4v", ".mpg", ".mpeg"}
# The listings belong to one resolve: they live in a context variable, so resolves in two
# threads (each starts with an empty context) never see each other's, nor a later resolve
# an earlier one's (a folder may have changed in between).
_listings: ContextVar[dict[str, tuple[tuple[str, ...], frozenset[str]]] | None] = \
    ContextVar("cachedoctor_listings", default=None)


@contextmanager
def one_listing_each() -> Iterator[None]:
    """Within this block, names(), listdir() and subdirs() list each path once."""
    outer = _listings.get()
    token = _listings.set({} if outer is None else outer)
    try:
        yield
    finally:
        _listings.reset(token)


def names(path: str) -> tuple[str, ...]:
    """The names in `path` of its folders and of files with a KEPT_SUFFIXES suffix (any case),
    in no order; none when it is not a readable directory."""
    return _listing(path)[0]


def listdir(path: str, keep: Callable[[str], object] | None = None) -> list[str]:
    """The names in `path` that `keep` accepts, sorted (filtered first: only the few a caller
    wants from a big cache folder are sorted)."""
    return sorted(names(path) if keep is None else filter(keep, names(path)))


def ending(*suffixes: str) -> Callable[[str], bool]:
    """A `keep` for listdir: names ending with one of `suffixes`."""
    return lambda name: name.endswith(suffixes)


def subdirs(path: str, keep: Callable[[str], object] | None = None) -> list[str]:
    """The names of the directories in `path` (symlinks to one included) that `keep` accepts,
    sorted: known from the listing itself, without a stat per name."""
    dirs = _listing(path)[1]
    return sorted(dirs if keep is None else filter(keep, dirs))


def _listing(path: str) -> tuple[tuple[str, ...], frozenset[str]]:
    listings = _listings.get()
    if listings is None:
        return _list(path)
    found = listings.get(path)
    if found is None:
        found = listings[path] = _list(path)
    return found


def _list(path: str) -> tuple[tuple[str, ...], frozenset[str]]:
    names, dirs = [], []
    try:
        with os.scandir(path) as listing:
            for entry in listing:
                name = entry.name
                try:
                    if entry.is_dir():
                        dirs.append(name)
                        names.append(name)
                        continue
                except OSError:  # a symlink loop: no directory
                    pass
                dot = name.rfind(".")
                if dot >= 0 and name[dot:].lower() in KEPT_SUFFIXES:
                    names.append(name)
    except OSError:
        pass
    return tuple(names), frozenset(dirs)
