"""The `cachedoctor` command line. Heavy modules (rich, torch, the fixtures) load lazily."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from cachedoctor import __version__
from cachedoctor.cli_usage import EXIT_FINDINGS, EXIT_INTERRUPTED, EXIT_USAGE, Command, confirm, fail, say
from cachedoctor.cli_usage import run as run_app
from cachedoctor.findings import DEFAULT_FAIL_ON, FailOn
from cachedoctor.harness.cli import harness_app
from cachedoctor.reporters import FORMATS

if TYPE_CHECKING:
    from cachedoctor.layouts import Layout
    from cachedoctor.options import ScanOptions
    from cachedoctor.repair.plan import Reencode
    from cachedoctor.repair.session import Guard
    from cachedoctor.rule import Rule

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    help="Find and repair broken training caches of diffusion trainers before they burn GPU hours.",
)

PROGRESS_MIN_FILES = 300
Format = StrEnum("Format", {name.upper(): name for name in FORMATS})  # --format's choices


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


@app.command(cls=Command)
def scan(
    targets: Annotated[list[str], typer.Argument(
        metavar="TARGET...", help="Cache dirs, cache files, trainer configs or project folders.")],
    fmt: Annotated[Format, typer.Option(
        "--format", metavar="FORMAT", help=" | ".join(FORMATS))] = Format.TEXT,
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", metavar="FILE", help="Write the report to this file; the terminal gets the summary.")] = None,
    fail_on: Annotated[FailOn | None, typer.Option(
        metavar="LEVEL",
        help=f"Exit 1 on findings at or above: {'|'.join(FailOn)} (default: {DEFAULT_FAIL_ON}).")] = None,
    deep: Annotated[bool | None, typer.Option(
        "--deep/--no-deep", help="Read whole tensors: CRC32 of every entry, NaN/Inf.")] = None,
    jobs: Annotated[int | None, typer.Option(
        "-j", "--jobs", metavar="N", help="Worker processes (default: one per core).")] = None,
    select: Annotated[list[str] | None, typer.Option(
        metavar="RULES", help="Only these rule codes, prefixes or names (CD1, CD201, retained-batch-storage).")] = None,
    extend_select: Annotated[list[str] | None, typer.Option(
        metavar="RULES", help="Rule codes, prefixes or names to add to the selection.")] = None,
    ignore: Annotated[list[str] | None, typer.Option(
        metavar="RULES", help="Skip these rule codes, prefixes or names.")] = None,
    exclude: Annotated[list[str] | None, typer.Option(metavar="GLOB", help="Skip paths matching this glob.")] = None,
    baseline: Annotated[Path | None, typer.Option(
        metavar="FILE", help="Report only findings this baseline file does not record.")] = None,
    write_baseline: Annotated[Path | None, typer.Option(
        metavar="FILE", help="Record every finding in this baseline file; exit 0.")] = None,
    config: Annotated[list[str] | None, typer.Option(
        "--config", metavar="FILE|'KEY = VALUE'",
        help="A config file, or a TOML 'KEY = VALUE' override (repeatable).")] = None,
    isolated: Annotated[bool, typer.Option(help="Ignore every config file.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="One row per finding, no collapsing.")] = False,
    index: Annotated[bool, typer.Option(
        "--index/--no-index", help="Reuse the verdicts of unchanged files from the cache's index.")] = True,
    rebuild_index: Annotated[bool, typer.Option("--rebuild-index", help="Start the index afresh.")] = False,
    changed_since: Annotated[str | None, typer.Option(
        metavar="RUN|TIME", help="File findings only for files changed since a scan or fix run id, "
                                 "an ISO time or epoch seconds; dataset rules still see every file.")] = None,
    endpoint_url: Annotated[str | None, typer.Option(
        metavar="URL", help="S3-compatible endpoint for s3:// targets and aws backends.")] = None,
) -> None:
    """Check caches and trainer configs; exit 1 when findings reach --fail-on."""
    from cachedoctor.reporters import reporter

    if endpoint_url:
        from cachedoctor.remote.client import set_endpoint_url

        set_endpoint_url(endpoint_url)

    _check_jobs(jobs)
    from cachedoctor import baseline as baselines
    from cachedoctor import config as configuration
    from cachedoctor.api import resolve_policy, scan_policy
    from cachedoctor.layouts import TargetError

    try:
        config_file, overrides = _config_args(config or [])
        policy = resolve_policy(
            select=select, extend_select=extend_select, ignore=ignore, exclude=exclude, deep=deep,
            fail_on=fail_on, baseline=baseline, jobs=jobs, config=config_file, isolated=isolated,
            overrides=overrides, source="command line", index=index, rebuild_index=rebuild_index,
            changed_since=changed_since)
    except configuration.ConfigError as exc:
        raise fail(str(exc)) from None
    chosen = reporter(fmt)
    progress = _Progress() if (fmt == "text" or output) and sys.stderr.isatty() else None
    try:
        # the API's path: the policy's baseline is loaded before the scan and applied after it
        report, result = scan_policy(
            targets,
            policy,
            use_baseline=write_baseline is None,
            keep_paths=getattr(chosen, "NEEDS_PATHS", False),
            on_start=progress.start if progress else None,
            on_progress=progress.advance if progress else None,
        )
    except (TargetError, baselines.BaselineError, configuration.ConfigError) as exc:
        raise fail(str(exc)) from None
    finally:
        if progress:
            progress.stop()
    _index_lines(report.index)
    _policy_lines(policy.applied, detail=fmt == "text")
    if write_baseline is not None:
        try:
            count = baselines.write(report, str(write_baseline))
        except OSError as exc:
            raise fail(f"cannot write baseline {write_baseline}: {exc.strerror or exc}") from None
        say(f"cachedoctor: recorded {count:,} findings in {write_baseline}", err=True)
    elif policy.baseline:
        if result.known or result.fixed:
            say(f"cachedoctor: baseline {policy.baseline}: {result.known:,} known findings "
                f"not shown, {result.fixed:,} of its entries no longer found", err=True)
        if baseline is None:  # named by a config file, which may have come with the cache
            _hidden_guards(report, result.report, policy.baseline)
        report = result.report
    _emit(report, chosen, output, verbose)
    raise typer.Exit(0 if write_baseline is not None else report.exit_code(policy.fail_on))


def _index_lines(used) -> None:
    """On stderr: the index's notices, and what it saved once it saved something (or what
    --changed-since judged)."""
    for notice in used.get("notices", ()):
        say(f"cachedoctor: {notice}", err=True)
    if used.get("reused") or "judged" in used:
        line = f"cachedoctor: index: {used['read']:,} files read, {used['reused']:,} reused"
        if "judged" in used:
            line += f"; file rules judged the {used['judged']:,} changed since --changed-since"
        if "scan" in used:
            line += f" (scan {used['scan']})"
        say(line, err=True)


def _hidden_guards(before, after, path: str) -> None:
    """Warn when a baseline a config named hides a guard rule's findings: a baseline that came
    with a cache silences its hostile pickle as surely as switching CD105 off."""
    from collections import Counter

    from cachedoctor.applied import GUARDS

    hidden = Counter(f.code for f in before.findings) - Counter(f.code for f in after.findings)
    for code, (name, consequence) in GUARDS.items():
        if hidden[code]:
            say(f"cachedoctor: warning: {code} ({name}): {hidden[code]:,} finding(s) hidden "
                f"by the baseline {path}, named in a config file: {consequence}", err=True)


def _policy_lines(applied, detail: bool) -> None:
    """On stderr: a warning per guard rule (CD105, CD002) a config switched off; with `detail`,
    which configs applied and what is switched off (JSON and SARIF carry that in the report)."""
    if detail and applied.configs:
        say(f"cachedoctor: {applied.summary()}", err=True)
    for warning in applied.warnings:
        say(f"cachedoctor: warning: {warning}", err=True)


def _config_args(values: list[str]) -> tuple[str | None, list]:
    """`--config` values: at most one file (a path that exists), the rest TOML overrides."""
    from cachedoctor import config as configuration

    files = [v for v in values if os.path.isfile(v)]
    if len(files) > 1:
        raise configuration.ConfigError(f"--config: one config file at most, got {', '.join(files)}")
    overrides = [configuration.override(v) for v in values if v not in files]
    return (files[0] if files else None), overrides


def _emit(report, reporter, output: Path | None, verbose: bool) -> None:
    """The report to stdout, or to `output` with a short summary on the terminal."""
    if output is None:
        reporter.render(report, sys.stdout, verbose=verbose, color=sys.stdout.isatty())
        return
    from cachedoctor.reporters.text import brief

    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        with open(output, "w", encoding="utf-8") as out:
            reporter.render(report, out, verbose=verbose, color=False)
    except OSError as exc:
        raise fail(f"cannot write {output}: {exc.strerror or exc}") from None
    typer.echo(f"{brief(report)}\nReport written to {output}")


def _check_jobs(jobs: int | None) -> None:
    if jobs is not None and jobs < 1:
        raise fail("--jobs must be at least 1")


def _fix_options(deep: bool, select: list[str] | None, ignore: list[str] | None,
                 exclude: list[str] | None, jobs: int | None,
                 include_info: bool | None = None, index: bool = True,
                 rebuild_index: bool = False) -> tuple[ScanOptions, bool]:
    """fix's ScanOptions and whether it acts on info findings: the same config files and
    layering as scan's, with fix's flags on top."""
    from cachedoctor import config as configuration
    from cachedoctor.api import resolve_policy

    _check_jobs(jobs)
    try:
        policy = resolve_policy(select=select, ignore=ignore, exclude=exclude, deep=deep or None,
                                jobs=jobs, source="command line", include_info=include_info,
                                index=index, rebuild_index=rebuild_index)
    except configuration.ConfigError as exc:
        raise fail(str(exc)) from None
    _policy_lines(policy.applied, detail=True)
    return policy.options, policy.include_info


class _Progress:
    """A rich progress bar on stderr, shown once the scan has listed a few hundred files. Its
    total is what the scan's one walk has listed so far: it grows until the walk is done."""

    def __init__(self, label: str = "Scanning") -> None:
        self._label = label
        self._bar = None
        self._task = None
        self._done = 0  # files checked before the bar showed

    def start(self, total: int | None) -> None:
        if self._bar is not None:
            self._bar.update(self._task, total=total)
            return
        if not total or total < PROGRESS_MIN_FILES:
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        self._bar = Progress(self._label, BarColumn(), MofNCompleteColumn(), "files",
                             TimeElapsedColumn(), console=Console(stderr=True), transient=True)
        self._task = self._bar.add_task("scan", total=total, completed=self._done)
        self._bar.start()

    def advance(self, n: int) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, n)
        else:
            self._done += n

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()


