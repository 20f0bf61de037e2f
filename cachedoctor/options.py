"""What a scan is asked to do: one frozen value that crosses into the worker processes."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from cachedoctor.findings import Severity


def default_jobs() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class ScanOptions:
    """How a scan runs: rules enabled, --deep, jobs, exclusions, severity and settings.

    `selected` is the selection already resolved (resolve_selection, which config.policy runs
    over every layer of select, extend-select and ignore): the codes of the enabled rules.
    None enables every rule.
    """

    deep: bool = False
    jobs: int = field(default_factory=default_jobs)
    selected: frozenset[str] | None = None
    exclude: tuple[str, ...] = ()  # glob patterns of paths to skip
    severity: Mapping[str, Severity] = field(default_factory=lambda: MappingProxyType({}))
    settings: Mapping[str, Mapping[str, Any]] = field(
        default_factory=lambda: MappingProxyType({})
    )  # per-rule thresholds: {"CD201": {"min-ratio": 1.5}}
    shard: tuple[int, int] | None = None  # (rank, world): check every world-th file only
    keep_paths: bool = False  # list every file checked in the Report (junit); costs memory
    index: bool = True  # reuse the verdicts of unchanged files (index.py) and record new ones
    rebuild_index: bool = False  # start the index afresh
    changed_since: str | None = None  # report file findings of files changed since (index.py)
    make_index: bool = True  # False: use an index that exists, never make one (fix's scan)

    def __reduce__(self):
        return (
            ScanOptions,
            (self.deep, self.jobs, self.selected, self.exclude,
             dict(self.severity), {k: dict(v) for k, v in self.settings.items()}, self.shard,
             self.keep_paths, self.index, self.rebuild_index, self.changed_since,
             self.make_index),
        )

    def enabled(self, code: str) -> bool:
        """Whether the rule `code` runs (and its findings are reported)."""
        return self.selected is None or code in self.selected


@dataclass(frozen=True)
class Selection:
    """One layer of select / extend-select / ignore (a config file, or the command line)."""

    select: tuple[str, ...] | None = None  # None: keep what the layers below chose
    extend_select: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()


def resolve_selection(layers: Iterable[Selection], codes: Iterable[str]) -> list[str]:
    """The codes enabled after applying `layers` in order, as ruff resolves its rule selection.

    A layer's `select` starts afresh. Its `extend-select` and `ignore` change what the layers
    below chose. Within a layer the most specific prefix wins, and ignore wins a tie. This is
    the one place a selection is resolved: flags, config files and API keywords all become
    layers (config.policy), and a scan gets the result as ScanOptions.selected.
    """
    codes = list(codes)
    enabled = set(codes)  # no layer: every rule
    for layer in layers:
        picks = layer.extend_select
        if layer.select is not None:
            enabled = set()
            picks = (*layer.select, *picks)
        for code in codes:
            chosen, dropped = _longest(code, picks), _longest(code, layer.ignore)
            if chosen > dropped:
                enabled.add(code)
            elif dropped >= 0:
                enabled.discard(code)
    return [c for c in codes if c in enabled]


def _longest(code: str, prefixes: Iterable[str]) -> int:
    return max((len(p) for p in prefixes if code.startswith(p.strip().upper())), default=-1)
