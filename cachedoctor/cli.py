"""The `cachedoctor` command line. Heavy modules (rich, torch, the fixtures) load lazily."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from cachedoctor import __version__

if TYPE_CHECKING:
    from cachedoctor.rule import Rule

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    help="Find and repair broken training caches of diffusion trainers before they burn GPU hours.",
)

EXIT_FINDINGS, EXIT_USAGE = 1, 2
PROGRESS_MIN_FILES = 300


def fail(message: str) -> typer.Exit:
    """Print a one-line error and return the exit for usage/environment errors."""
    typer.echo(f"cachedoctor: error: {message}", err=True)
    return typer.Exit(EXIT_USAGE)


def _codes(values: list[str] | None) -> tuple[str, ...]:
    """`--select CD1,CD201 --select CD5` -> ("CD1", "CD201", "CD5")."""
    return tuple(c.strip().upper() for v in values or () for c in v.split(",") if c.strip())


def _version(value: bool) -> None:
    if value:
        typer.echo(f"cachedoctor {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Show the version and exit.")] = False,
) -> None:
    pass


@app.command()
def scan(
    targets: Annotated[list[str], typer.Argument(help="Cache dirs, cache files, trainer configs or project folders.")],
    fmt: Annotated[str, typer.Option("--format", help="text | json")] = "text",
    fail_on: Annotated[str, typer.Option(help="Exit 1 on findings at or above: error|warning|info|never.")] = "error",
    deep: Annotated[bool, typer.Option(help="Read whole tensors: CRC32 of every entry, NaN/Inf.")] = False,
    jobs: Annotated[int | None, typer.Option("-j", "--jobs", help="Worker processes (default: one per core).")] = None,
    select: Annotated[list[str] | None, typer.Option(help="Only these codes or prefixes (CD1, CD201).")] = None,
    ignore: Annotated[list[str] | None, typer.Option(help="Skip these codes or prefixes.")] = None,
    exclude: Annotated[list[str] | None, typer.Option(help="Skip paths matching this glob.")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="One row per finding, no collapsing.")] = False,
) -> None:
    """Check caches and trainer configs; exit 1 when findings reach --fail-on."""
    from cachedoctor.reporters import REPORTERS

    if fmt not in REPORTERS:
        raise fail(f"unknown --format {fmt!r}: expected one of {', '.join(REPORTERS)}")
    if fail_on not in ("error", "warning", "info", "never"):
        raise fail(f"unknown --fail-on {fail_on!r}: expected error, warning, info or never")
    if jobs is not None and jobs < 1:
        raise fail("--jobs must be at least 1")
    from cachedoctor.engine import scan as run_scan
    from cachedoctor.layouts import TargetError
    from cachedoctor.options import ScanOptions

    options = ScanOptions(deep=deep, select=_codes(select), ignore=_codes(ignore),
                          exclude=tuple(exclude or ()))
    if jobs is not None:
        options = ScanOptions(**{**options.__dict__, "jobs": jobs})
    progress = _Progress() if fmt == "text" and sys.stderr.isatty() else None
    try:
        report = run_scan(
            targets,
            options,
            on_start=progress.start if progress else None,
            on_progress=progress.advance if progress else None,
        )
    except TargetError as exc:
        raise fail(str(exc)) from None
    finally:
        if progress:
            progress.stop()
    REPORTERS[fmt].render(report, sys.stdout, verbose=verbose, color=sys.stdout.isatty())
    raise typer.Exit(report.exit_code(fail_on))


class _Progress:
    """A rich progress bar on stderr, shown only for scans of more than a few hundred files."""

    def __init__(self) -> None:
        self._bar = None
        self._task = None

    def start(self, total: int | None) -> None:
        if not total or total < PROGRESS_MIN_FILES:
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        self._bar = Progress("Scanning", BarColumn(), MofNCompleteColumn(), "files",
                             TimeElapsedColumn(), console=Console(stderr=True), transient=True)
        self._task = self._bar.add_task("scan", total=total)
        self._bar.start()

    def advance(self, n: int) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, n)

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()


@app.command()
def rules(
    markdown: Annotated[bool, typer.Option("--markdown", help="A Markdown table (the README's).")] = False,
) -> None:
    """List every rule: code, name, default severity, fix."""
    from cachedoctor.checks import RULES

    if markdown:
        typer.echo(rules_table(RULES.values()))
        return
    for rule in RULES.values():
        deep = " (--deep)" if rule.deep else ""
        typer.echo(f"{rule.code}  {rule.name:<32} {rule.severity!s:<8} {rule.fix or '-':<11} "
                   f"{rule.summary}{deep}")


def rules_table(rules: Iterable[Rule]) -> str:
    lines = ["| code | name | severity | fires when | fix |", "|---|---|---|---|---|"]
    for rule in rules:
        when = rule.summary + (" (`--deep`)" if rule.deep and "--deep" not in rule.summary else "")
        lines.append(f"| {rule.code} | {rule.name} | {rule.severity} | {when} | {rule.fix or 'manual'} |")
    return "\n".join(lines)


@app.command()
def explain(code: Annotated[str, typer.Argument(help="A rule code (CD201) or name.")]) -> None:
    """Why a rule matters, an example, and how to fix it."""
    from cachedoctor.checks import RULES, get

    rule = get(code)
    if rule is None:
        raise fail(f"no rule {code!r}; `cachedoctor rules` lists them ({', '.join(RULES)})")
    header = f"{rule.code} {rule.name} ({rule.severity}; fix: {rule.fix or 'none, manual'})"
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.markdown import Markdown

        Console().print(Markdown(f"# {header}\n\n{rule.doc}"))
    else:
        typer.echo(f"{header}\n\n{rule.doc.strip()}")


DEMO_MARKER = Path(".cachedoctor") / "demo"


@app.command()
def demo(directory: Annotated[Path, typer.Argument(help="Where to write the demo.")]) -> None:
    """Write a small cache and a SimpleTuner project holding one of every defect, to try
    `cachedoctor scan` on."""
    if directory.exists() and any(directory.iterdir()):
        if not (directory / DEMO_MARKER).exists():
            raise fail(f"{directory} is not empty; give a new directory for the demo")
        import shutil

        shutil.rmtree(directory)  # a demo we wrote before: safe to write afresh
    from cachedoctor.fixtures.demo import write_demo, write_demo_project

    cache, project = directory / "cache", directory / "simpletuner"
    written = write_demo(cache)
    written_project = write_demo_project(project)
    (directory / DEMO_MARKER).parent.mkdir(exist_ok=True)
    (directory / DEMO_MARKER).write_text("written by `cachedoctor demo`; safe to delete\n")
    count = sum(len(paths) for paths in written.values())
    typer.echo(f"Wrote a demo cache with {count} broken files ({', '.join(sorted(written))}) to "
               f"{cache}\nand a SimpleTuner project with the dataset and config defects "
               f"({', '.join(sorted(written_project))}) to {project}.\n"
               f"Try: cachedoctor scan {cache} {project}")


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        typer.echo("cachedoctor: interrupted", err=True)
        sys.exit(130)
    except Exception as exc:  # never a traceback for the user; CACHEDOCTOR_DEBUG=1 shows it
        if os.environ.get("CACHEDOCTOR_DEBUG"):
            raise
        typer.echo(f"cachedoctor: internal error: {type(exc).__name__}: {exc} "
                   "(set CACHEDOCTOR_DEBUG=1 for the traceback)", err=True)
        sys.exit(EXIT_USAGE)