@app.command(cls=Command)
def rules(
    markdown: Annotated[bool, typer.Option("--markdown", help="A Markdown table (the README's).")] = False,
) -> None:
    """List every rule: code, name, default severity, fix."""
    from cachedoctor.checks import RULES

    if markdown:
        typer.echo(rules_table(RULES.values()))
        return
    row = "{:<6} {:<32} {:<8} {:<11} {}"
    typer.echo(row.format("code", "name", "severity", "fix", "fires when"))
    for rule in RULES.values():
        typer.echo(row.format(rule.code, rule.name, str(rule.severity), rule.fix or "manual",
                              fires_when(rule, "--deep")))


def fires_when(rule: Rule, deep: str) -> str:
    """The rule's summary, marked `deep` when it runs only under --deep (once: a summary may
    already say so)."""
    return rule.summary if not rule.deep or "--deep" in rule.summary else f"{rule.summary} ({deep})"


def rules_table(rules: Iterable[Rule]) -> str:
    lines = ["| code | name | severity | fires when | fix |", "|---|---|---|---|---|"]
    for rule in rules:
        lines.append(f"| {rule.code} | {rule.name} | {rule.severity} | {fires_when(rule, '`--deep`')} "
                     f"| {rule.fix or 'manual'} |")
    return "\n".join(lines)


