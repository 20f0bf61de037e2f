"""`cachedoctor harness list|reproduce|verify`. Nothing heavy at import: the runner, and torch
in the rank processes, load when a command runs."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from cachedoctor.cli_usage import Command, fail
from cachedoctor.harness.scenarios import SCENARIOS, load_scenario

if TYPE_CHECKING:
    from cachedoctor.harness.result import Result

harness_app = typer.Typer(no_args_is_help=True, add_completion=False, rich_markup_mode=None,
                          pretty_exceptions_enable=False)

Scenario = Annotated[str, typer.Argument(metavar="SCENARIO|all", help=f"A scenario ({', '.join(SCENARIOS)}) or 'all'.")]
Ranks = Annotated[int, typer.Option(metavar="N", help="Rank processes in the torch.distributed group.")]
Device = Annotated[str, typer.Option(metavar="cpu|cuda", help=(
    "cpu (gloo) or cuda (nccl when each rank has a GPU of its own, else gloo)."))]
Workdir = Annotated[Path | None, typer.Option(
    metavar="DIR", help="Where runs write their projects (default: a temp dir).")]
Keep = Annotated[bool, typer.Option(help="Keep the default temp dir (a given --workdir is always kept).")]
Format = Annotated[str, typer.Option("--format", metavar="FORMAT", help="text | json")]
FAILURE_WIDTH = 160


@harness_app.command("list", cls=Command)
def list_scenarios() -> None:
    """The scenarios: one per incident of docs/incidents.md."""
    for name in SCENARIOS:
        scenario = load_scenario(name)
        typer.echo(f"{name:<18} {scenario.SUMMARY} [{scenario.INCIDENT}]")


@harness_app.command(cls=Command)
def reproduce(scenario: Scenario, ranks: Ranks = 2, device: Device = "cpu", workdir: Workdir = None,
              keep: Keep = False, fmt: Format = "text") -> None:
    """Run the buggy pipeline: the failure must happen and `scan` must name it."""
    run("reproduce", scenario, ranks, device, workdir, keep, fmt)


@harness_app.command(cls=Command)
def verify(scenario: Scenario, ranks: Ranks = 2, device: Device = "cpu", workdir: Workdir = None,
           keep: Keep = False, fmt: Format = "text") -> None:
    """Run the fixed pipeline under the same load: no failure, scan clean, training finishes."""
    run("verify", scenario, ranks, device, workdir, keep, fmt)


def run(mode: str, scenario: str, ranks: int, device: str, workdir: Path | None, keep: bool, fmt: str) -> None:

    names = list(SCENARIOS) if scenario == "all" else [scenario]
    if scenario != "all" and scenario not in SCENARIOS:
        raise fail(f"no scenario {scenario!r}; `cachedoctor harness list` shows them ({', '.join(SCENARIOS)})")
    if ranks < 1:
        raise fail("--ranks must be at least 1")
    if fmt not in ("text", "json"):
        raise fail(f"unknown --format {fmt!r}: expected text or json")
    if device not in ("cpu", "cuda"):
        raise fail(f"unknown --device {device!r}: expected cpu or cuda")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise fail(f"--device cuda: no CUDA device is available (torch {torch.__version__}); "
                       "run on a GPU host or use --device cpu")
    from cachedoctor.harness.runner import WorkdirError, run_scenario

    temporary = workdir is None
    root = Path(tempfile.mkdtemp(prefix="cachedoctor-harness-")) if temporary else workdir.absolute()
    root.mkdir(parents=True, exist_ok=True)
    kept = keep or not temporary
    results = []
    try:
        for name in names:
            result = run_scenario(name, mode, ranks=ranks, device=device, workdir=root, keep=kept)
            results.append(result)
            if fmt == "text":
                typer.echo(render_text(result))
    except WorkdirError as exc:
        raise fail(str(exc)) from None
    finally:
        if not kept:
            shutil.rmtree(root, ignore_errors=True)
    ok = all(r.ok for r in results)
    if fmt == "json":
        json.dump({"command": mode, "ok": ok, "results": [r.to_dict() for r in results]}, sys.stdout, indent=2)
        typer.echo()
    else:
        typer.echo(f"{sum(r.ok for r in results)} of {len(results)} scenarios did what `{mode}` promises"
                   + (f"; files in {root}" if kept else ""))
    raise typer.Exit(0 if ok else 1)


def render_text(result: Result) -> str:
    attempts = f", {result.attempts} attempts" if result.attempts > 1 else ""
    lines = [f"{result.scenario}  {result.mode}  {result.device} x{result.ranks}  "
             f"{'OK' if result.ok else 'FAILED'}  {result.seconds:.1f} s{attempts}"]
    expected = ", ".join(result.expected_codes)
    codes = ", ".join(result.codes) or "none"
    if result.mode == "reproduce":
        if result.reproduced:
            lines.append(f"  failure  {_clip(result.failure)}")
        else:
            lines.append("  failure  NOT reproduced" + (f"; saw {_clip(result.failure)}" if result.failure else ""))
        lines.append(f"  scan     {codes} (expected {expected}: {'detected' if result.detected else 'NOT detected'})")
    else:
        lines.append(f"  fixed    {'yes' if result.fixed else 'NO'}"
                     + (f" ({_clip(result.failure)})" if result.failure else ""))
        lines += [_repair_line(step) for step in result.details.get("repairs", ())]
        clean = not set(result.expected_codes) & set(result.codes)
        lines.append(f"  scan     {codes} ({'clean of' if clean else 'STILL REPORTS'} {expected})")
    loss = f", loss {result.loss:.4f}" if result.loss is not None else ""
    lines.append(f"  trained  {'yes' if result.trained else 'no'}{loss}")
    return "\n".join(lines)


def _repair_line(step: dict) -> str:
    """One repair of a verify run: what it did, whether the tensors came out bit-identical,
    what a scan then said (the fix) and the training loss on the repaired cache."""
    did = ", ".join(f"{kind} {n}" for kind, n in step.get("actions", {}).items())
    parts = ["tensors bit-identical" if step.get("tensors_identical") else "TENSORS DIFFER"]
    if "ratio" in step:
        parts.append(f"x{step['ratio']:.1f} storage per latent")
    if "disk_ratio" in step:
        parts.append(f"x{step['disk_ratio']:.2f} bytes on disk per latent byte")
    if "codes_after" in step:
        parts.append(f"scan {', '.join(step['codes_after']) or 'clean'}")
    if step.get("failed"):
        parts.append(f"{len(step['failed'])} FAILED")
    losses = step.get("losses") or []
    if losses:
        parts.append(f"loss {losses[0]:.4f}")
    return f"  repair   {step.get('how')}{f' ({did})' if did else ''}: {', '.join(parts)}"


def _clip(text: str | None) -> str:
    line = (text or "").splitlines()[0] if text else ""
    return line if len(line) <= FAILURE_WIDTH else line[: FAILURE_WIDTH - 1] + "…"
