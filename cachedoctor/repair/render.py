"""Plain-text views of a plan, a run's result and the runs listing, for the CLI."""

from __future__ import annotations

import collections
import os
import shlex
import time
from collections.abc import Iterable, Sequence
from typing import TextIO

from cachedoctor.checks import missing_cache_entries
from cachedoctor.findings import display_path, printable
from cachedoctor.fix_kinds import COMPACT, KINDS, QUARANTINE, REENCODE, TO_CPU
from cachedoctor.inventory import LATENT, classify
from cachedoctor.repair.apply import RunResult
from cachedoctor.repair.history import Account, Listed, measure
from cachedoctor.repair.journal import DONE, FAILED, SKIPPED
from cachedoctor.repair.plan import REENCODE_AFTER, Plan
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
        sizes = []
        if plan.quarantined_size:
            sizes.append(f"moves {human_bytes(plan.quarantined_size)} of originals to the quarantine")
        if plan.bytes_rewritten:
            sizes.append(f"rewrites {human_bytes(plan.bytes_rewritten)}")
        out.write(f"Plan: {len(plan.actions)} action{'s' * (len(plan.actions) != 1)} in "
                  f"{len(roots)} cache{'s' * (len(roots) != 1)}"
                  + (f": {', '.join(sizes)}" if sizes else "") + "\n")
    for kind in KINDS:
        actions = plan.of_kind(kind)
        if not actions:
            continue
        sizes = []
        if kind in (COMPACT, TO_CPU):
            sizes.append(f"rewrites {human_bytes(sum(a.rewritten for a in actions))}")
        if kind == QUARANTINE:
            sizes.append(human_bytes(sum(a.freed for a in actions)))
        elif kind == COMPACT:
            sizes.append(f"~{human_bytes(sum(a.freed for a in actions))} smaller")
        elif kind == TO_CPU:
            sizes.append("a few bytes smaller (device names; the result says how many)")
        else:
            sizes.append(f"encoder {plan.encoder.spec if plan.encoder else '?'}")
        out.write(f"  {kind:<11} {_files(len(actions)):<10} {WHAT[kind]}; {', '.join(sizes)}\n")
        for action in _some(actions, verbose):
            line = f"      {','.join(action.codes):<12} {display_path(action.path)}"
            if action.target is not None:
                line += f"  <- {display_path(action.target.image)} ({action.target.format.container}, " \
                        f"{action.target.format.dtype} {action.target.shape})"
            if action.why:
                line += f"  ({printable(action.why)})"
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
                    out.write(f"      edit {display_path(note.path)}: {printable(note.edit)}\n")
    skipped = [n for n in plan.notes if n.skipped]
    if skipped:
        out.write("Skipped:\n")
        for (code, why), notes in _grouped(skipped, lambda n: (n.code, n.message)):
            out.write(f"  {code}  {_files(len(notes))}: {printable(why)}\n")  # may name a path
            for note in _some(notes, verbose):
                out.write(f"      {display_path(note.path)}\n")
    if plan.left_out:
        out.write(f"Left out: {_findings(plan.left_out)} not acted on: --include-info acts on them\n")
    if plan.actions:
        about = "~" if plan.of_kind(COMPACT) else ""  # compact's share is CD201's estimate
        out.write(f"The cache files shrink by {about}{human_bytes(plan.expected_freed_size)} once the run's "
                  "quarantine is purged: every file removed or replaced stays in "
                  "<cache>/.cachedoctor/quarantine/<run>/ until `cachedoctor purge RUN` deletes it; "
                  "until then `cachedoctor undo RUN` puts the run back.\n")


def _findings(notes) -> str:
    """'3 info findings (CD405)'."""
    codes = ", ".join(sorted({n.code for n in notes}))
    return f"{len(notes)} info finding{'s' * (len(notes) != 1)} ({codes})"


def render_result(result: RunResult, out: TextIO, *, verbose: bool = False, plan: Plan | None = None,
                  targets: Sequence[str] = ()) -> None:
    parts = []
    for kind in KINDS:
        total = sum(1 for o in result.outcomes if o.action.kind == kind)
        if total:
            counts = [f"{result.count(kind, s)} {s}" for s in (FAILED, SKIPPED) if result.count(kind, s)]
            parts.append(f"{kind} {result.count(kind, DONE)}/{total}" + (f" ({', '.join(counts)})" if counts else ""))
    out.write(f"Run {result.run_id}: {'; '.join(parts)}.\n")
    for outcome in result.outcomes:
        if outcome.state != DONE:
            # an I/O error on the file itself names it already (`/c/a.pt: No space left on device`)
            message = outcome.message.removeprefix(f"{outcome.action.path}: ")
            out.write(f"  {outcome.state:<7} {outcome.action.kind:<10} {display_path(outcome.action.path)}: "
                      f"{printable(message)}\n")
    if result.failed:
        out.write("Failed actions were rolled back: those files are as they were.\n")
    freed = measure((o.action.kind, o.action.path, o.action.size) for o in result.outcomes
                    if o.state == DONE)
    kinds = ", ".join(f"{kind} {_signed(n)}" for kind, n in freed.by_kind.items())
    out.write(f"The cache files {'shrank' if freed.shrank >= 0 else 'grew'} by "
              f"{human_bytes(abs(freed.shrank))} ({kinds}).\n" if freed.by_kind else "")
    if freed.kept:
        out.write(f"The run moved {human_bytes(freed.kept)} of originals to the quarantine: "
                  f"`cachedoctor purge {result.run_id}` frees it (the run can then no longer be "
                  "undone).\n")
    out.write(f"Undo with: cachedoctor undo {result.run_id}\n")
    if plan is not None:
        out.write(next_steps(result, plan, targets))