@app.command(cls=Command)
def explain(code: Annotated[str, typer.Argument(metavar="RULE", help="A rule code (CD201) or name.")]) -> None:
    """Why a rule matters, an example, and how to fix it."""
    from cachedoctor.checks import RULES, get

    rule = get(code)
    if rule is None:
        raise fail(f"no rule {code!r}; `cachedoctor rules` lists them ({', '.join(RULES)})")
    from cachedoctor.rule_docs import heading, page

    if sys.stdout.isatty():
        from rich.console import Console
        from rich.markdown import Markdown

        Console().print(Markdown(page(rule)))
    else:
        typer.echo(f"{heading(rule)}\n\n{rule.doc.strip()}")


@app.command(cls=Command)
def fix(
    targets: Annotated[list[str] | None, typer.Argument(
        metavar="TARGET...",
        help="What to repair, as for scan: cache dirs, cache files, trainer configs or project folders "
             "(--reencode needs to know the images: a config, a project, or a bare folder whose "
             "layout names them, such as an ai-toolkit image folder).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show the plan; change nothing.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Apply without asking (needed in a pipe).")] = False,
    select: Annotated[list[str] | None, typer.Option(
        metavar="RULES", help="Only findings of these rule codes, prefixes or names.")] = None,
    ignore: Annotated[list[str] | None, typer.Option(
        metavar="RULES", help="Not findings of these rule codes, prefixes or names.")] = None,
    exclude: Annotated[list[str] | None, typer.Option(metavar="GLOB", help="Skip paths matching this glob.")] = None,
    deep: Annotated[bool, typer.Option(help="Scan whole tensors too (finds CD103, CD106).")] = False,
    reencode: Annotated[bool, typer.Option(help="Encode quarantined and missing entries again.")] = False,
    encoder: Annotated[str | None, typer.Option(
        metavar="SPEC", help="For --reencode: diffusers:PATH | module:callable | reference (tests only).")] = None,
    wait: Annotated[float, typer.Option(metavar="SECONDS", help="Wait this many seconds for another fix or undo "
                                             "on the same cache (default: fail at once).")] = 0.0,
    include_info: Annotated[bool | None, typer.Option(
        "--include-info/--no-include-info", show_default=False,
        help="Act on info findings too (CD405 orphans); default: warning and above, or the config's "
             "include-info.")] = None,
    list_runs: Annotated[bool, typer.Option("--list-runs", help="List the runs (of TARGETs' caches, "
                                            "or of every cache you fixed) and exit.")] = False,
    jobs: Annotated[int | None, typer.Option("-j", "--jobs", metavar="N", help="Scan worker processes.")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="List every file of the plan.")] = False,
    index: Annotated[bool, typer.Option(
        "--index/--no-index", help="Reuse the scan's verdicts of unchanged files from the cache's index.")] = True,
    rebuild_index: Annotated[bool, typer.Option("--rebuild-index", help="Start the index afresh.")] = False,
    endpoint_url: Annotated[str | None, typer.Option(
        metavar="URL", help="S3-compatible endpoint for s3:// targets and aws backends.")] = None,
) -> None:
    """Scan, show the repair plan, then apply it: journaled, undoable, nothing deleted.

    Acts on findings at warning or above (--include-info, or include-info = true in the
    config, adds info ones). Exit 0 when every
    action was applied (or there was nothing to do), 1 when some action failed and was rolled
    back, 2 on a usage or environment error, 130 when cancelled or interrupted (Ctrl-C, SIGTERM).
    """
    from cachedoctor.layouts import TargetError, resolve
    from cachedoctor.repair.caches import cache_roots
    from cachedoctor.repair.plan import Reencode

    if endpoint_url:
        from cachedoctor.remote.client import set_endpoint_url

        set_endpoint_url(endpoint_url)
    try:
        layouts = resolve(targets) if targets else []
        roots = cache_roots(layouts) if targets else None
    except (TargetError, ValueError) as exc:
        raise fail(str(exc)) from None
    if list_runs:
        from cachedoctor.repair.history import listing
        from cachedoctor.repair.index import known_roots
        from cachedoctor.repair.render import render_runs

        unreadable: list[str] = []
        render_runs(listing(roots if roots is not None else known_roots(only_readable=False),
                            unreadable), sys.stdout)
        for problem in unreadable:
            say(f"cachedoctor: error: {problem}", err=True)
        if unreadable:
            raise typer.Exit(EXIT_USAGE)
        return
    if roots is None:
        raise fail("fix needs a TARGET (a cache dir or file, a trainer config or project folder), "
                   "or --list-runs")
    options, include_info = _fix_options(deep, select, ignore, exclude, jobs, include_info, index,
                                         rebuild_index)
    if encoder is not None and not reencode:
        raise fail("--encoder is for --reencode")
    chosen = None
    if reencode:
        from cachedoctor.repair.encoders import EncoderError
        from cachedoctor.repair.encoders import resolve as resolve_encoder

        if encoder is None:
            raise fail("--reencode needs --encoder: diffusers:PATH (a local diffusers VAE), "
                       "module:callable (your encoder), or reference (the test harness's stand-in: "
                       "never on a real cache)")
        try:
            chosen = resolve_encoder(encoder)
        except EncoderError as exc:
            raise fail(str(exc)) from None
    if not dry_run and not yes and not sys.stdin.isatty():
        raise fail("not changing files without --yes when stdin is not a terminal "
                   "(--dry-run shows the plan)")
    from cachedoctor.repair.remote import remote_roots

    try:
        on_s3 = remote_roots(roots)
    except ValueError as exc:
        raise fail(str(exc)) from None
    if on_s3:  # S3 caches: quarantine by copy, verify, delete (repair/remote.py)
        if reencode:
            raise fail("--reencode is not available for s3:// caches in this version")
        raise typer.Exit(_fix_remote(targets, layouts, roots, options, dry_run, yes, verbose,
                                     include_info))
    reencoding = Reencode.of(chosen, layouts) if chosen is not None else None
    raise typer.Exit(_fix(targets, layouts, roots, options, reencoding, dry_run, yes, wait, verbose,
                          include_info))


