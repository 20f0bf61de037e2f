"""What a trainer's configuration tells us: datasets, and where their files live."""

from __future__ import annotations

from dataclasses import dataclass


class TargetError(Exception):
    """A target cannot be scanned at all (missing, unreadable config): exit code 2."""


@dataclass(frozen=True)
class Dataset:
    id: str
    cache_dirs: tuple[str, ...]  # directories (or single files) whose files are checked


@dataclass(frozen=True)
class Layout:
    trainer: str  # "bare" when no trainer config was given
    source: str | None  # the config file the layout came from
    datasets: tuple[Dataset, ...]
