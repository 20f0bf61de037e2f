"""What the command line shows around its commands: usage lines as the README writes them
(`cachedoctor scan [OPTIONS] TARGET...`, where typer writes `{targets}...`), a usage error as one
line on stderr (typer prints three: the usage, a hint, the error), and the exit codes. A leaf
module: every command group (cli.py, harness/cli.py) imports `fail` from here, never from the
entry module that mounts them."""

from __future__ import annotations

from typing import Any

import typer
from typer.core import TyperArgument, TyperCommand

from cachedoctor.findings import printable

EXIT_FINDINGS, EXIT_USAGE = 1, 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a Ctrl-C


def fail(message: str) -> typer.Exit:
    """Print a one-line error and return the exit for usage/environment errors."""
    say(f"cachedoctor: error: {message}", err=True)
    return typer.Exit(EXIT_USAGE)


def say(line: str, err: bool = False) -> None:
    """Print one line that holds text from a cache (a file name, a journal's run id or path):
    its control characters shown as escapes, so it stays one line of inert text."""
    typer.echo(printable(line), err=err)


class Command(TyperCommand):
    """A command whose usage line names its arguments by their metavars, as given."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if isinstance(param, TyperArgument):
                name = param.metavar or (param.name or "").upper()
                if param.nargs != 1 and not name.endswith("..."):
                    name += "..."
                pieces.append(name if param.required else f"[{name}]")
        return pieces


def _click_class(name: str) -> type[Exception]:
    """click's exception class `name`: typer vendors click from 0.22 on, and re-exports only
    BadParameter, so the class is found through its bases (the same on every version)."""
    return next(c for c in typer.BadParameter.__mro__ if c.__name__ == name)


def run(app: typer.Typer) -> int:
    """Run `app` on sys.argv and return its exit code; a usage error is one line on stderr."""
    usage_error, click_exception = _click_class("UsageError"), _click_class("ClickException")
    try:
        code = app(standalone_mode=False)
    except usage_error as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # a bare `cachedoctor`: its help, as click shows it
            exc.show()
            return exc.exit_code
        ctx = getattr(exc, "ctx", None)
        hint = f"; see `{ctx.command_path} --help`" if ctx is not None else ""
        say(f"cachedoctor: error: {exc.format_message().rstrip('.')}{hint}", err=True)
        return EXIT_USAGE
    except click_exception as exc:
        say(f"cachedoctor: error: {exc.format_message()}", err=True)
        return exc.exit_code
    except typer.Abort:
        typer.echo("cachedoctor: aborted", err=True)
        return 1
    return code if isinstance(code, int) else 0


def confirm(question: str) -> bool:
    """`question [y/N]:` on the terminal; True for y/yes. Ctrl-C or end of input raise
    typer.Abort. The answer is awaited in short selects, not one blocking read: a SIGINT that
    the kernel hands to another thread of the process (an import's helper thread) does not
    interrupt the main thread's read, and Python runs its handler only between reads."""
    import select
    import sys

    import typer

    typer.echo(f"{question} [y/N]: ", nl=False)
    try:
        try:
            ready = sys.stdin.fileno() >= 0
        except (OSError, ValueError, AttributeError):  # a test runner's stdin: read it plainly
            ready = False
        while ready and not select.select([sys.stdin], [], [], 0.2)[0]:
            pass
        line = sys.stdin.readline()
    except KeyboardInterrupt:
        raise typer.Abort() from None
    if not line:
        raise typer.Abort()
    return line.strip().lower() in ("y", "yes")