CANCELLED = "cancelled: nothing changed"


def _fix_remote(targets: list[str], layouts: list[Layout], roots: tuple[str, ...],
                options: ScanOptions, dry_run: bool, yes: bool, verbose: bool,
                include_info: bool) -> int:
    """fix for s3:// caches: quarantine by copy, verify, delete (repair/remote.py)."""
    import dataclasses
    import shlex

    from cachedoctor.engine import scan as run_scan
    from cachedoctor.layouts import TargetError
    from cachedoctor.repair.journal import JournalError
    from cachedoctor.repair.remote import apply, build_remote_plan, render_plan, render_run

    try:
        report = run_scan(targets, dataclasses.replace(options, index=False), layouts=layouts)
        plan = build_remote_plan(report, roots, include_info=include_info)
    except TargetError as exc:
        raise fail(str(exc)) from None
    render_plan(plan, sys.stdout, verbose=verbose)
    if not plan.actions:
        typer.echo("Nothing to fix.")
        return 0
    if dry_run:
        typer.echo("Dry run: nothing changed.")
        return 0
    if not yes and not confirm("Apply this plan?"):
        typer.echo(CANCELLED)
        return EXIT_INTERRUPTED
    try:
        result = apply(plan, command=shlex.join(sys.argv),
                       warn=lambda line: say(f"cachedoctor: warning: {line}", err=True))
    except JournalError as exc:
        raise fail(str(exc)) from None
    render_run(result, sys.stdout)
    return EXIT_FINDINGS if result.count("failed") else 0


