"""The Python API for training scripts and CI: `scan()` returns a Report, `preflight()` raises.

Keyword options are the command line's flags (`select`, `ignore`, `extend_select`, `exclude`,
`deep`, `jobs`, `baseline`, `severity`, `rules`, `config`, `isolated`, `index`, `rebuild_index`,
`changed_since`), and the same config
file applies as on the command line (found from the working directory upward; `isolated=True`
ignores it). Under an initialised torch.distributed group, `preflight` splits the files across
the ranks and every rank reaches the same verdict; torch is never imported here otherwise.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from cachedoctor import config as configuration
from cachedoctor.findings import DEFAULT_FAIL_ON, FailOn, Report
from cachedoctor.options import default_jobs

if TYPE_CHECKING:
    from cachedoctor.baseline import BaselineResult

Targets = str | os.PathLike | Iterable[str | os.PathLike]


class CacheProblems(Exception):
    """Findings at or above `fail_on`. The message is the human summary; `.report` the data."""

    def __init__(self, report: Report, fail_on: FailOn | str = DEFAULT_FAIL_ON) -> None:
        from cachedoctor.reporters.text import brief

        super().__init__(f"cachedoctor found problems at or above {str(fail_on)!r} in "
                         f"{', '.join(report.targets)}:\n{brief(report)}")
        self.report = report
        self.fail_on = fail_on

    def __reduce__(self):
        return (CacheProblems, (self.report, self.fail_on))


def _targets(targets: Targets) -> tuple[str, ...]:
    if isinstance(targets, (str, os.PathLike)):
        targets = [targets]
    return tuple(os.fspath(t) for t in targets)


def _codes(value: str | Iterable[str] | None) -> list[str] | None:
    if value is None:
        return None
    items = [value] if isinstance(value, str) else list(value)
    return [c.strip() for item in items for c in str(item).split(",") if c.strip()]


def _table(value: Any, name: str, source: str) -> list[tuple[Any, Any]]:
    """A mapping option's items; ConfigError (not a TypeError) for anything else."""
    if value is None:
        return []
    if not isinstance(value, Mapping):
        raise configuration.ConfigError(f"{source}: {name} must be a mapping, not "
                                        f"{type(value).__name__}")
    return list(value.items())


def resolve_policy(*, select: str | Iterable[str] | None = None,
                   ignore: str | Iterable[str] | None = None,
                   extend_select: str | Iterable[str] | None = None,
                   exclude: str | Iterable[str] | None = None, deep: bool | None = None,
                   fail_on: FailOn | str | None = None, baseline: str | os.PathLike | None = None,
                   severity: Mapping[str, Any] | None = None,
                   rules: Mapping[str, Mapping[str, Any]] | None = None,
                   config: str | os.PathLike | None = None, isolated: bool = False,
                   jobs: int | None = None, overrides: Iterable[configuration.Config] = (),
                   source: str = "arguments", include_info: bool | None = None,
                   index: bool = True, rebuild_index: bool = False,
                   changed_since: str | float | None = None) -> configuration.Policy:
    """The Policy the keyword options and the config file make (raises ConfigError).

    The options are the top layer, over `overrides` (`--config 'KEY = VALUE'`), over the file.
    `index=False` reads every file afresh and records nothing; `rebuild_index` starts the
    index afresh; `changed_since` (a scan or repair run id, an ISO time or epoch seconds)
    reports file findings of the files changed since only (index.py).
    """
    given = {
        "select": _codes(select),
        "ignore": _codes(ignore),
        "extend-select": _codes(extend_select),
        "exclude": [exclude] if isinstance(exclude, str) else None if exclude is None else list(exclude),
        "deep": deep,
        "fail-on": fail_on,
        "baseline": os.fspath(baseline) if baseline is not None else None,
        "severity": {code: str(level) for code, level in _table(severity, "severity", source)},
        "rules": {code: dict(_table(values, f"rules.{code}", source))
                  for code, values in _table(rules, "rules", source)},
        "include-info": include_info,
    }
    table = {key: value for key, value in given.items() if value not in (None, {})}
    policy = configuration.policy(configuration.parse(table, source), config=config,
                                  isolated=isolated, overrides=overrides)
    if jobs is not None:
        if jobs < 1:
            raise configuration.ConfigError(f"{source}: jobs must be at least 1")
        policy = dataclasses.replace(policy, options=dataclasses.replace(policy.options, jobs=jobs))
    if not index or rebuild_index or changed_since is not None:
        since = None if changed_since is None else str(changed_since)
        policy = dataclasses.replace(policy, options=dataclasses.replace(
            policy.options, index=bool(index), rebuild_index=bool(rebuild_index), changed_since=since))
    return policy


def scan(targets: Targets, **options: Any) -> Report:
    """Scan cache dirs, cache files or trainer configs; findings come back as data.

    With a baseline (the `baseline` option or the config file's), findings it records are left
    out. Raises TargetError for a target that does not exist, ConfigError for a bad option
    (a `changed_since` that is no time nor recorded run included) or config file,
    BaselineError for an unreadable baseline. `report.index` says what the index did.
    """
    return _scan(_targets(targets), resolve_policy(**options))


def _scan(targets: tuple[str, ...], policy: configuration.Policy) -> Report:
    return scan_policy(targets, policy)[1].report


