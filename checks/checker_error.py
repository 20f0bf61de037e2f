"""## What it does
Reports a file (or a dataset, or a trainer config) that cachedoctor itself failed on: a reader
or a rule raised an exception, or the worker process checking the file died (killed by the
kernel's out-of-memory killer, a crash in a native library). Also a file whose read did not
finish within five minutes (a hung filesystem): its worker is stopped and the scan goes on.
The finding names the part of cachedoctor that failed, the exception's type and a short
message.

## Why is this bad?
The file was not judged, so nothing is known about it: it may be fine, or it may be exactly
the kind of hostile or damaged file the checker should have caught. It is a bug in
cachedoctor (please report it, with the finding), except a read that did not finish: that is
the filesystem's (a dead network mount, a FUSE filesystem that stopped answering). The scan
went on with every other file.

## Example
```
$ cachedoctor scan cache/vae
cache/vae/3fa1e2.npy: CD002 error cachedoctor failed on this file while reading it
  (a cachedoctor bug: OverflowError: int too large to convert); the file was not judged
```

## Fix
None automatic. Look at the file by hand (`python -c "import numpy; numpy.load(...)"` in a
throwaway environment, or move it aside), and report the finding. `CACHEDOCTOR_DEBUG=1` does
not change a finding into a traceback: run the reader on the file directly for that.
"""

from __future__ import annotations

from cachedoctor.findings import Finding, Severity
from cachedoctor.rule import Rule

MAX_EXCEPTION_TEXT = 200


def describe(exc: BaseException) -> str:
    """`OverflowError: int too large`, bounded; never raises (an exception's __str__ may)."""
    try:
        text = str(exc)
    except Exception:
        text = "(its message cannot be printed)"
    text = " ".join(text.split())
    if len(text) > MAX_EXCEPTION_TEXT:
        text = text[:MAX_EXCEPTION_TEXT] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def failed(path: str, while_: str, exc: BaseException, dataset: str | None = None,
           what: str = "file") -> Finding:
    """The finding for a failure `while_` checking `path` ("while reading it")."""
    judged = "that rule did not judge it" if while_.startswith("running") else "it was not judged"
    return _finding(path, f"cachedoctor failed on this {what} while {while_} (a cachedoctor bug: "
                          f"{describe(exc)}); {judged}", dataset,
                    stage=while_, exception=type(exc).__name__)


def died(path: str, exitcode: int | None, dataset: str | None = None) -> Finding:
    """The finding for the file a worker process died on."""
    how = (f"was killed by signal {-exitcode}" if exitcode is not None and exitcode < 0
           else f"exited with status {exitcode}")
    return _finding(path, f"the worker process checking this file {how} (out of memory, or a "
                          "crash in a native library: a cachedoctor bug); it was not judged",
                    dataset, stage="worker", exitcode=exitcode)


def stalled(path: str, seconds: float, dataset: str | None = None) -> Finding:
    """The finding for a file whose read had not finished after `seconds` (a hung read)."""
    return _finding(path, f"reading this file did not finish within {seconds:g} s (a hung "
                          "filesystem: a dead network mount, a FUSE filesystem that stopped "
                          "answering?); the worker reading it was stopped and it was not judged",
                    dataset, stage="reading", timeout=seconds)


def _finding(path: str, message: str, dataset: str | None, **details: object) -> Finding:
    return Finding(RULE.code, RULE.name, RULE.severity, path, message, dataset, details, None)


RULE = Rule(
    code="CD002",
    name="checker-error",
    severity=Severity.ERROR,
    summary="cachedoctor failed on a file (a reader or rule raised, a worker died): not judged",
    doc=__doc__,
)