def _undo_remote(run_id: str | None, cache: list[str]) -> int:
    from cachedoctor.repair.journal import JournalError
    from cachedoctor.repair.remote import RemoteFixError, render_run, undo

    if len(cache) != 1:
        raise fail("undo takes one s3:// --cache at a time")
    try:
        result = undo(run_id, cache[0], warn=lambda line: say(f"cachedoctor: warning: {line}", err=True))
    except (RemoteFixError, JournalError) as exc:
        raise fail(str(exc)) from None
    render_run(result, sys.stdout, undoing=True)
    return EXIT_FINDINGS if result.count("conflict") else 0


def _fix(targets: list[str], layouts: list[Layout], roots: tuple[str, ...], options: ScanOptions,
         reencode: Reencode | None, dry_run: bool, yes: bool, wait: float, verbose: bool,
         include_info: bool = False) -> int:
    """Scan the `layouts` resolved once for `targets` (their cache `roots` are what is locked),
    then plan, show and apply."""
    import contextlib
    import dataclasses

    from cachedoctor.engine import scan as run_scan
    from cachedoctor.repair import build_plan
    from cachedoctor.repair.apply import RunStopped
    from cachedoctor.repair.journal import JournalError
    from cachedoctor.repair.lock import LockBusy
    from cachedoctor.repair.plan import datasets_of
    from cachedoctor.repair.render import render_plan, render_result
    from cachedoctor.repair.session import guarded

    try:
        with contextlib.ExitStack() as stack:
            guard = None
            if not dry_run:  # a dry run takes no lock and creates nothing
                guard = stack.enter_context(guarded(roots, wait, "fix"))
                for note in guard.notes:
                    say(note)
            else:
                _pending_notes(roots)
            # fix uses the index a scan made where the scan keeps it (a OneTrainer config's
            # scan: in image/, not in the cache_dir holding the repair state), and never makes
            # one: a fix with nothing to do leaves no folder behind; a dry run writes nothing
            options = dataclasses.replace(options, index=False) if dry_run else \
                dataclasses.replace(options, make_index=False)
            report = run_scan(targets, options, layouts=layouts)
            plan = build_plan(report, roots, reencode, include_info=include_info,
                              datasets=datasets_of(layouts))
            render_plan(plan, sys.stdout, verbose=verbose)
            if not plan.actions:
                typer.echo("Nothing to fix.")
                return 0
            if dry_run:
                typer.echo("Dry run: nothing changed.")
                return 0
            try:
                if not yes and not confirm("Apply this plan?"):
                    typer.echo("Nothing changed.")
                    return 0
            except typer.Abort:  # Ctrl-C or end of input at the prompt
                typer.echo("")
                typer.echo(CANCELLED, err=True)
                return EXIT_INTERRUPTED
            progress = _Progress("Repairing") if sys.stderr.isatty() else None
            begun: list[str] = []

            def started(run_id: str) -> None:
                begun.append(run_id)
                try:
                    typer.echo(f"Applying run {run_id} (if it is interrupted, the next fix or "
                               f"`cachedoctor undo {run_id}` finishes it)")
                except BrokenPipeError:  # nobody reads stdout any more: the repair goes on
                    _stdout_to_devnull()
                if progress:
                    progress.start(len(plan.actions))

            try:
                with _sigterm_interrupts():
                    result = plan.execute(guard=guard, on_start=started,
                                          on_outcome=(lambda _: progress.advance(1)) if progress else None)
            except KeyboardInterrupt:
                if progress:
                    progress.stop()
                return _interrupted(begun[0] if begun else None, guard, roots, targets)
            finally:
                if progress:
                    progress.stop()
            render_result(result, sys.stdout, verbose=verbose, plan=plan, targets=targets)
            for note in result.notes:
                say(note, err=True)
            return EXIT_FINDINGS if result.failed or result.skipped else 0
    except (LockBusy, JournalError) as exc:
        raise fail(str(exc)) from None
    except RunStopped as exc:
        say(f"cachedoctor: run stopped: {exc}", err=True)
        return EXIT_FINDINGS
    except BrokenPipeError:  # `fix --dry-run | head`: click ends it quietly (exit 1)
        raise
    except OSError as exc:
        raise fail(f"{exc.filename or ''}: {exc.strerror or exc}") from None