def next_steps(result: RunResult, plan: Plan, targets: Sequence[str]) -> str:
    """What the run left, each with the command for it."""
    command = "cachedoctor fix " + " ".join(shlex.quote(display_path(t)) for t in targets)
    left = []
    if plan.left_out:
        left.append(f"{_findings(plan.left_out)} not acted on: `{command} --include-info`")
    if plan.encoder is None:
        again = sum(1 for o in result.outcomes if o.state == DONE and o.action.kind == QUARANTINE
                    and REENCODE_AFTER.intersection(o.action.codes)
                    and classify(os.path.basename(o.action.path), os.path.dirname(o.action.path)) == LATENT)
        again += sum(1 for n in plan.notes if n.skipped and n.code == missing_cache_entries.RULE.code)
        if again:
            left.append(f"{again} file{'s' * (again != 1)} need{'s' * (again == 1)} encoding again: "
                        f"`{command} --reencode --encoder diffusers:PATH`")
    manual = [n for n in plan.notes if not n.skipped]
    if manual:
        codes = sorted({n.code for n in manual})
        left.append(f"{len(manual)} finding{'s' * (len(manual) != 1)} without an automatic fix "
                    f"({', '.join(codes)}): `cachedoctor explain {codes[0]}`")
    if result.failed:
        left.append(f"{len(result.failed)} failed action{'s' * (len(result.failed) != 1)}, rolled back: "
                    "see above, then run the fix again")
    if not left:
        scan = "cachedoctor scan " + " ".join(shlex.quote(display_path(t)) for t in targets)
        return f"Next: nothing left to fix; `{scan}` confirms it.\n"
    return "Next: " + "\n      ".join(left) + "\n"


def _signed(n: int) -> str:
    return human_bytes(n) if n >= 0 else f"+{human_bytes(-n)}"


def render_runs(listed: Iterable[Listed], out: TextIO) -> None:
    """One row per run and cache: its state, and per action kind how many are done, rolled
    back, not started."""
    rows = [("run", "started (UTC)", "state", "actions", "cache")]
    for s in listed:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(s.run.started))
        actions = ", ".join(f"{kind} {sum(c.values())}" + _states(c) for kind, c in s.counts.items())
        state = s.run.state + (", purged" if s.purged is not None else "")
        # a journal may come with a cache someone else wrote: its ids and states are text from it
        rows.append((printable(s.run.run_id), started, printable(state), printable(actions or "-"),
                     display_path(s.root)))
    if len(rows) == 1:
        out.write("No runs.\n")
        return
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for row in rows:
        out.write("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + f"  {row[4]}\n")


def render_interrupted(run_id: str, accounts: Iterable[Account], targets: Sequence[str],
                       out: TextIO) -> None:
    """What an interrupted run did, and the commands that finish or undo it."""
    accounts = list(accounts)
    done = sum(a.done for a in accounts)
    back = sum(a.rolled_back for a in accounts)
    flight = sum(a.in_flight for a in accounts)
    waiting = sum(a.not_started for a in accounts)
    command = "cachedoctor fix " + " ".join(shlex.quote(display_path(t)) for t in targets)
    out.write(f"Interrupted: run {run_id} stopped after {done} action{'s' * (done != 1)} done"
              f"; {back} rolled back; {waiting} not started"
              + (f"; {flight} half-done (the next fix or undo rolls {'it' if flight == 1 else 'them'} back)"
                 if flight else "") + ".\n"
              f"Finish it: `{command}` (it plans what is left); undo it: `cachedoctor undo {run_id}`.\n")


def _states(counts: collections.Counter) -> str:
    """' (361 done, 1 rolled back, 2638 not started)'; nothing when every one is done."""
    if set(counts) == {"done"}:
        return ""
    return f" ({', '.join(f'{n} {w}' for w, n in counts.items())})"


def _files(n: int) -> str:
    return f"{n} file{'s' * (n != 1)}"


def _some(items, verbose: bool):
    return items if verbose else items[:LISTED]


def _grouped(items, key):
    groups: dict = collections.defaultdict(list)
    for item in items:
        groups[key(item)].append(item)
    return groups.items()
