"""Plain-text views of a plan, a run's result and the runs listing, for the CLI."""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable
from typing import TextIO

from cachedoctor.findings import display_path
from cachedoctor.repair.apply import RunResult
from cachedoctor.repair.journal import DONE, FAILED, SKIPPED
from cachedoctor.repair.plan import COMPACT, KINDS, QUARANTINE, REENCODE, TO_CPU, Plan
from cachedoctor.repair.undo import RunSummary
from cachedoctor.units import human_bytes

LISTED = 10  # files shown per action (and per skip reason) unless --verbose

WHAT = {
    QUARANTINE: "moved to the quarantine",
    COMPACT: "rewritten compactly (lossless)",
    TO_CPU: "rewritten with every tensor on the CPU (lossless)",
    REENCODE: "encoded again from the source image",
}


def render_plan(plan: Plan, out: TextIO, *, verbose: bool = False) -> None:
    roots = plan.roots
    if plan.actions:
        out.write(f"Plan: {len(plan.actions)} action{'s' * (len(plan.actions) != 1)} in "
                  f"{len(roots)} cache{'s' * (len(roots) != 1)}: the cache files shrink by "
                  f"{human_bytes(plan.expected_freed_size)} (the originals stay in the quarantine "
                  f"until you delete it), {human_bytes(plan.bytes_rewritten)} rewritten\n")
    for kind in KINDS:
        actions = plan.of_kind(kind)
        if not actions:
            continue
        sizes = []
        if kind in (COMPACT, TO_CPU):
            sizes.append(f"rewrites {human_bytes(sum(a.rewritten for a in actions))}")
        if kind != REENCODE:
            sizes.append(f"cache files shrink by {'~' * (kind == COMPACT)}"
                         f"{human_bytes(sum(a.freed for a in actions))}")
        else:
            sizes.append(f"encoder {plan.encoder.spec if plan.encoder else '?'}")
        out.write(f"  {kind:<11} {_files(len(actions)):<10} {WHAT[kind]}; {', '.join(sizes)}\n")
        for action in _some(actions, verbose):
            line = f"      {','.join(action.codes):<12} {display_path(action.path)}"
            if action.target is not None:
                line += f"  <- {display_path(action.target.image)} ({action.target.format.container}, " \
                        f"{action.target.format.dtype} {action.target.shape})"
            if action.why:
                line += f"  ({action.why})"
            out.write(line + "\n")
        if len(actions) > LISTED and not verbose:
            out.write(f"      (+{len(actions) - LISTED} more; --verbose lists all)\n")
    manual = [n for n in plan.notes if not n.skipped]
    if manual:
        out.write("Not changed (no automatic fix):\n")
        for code, notes in _grouped(manual, lambda n: n.code):
            out.write(f"  {code}  {_files(len(notes))}: see `cachedoctor explain {code}`\n")
            for note in notes:
                if note.edit:
                    out.write(f"      edit {display_path(note.path)}: {note.edit}\n")
    skipped = [n for n in plan.notes if n.skipped]
    if skipped:
        out.write("Skipped:\n")
        for (code, why), notes in _grouped(skipped, lambda n: (n.code, n.message)):
            out.write(f"  {code}  {_files(len(notes))}: {why}\n")
            for note in _some(notes, verbose):
                out.write(f"      {display_path(note.path)}\n")
    if plan.actions:
        out.write("Every file removed or replaced is kept in <cache>/.cachedoctor/quarantine/<run>/;"
                  " `cachedoctor undo` puts a run back.\n")


def render_result(result: RunResult, out: TextIO, *, verbose: bool = False) -> None:
    parts = []
    for kind in KINDS:
        total = sum(1 for o in result.outcomes if o.action.kind == kind)
        if total:
            counts = [f"{result.count(kind, s)} {s}" for s in (FAILED, SKIPPED) if result.count(kind, s)]
            parts.append(f"{kind} {result.count(kind, DONE)}/{total}" + (f" ({', '.join(counts)})" if counts else ""))
    out.write(f"Run {result.run_id}: {'; '.join(parts)}.\n")
    for outcome in result.outcomes:
        if outcome.state != DONE:
            out.write(f"  {outcome.state:<7} {outcome.action.kind:<10} {display_path(outcome.action.path)}: "
                      f"{outcome.message}\n")
    if result.failed:
        out.write("Failed actions were rolled back: those files are as they were.\n")
    out.write(f"Undo with: cachedoctor undo {result.run_id}\n")


def render_runs(summaries: Iterable[RunSummary], out: TextIO) -> None:
    rows = [("run", "started (UTC)", "state", "actions", "cache")]
    for s in summaries:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(s.run.started))
        actions = ", ".join(f"{kind} {sum(c.values())}" + _states(c) for kind, c in s.counts.items())
        rows.append((s.run.run_id, started, s.run.state, actions or "-", display_path(s.root)))
    if len(rows) == 1:
        out.write("No runs.\n")
        return
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for row in rows:
        out.write("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + f"  {row[4]}\n")


def _states(counts: dict[str, int]) -> str:
    other = {s: n for s, n in counts.items() if s != DONE}
    return f" ({', '.join(f'{n} {s}' for s, n in other.items())})" if other else ""


def _files(n: int) -> str:
    return f"{n} file{'s' * (n != 1)}"


def _some(items, verbose: bool):
    return items if verbose else items[:LISTED]


def _grouped(items, key):
    groups: dict = collections.defaultdict(list)
    for item in items:
        groups[key(item)].append(item)
    return groups.items()