def _sigterm_interrupts():
    """A context in which SIGTERM interrupts like Ctrl-C, so that a killed fix reports too."""
    import contextlib
    import signal

    @contextlib.contextmanager
    def handled():
        def interrupt(_signum, _frame):
            raise KeyboardInterrupt

        try:
            previous = signal.signal(signal.SIGTERM, interrupt)
        except ValueError:  # not the main thread (fix called from a library): leave it
            yield
            return
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)

    return handled()


def _interrupted(run_id: str | None, guard: Guard, roots: tuple[str, ...], targets: list[str]) -> int:
    """After Ctrl-C or SIGTERM during apply: roll back the action under way (recovery under the
    locks still held, with further signals held off), then say what was done and how to finish
    or undo it."""
    import signal

    from cachedoctor.repair.history import accounts
    from cachedoctor.repair.render import render_interrupted

    held = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        guard.recover()  # also settles a run journaled but stopped before its first change
    except Exception as exc:  # the next fix or undo recovers it: say so, never a traceback
        say(f"cachedoctor: could not roll back the action under way ({exc}): the next "
            f"`cachedoctor fix` or `cachedoctor undo {run_id}` does", err=True)
    finally:
        for s, handler in held.items():
            signal.signal(s, handler)
    if run_id is None:  # stopped before the run's first change
        typer.echo(CANCELLED, err=True)
        return EXIT_INTERRUPTED
    try:
        render_interrupted(run_id, accounts(roots, run_id), targets, sys.stdout)
    except BrokenPipeError:
        _stdout_to_devnull()
    return EXIT_INTERRUPTED


def _pending_notes(roots: tuple[str, ...]) -> None:
    from cachedoctor.repair.journal import RUNNING, UNDOING
    from cachedoctor.repair.undo import list_runs

    for summary in list_runs(roots):
        if summary.run.state in (RUNNING, UNDOING):
            say(f"Run {summary.run.run_id} on {summary.root} is under way or was interrupted: "
                "the next fix or undo finishes it (a dry run leaves it).")