def scan_policy(targets: Iterable[str], policy: configuration.Policy, *, use_baseline: bool = True,
                keep_paths: bool = False, on_start: Callable[[int | None], None] | None = None,
                on_progress: Callable[[int], None] | None = None) -> tuple[Report, BaselineResult]:
    """Scan under a resolved `policy`: the report of every finding (stamped with the policy),
    and that report with the policy's baseline applied. This is the one baseline path:
    `cachedoctor scan`, `scan()` and `preflight()` all take it.

    `use_baseline=False` leaves the baseline out (--write-baseline records every finding);
    `keep_paths` lists every file checked; `on_start` and `on_progress` are engine.scan's.
    Raises BaselineError (before scanning) and TargetError.
    """
    from cachedoctor import engine
    from cachedoctor.baseline import apply_to, named

    known = named(policy.baseline) if use_baseline else None
    options = dataclasses.replace(policy.options, keep_paths=True) if keep_paths else policy.options
    report = dataclasses.replace(engine.scan(targets, options, on_start=on_start,
                                             on_progress=on_progress), policy=policy.applied)
    return report, apply_to(report, known)


def preflight(targets: Targets, fail_on: FailOn | str | None = None, *, group: Any = None,
              **options: Any) -> Report:
    """Scan before training and raise CacheProblems when a finding reaches `fail_on`
    (default: the config file's `fail-on`, else "error"); return the Report otherwise.

    Under an initialised torch.distributed process group (`group`, default the whole world)
    every rank checks its share of the files; the findings and per-dataset aggregates of the
    files are reduced (reduce.py), so dataset rules judge every file, and every rank returns,
    or raises, the same.
    """
    dist = _distributed(group)
    if dist is None:
        policy = resolve_policy(fail_on=fail_on, **options)
        report = _scan(_targets(targets), policy)
    else:
        report, policy = _sharded(dist, group, _targets(targets), fail_on, options)
    if report.fails(policy.fail_on):
        raise CacheProblems(report, policy.fail_on)
    return report


def _distributed(group: Any) -> Any:
    """torch.distributed when a process group of more than one rank is up, else None."""
    if "torch" not in sys.modules:  # no torch loaded: no process group can exist
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist if dist.get_world_size(group) > 1 else None


def _jobs_per_rank() -> int:
    """Worker processes per rank: the cores shared by the ranks on this machine."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, default_jobs() // max(local, 1))


def _portable(exc: Exception) -> Exception:
    """`exc` if it survives pickling (to go through all_gather_object), else its text."""
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc


def _sharded(dist: Any, group: Any, targets: tuple[str, ...], fail_on: FailOn | str | None,
             options: dict[str, Any]) -> tuple[Report, configuration.Policy]:
    from cachedoctor import engine, reduce
    from cachedoctor.baseline import apply_to, named

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    exchange = reduce.Exchange(dist, group)
    # Everything that can fail on one rank only happens between the collectives, and its error
    # is gathered like a result: a rank that raised alone would leave the others waiting forever.
    held: dict[str, Any] = {}

    def read() -> tuple:
        options.setdefault("jobs", _jobs_per_rank())
        held["policy"] = policy = resolve_policy(fail_on=fail_on, **options)
        held["baseline"] = named(policy.baseline)
        # engine.scan's steps, with the file phase of this rank's share only
        held["scope"] = scope = engine.begin(
            targets, dataclasses.replace(policy.options, shard=(rank, world)))
        held["phase"] = phase = engine.read_files(scope)
        held["datasets"] = datasets = engine.datasets_of(scope.layouts)
        return phase.findings, phase.files, phase.bytes, reduce.aggregate(phase.store, datasets)

    try:
        # round 1: file findings and counts, and the per-dataset aggregates of this rank's files
        first = _agreed(exchange, rank, read)
        merged = reduce.merge_all(part[3] for part in first)
        scope, datasets = held["scope"], held["datasets"]
        # round 2: the summaries the dataset rules select, and the dirty coverage rows
        second = _agreed(exchange, rank, lambda: reduce.shipment(
            held["phase"].store, merged, scope.options, scope.rules, datasets))
    finally:
        if "phase" in held:
            held["phase"].store.close()
    policy, baseline = held["policy"], held["baseline"]
    combined = engine.FilePhase([f for part in first for f in part[0]],
                                sum(part[1] for part in first), sum(part[2] for part in first),
                                reduce.ReducedStore(merged, datasets, second))
    report = dataclasses.replace(engine.finish(scope, combined), policy=policy.applied)
    _last_exchange[:] = [exchange.exchanged, exchange.calls]
    return apply_to(report, baseline).report, policy


# What the last sharded preflight of this process exchanged: [bytes gathered, collectives]
# (tests and benchmarks/sharded_preflight.py read it).
_last_exchange: list[int] = [0, 0]


def _agreed(exchange: Any, rank: int, compute: Any) -> list[Any]:
    """Every rank's `compute()`, or every rank raises the first error a rank met."""
    try:
        mine: tuple[str, Any] = ("ok", compute())
    except Exception as exc:
        error = exc
        mine = ("error", _portable(exc))
    gathered = exchange.objects(mine)
    for failed_rank, (status, value) in enumerate(gathered):
        if status == "error":
            raised = error if failed_rank == rank else value
            raised.add_note(f"cachedoctor.preflight: raised on rank {failed_rank} of "
                            f"{len(gathered)}")
            raise raised
    return [value for _, value in gathered]