@app.command(cls=Command)
def undo(
    run_id: Annotated[str | None, typer.Argument(
        metavar="RUN_ID", help="The run to undo (default: the latest not undone).")] = None,
    cache: Annotated[list[str] | None, typer.Option(
        metavar="DIR", help="The cache dir(s) whose journal to use (default: every cache you ran fix on).")] = None,
    wait: Annotated[float, typer.Option(metavar="SECONDS", help="Wait this many seconds for a fix or undo running "
                                             "on the same cache.")] = 0.0,
    endpoint_url: Annotated[str | None, typer.Option(
        metavar="URL", help="S3-compatible endpoint for an s3:// --cache.")] = None,
) -> None:
    """Put back every file a fix run changed, byte for byte.

    Exit 0 when every file is back (or there was nothing to undo), 1 when some file had
    changed since the run and was left alone, 2 on a usage or environment error.
    """
    from cachedoctor.repair.journal import JournalError
    from cachedoctor.repair.lock import LockBusy
    from cachedoctor.repair.purge import undo_target, was_purged
    from cachedoctor.repair.undo import NothingToUndo, undo_run
    from cachedoctor.units import age

    if cache and any(c.startswith("s3://") for c in cache):  # an S3 cache (repair/remote.py)
        if endpoint_url:
            from cachedoctor.remote.client import set_endpoint_url

            set_endpoint_url(endpoint_url)
        raise typer.Exit(_undo_remote(run_id, cache))
    for directory in cache or ():
        if not os.path.isdir(directory):
            raise fail(f"--cache {directory}: not a directory")
    try:
        chosen = undo_target(run_id, cache)
        purged = was_purged(chosen, cache) if chosen else None
        if purged is not None:
            import time

            raise fail(f"run {chosen} cannot be undone: its quarantine was purged "
                       f"{age(time.time() - purged)} ago (`cachedoctor purge`)")
        results = undo_run(chosen, cache, wait)
    except NothingToUndo as exc:
        if run_id is not None:
            raise fail(str(exc)) from None
        say(f"{str(exc)[0].upper()}{str(exc)[1:]}.")
        return
    except (LockBusy, JournalError) as exc:
        raise fail(str(exc)) from None
    conflicts = 0
    for result in results:
        for note in result.recovered:
            say(note)
        say(f"Undid run {result.run_id} in {result.root}: {result.restored} file(s) put back.")
        for why in result.conflicts:
            say(f"  left alone: {why}")
        conflicts += len(result.conflicts)
    raise typer.Exit(EXIT_FINDINGS if conflicts else 0)


@app.command()
def purge(
    run_id: Annotated[str | None, typer.Argument(metavar="RUN", help="The run whose quarantine to delete.")] = None,
    older_than: Annotated[str | None, typer.Option(
        "--older-than", help="Every run started longer ago than this: 30d, 12h, 2w.")] = None,
    cache: Annotated[list[str] | None, typer.Option(
        help="The cache dir(s) whose runs to purge (default: every cache you ran fix on).")] = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Delete without asking (needed in a pipe).")] = False,
    wait: Annotated[float, typer.Option(help="Wait this many seconds for a fix or undo running "
                                             "on the same cache.")] = 0.0,
) -> None:
    """Delete runs' quarantines for good: the cache shrinks by what the plan said, and those
    runs can no longer be undone.

    Exit 0 when purged (or nothing to purge), 1 when some file could not be deleted, 2 on a
    usage or environment error, 130 when cancelled at the prompt.
    """
    from cachedoctor.repair.journal import JournalError
    from cachedoctor.repair.lock import LockBusy
    from cachedoctor.repair.purge import PurgeError, parse_duration, targets, was_purged
    from cachedoctor.units import human_bytes

    if (run_id is None) == (older_than is None):
        raise fail("purge needs a RUN or --older-than DURATION (one of them)")
    for directory in cache or ():
        if not os.path.isdir(directory):
            raise fail(f"--cache {directory}: not a directory")
    try:
        seconds = parse_duration(older_than) if older_than is not None else None
        chosen = targets(run_id, seconds, cache)
    except (PurgeError, JournalError) as exc:
        raise fail(str(exc)) from None
    if not chosen:
        if run_id is not None and was_purged(run_id, cache) is None:
            raise fail(f"no run {run_id}" + ("" if cache else " in the caches you ran fix on "
                                             "(give --cache DIR if the cache was moved)"))
        typer.echo("Nothing to purge.")
        return
    if not yes and not sys.stdin.isatty():
        raise fail("not deleting without --yes when stdin is not a terminal")
    for t in chosen:
        say(f"Run {t.run_id} in {t.root}: {t.files} file(s), {human_bytes(t.bytes)} in the quarantine")
    total = sum(t.bytes for t in chosen)
    if not yes:
        try:
            if not confirm(f"Delete {human_bytes(total)} for good? Those runs can no longer "
                           "be undone"):
                typer.echo("Nothing changed.")
                return
        except typer.Abort:
            typer.echo("")
            typer.echo(CANCELLED, err=True)
            raise typer.Exit(EXIT_INTERRUPTED) from None
    from cachedoctor.repair.purge import purge as purge_runs

    try:
        done = purge_runs(chosen, wait)
    except (LockBusy, JournalError) as exc:
        raise fail(str(exc)) from None
    except OSError as exc:
        raise fail(f"{exc.filename or ''}: {exc.strerror or exc}") from None
    for p in done:
        for note in p.notes:
            say(note)
        for why in p.failed:
            say(f"cachedoctor: {why}", err=True)
        say(f"Purged run {p.target.run_id} in {p.target.root}: {p.target.files} file(s), "
            f"{human_bytes(p.target.bytes)} freed" + (" (not all: see above)." if p.failed else "."))
    raise typer.Exit(EXIT_FINDINGS if any(p.failed for p in done) else 0)


DEMO_MARKER = Path(".cachedoctor") / "demo"


@app.command(cls=Command)
def demo(directory: Annotated[Path, typer.Argument(metavar="DIR", help="Where to write the demo.")]) -> None:
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


@app.command()
def verify(
    targets: Annotated[list[str], typer.Argument(help="Trainer configs or project folders.")],
    encoder: Annotated[str | None, typer.Option(
        help="The trainer's VAE: diffusers:PATH | module:callable | reference.")] = None,
    text_encoder: Annotated[str | None, typer.Option(
        help="The trainer's text encoder (caption embeddings): transformers:PATH | module:callable.")] = None,
    sample: Annotated[str, typer.Option(help="Entries per dataset: N, P% or all.")] = "64",
    device: Annotated[str, typer.Option(help="cpu | cuda (diffusers encoders).")] = "cpu",
    seed: Annotated[int, typer.Option(help="Seed of the sample: the same seed picks the same entries.")] = 0,
    batch_size: Annotated[int, typer.Option(help="Images per encoder call (one bucket at a time).")] = 8,
    fmt: Annotated[str, typer.Option("--format", help="text | json")] = "text",
    fail_on: Annotated[str, typer.Option(help="Exit 1 on findings at or above: error|warning|info|never.")] = "error",
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress on stderr.")] = False,
) -> None:
    """Re-encode a sample of cached latents from their images (and caption embeddings from their
    captions) and compare (reads only)."""
    from cachedoctor.verify.command import UsageError
    from cachedoctor.verify.command import verify as run_verify

    try:
        code = run_verify(targets, encoder, sample, device, seed, batch_size, fmt, fail_on, quiet,
                          text_encoder)
    except UsageError as exc:
        raise fail(str(exc)) from None
    raise typer.Exit(code)


app.add_typer(harness_app, name="harness", help="Reproduce the field incidents on real ranks and verify their fixes.")


def _stdout_to_devnull() -> None:
    """Point stdout at /dev/null, so that writing (and the interpreter's last flush) after the
    reader of a pipe went away fails no more."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def main() -> None:
    try:
        code = run_app(app)
    except KeyboardInterrupt:
        typer.echo("cachedoctor: interrupted", err=True)
        sys.exit(130)
    except Exception as exc:  # never a traceback for the user; CACHEDOCTOR_DEBUG=1 shows it
        if os.environ.get("CACHEDOCTOR_DEBUG"):
            raise
        say(f"cachedoctor: internal error: {type(exc).__name__}: {exc} "
            "(set CACHEDOCTOR_DEBUG=1 for the traceback)", err=True)
        sys.exit(EXIT_USAGE)
    sys.exit(code)
