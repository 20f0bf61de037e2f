"""Baselines: record today's findings, then report only the ones that are new.

A team adopting cachedoctor on an old cache writes a baseline once (`--write-baseline FILE`)
and from then on fails only on regressions (`--baseline FILE`). A finding is known when its
fingerprint is in the baseline. The fingerprint is a hash of

- the rule code;
- the path relative to the baseline file's directory, `/`-separated, so a checkout moved to
  another directory or machine matches;
- the finding's details (the evidence: ratio and bytes for CD201, devices for CD502, ...) as
  canonical JSON. Absolute paths inside them are made relative the same way. Lists of
  strings are taken as sets, since a dataset rule may list files in any order. Clock readings
  are left out: details whose key ends in `seconds`, `age`, `mtime` or `time` change while the
  defect stays the same (CD104's lock file grows older on every run).

No measure of how big the cache is goes in. A finding about a whole dataset (CD304's dtypes, a
split of CD301/CD303/CD305, CD502's devices) must stay known while healthy files are added.
So details whose key ends in `files`, `count`, `counts` or `examples` (file lists, counts, a
few example files) are left out, and a tally (a mapping of names to numbers: dtype -> files)
counts by its names only. Per-file findings keep their path, so each new broken file is new.

The message is not hashed: its wording may change between versions and it carries ages.
A baseline is JSON: `{"version": 1, "tool": {...}, "findings": [{"code", "path", "fingerprint",
"message"}]}`, sorted, one finding per entry; `message` is there for people reading a diff.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from cachedoctor import __version__
from cachedoctor.findings import Finding, Report, jsonable, printable

VERSION = 1
MAX_BASELINE_BYTES = 256 * 2**20  # about a million findings
CLOCK_SUFFIXES = ("seconds", "age", "mtime", "time")
SIZE_SUFFIXES = ("files", "count", "counts", "examples")  # grow with the cache, not the defect
VOLATILE = CLOCK_SUFFIXES + SIZE_SUFFIXES


class BaselineError(Exception):
    """A baseline file that cannot be read or is not one: a usage error (exit code 2)."""


def relative(path: str, base: str) -> str:
    """`path` relative to the directory `base`, with `/` separators on every system."""
    return printable(os.path.relpath(path, base)).replace(os.sep, "/")


def _evidence(value: Any, base: str) -> Any:
    if isinstance(value, dict):
        if value and all(isinstance(v, int) and not isinstance(v, bool) for v in value.values()):
            return sorted(_evidence(k, base) for k in value)  # a tally: which, not how many
        return _fields(value, base)
    if isinstance(value, list):
        items = [_evidence(v, base) for v in value]
        return sorted(items) if all(isinstance(v, str) for v in items) else items
    if isinstance(value, str) and os.path.isabs(value):
        return relative(value, base)
    return value


def _fields(details: dict, base: str) -> dict:
    return {k: _evidence(v, base) for k, v in details.items() if not k.endswith(VOLATILE)}


def fingerprint(finding: Finding, base: str) -> str:
    """A stable identity of `finding`, paths taken relative to the directory `base`."""
    identity = [finding.code, relative(finding.path, base),
                _fields(jsonable(finding.details), base)]
    text = json.dumps(identity, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    import hashlib  # here, not at the top: OpenSSL's import is 3 ms of every scan's start

    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:16]


@dataclass(frozen=True)
class Baseline:
    """The fingerprints of the findings a team has accepted, and where they are relative to."""

    base: str  # the baseline file's directory
    fingerprints: Mapping[str, int]  # fingerprint -> how many findings share it

    @classmethod
    def load(cls, path: str) -> Baseline:
        try:
            # O_NONBLOCK, then a regular file only: a FIFO or /dev/zero (a config may name the
            # baseline, and a config may come with a cache) would hang the scan or fill memory
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            with open(fd, encoding="utf-8") as f:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise BaselineError(f"cannot read baseline {path}: not a regular file")
                if st.st_size > MAX_BASELINE_BYTES:  # (a config may name any file)
                    raise BaselineError(f"cannot read baseline {path}: {st.st_size:,} bytes, "
                                        f"more than a baseline holds "
                                        f"({MAX_BASELINE_BYTES // 2**20} MiB at most)")
                data = json.load(f)
            if data.get("version") != VERSION:
                raise BaselineError(f"{path}: baseline version {data.get('version')!r}, "
                                    f"expected {VERSION}")
            counts = Counter(str(e["fingerprint"]) for e in data["findings"])
        except FileNotFoundError:
            raise BaselineError(f"cannot read baseline {path}: no such file (write it with "
                                "--write-baseline)") from None
        except OSError as exc:
            raise BaselineError(f"cannot read baseline {path}: {exc.strerror or exc}") from None
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise BaselineError(f"{path}: not a cachedoctor baseline ({type(exc).__name__}: "
                                f"{exc})") from None
        except RecursionError:  # json's decoder recurses once per [ or {
            raise BaselineError(f"{path}: not a cachedoctor baseline (nested too deeply)") from None
        return cls(os.path.dirname(os.path.abspath(path)), counts)

    def split(self, findings: Iterable[Finding]) -> tuple[list[Finding], int]:
        """(the findings not in the baseline, how many baseline entries were not seen)."""
        left = Counter(self.fingerprints)
        new = []
        for finding in findings:
            key = fingerprint(finding, self.base)
            if left[key] > 0:
                left[key] -= 1
            else:
                new.append(finding)
        return new, sum(left.values())

    def apply(self, report: Report) -> BaselineResult:
        new, fixed = self.split(report.findings)
        return BaselineResult(dataclasses.replace(report, findings=tuple(new)),
                              len(report.findings) - len(new), fixed)


@dataclass(frozen=True)
class BaselineResult:
    """A report with a baseline applied, and what the baseline hid or no longer finds."""

    report: Report  # only the findings that are new
    known: int  # findings hidden because the baseline has them
    fixed: int  # baseline entries no longer found (fixed, or their evidence changed)


def named(path: str | None) -> Baseline | None:
    """The baseline a policy names, loaded (BaselineError when it cannot be); None when the
    policy names none. Loaded before the scan, so that a bad baseline fails at once."""
    return Baseline.load(path) if path else None


def apply_to(report: Report, baseline: Baseline | None) -> BaselineResult:
    """`report` less the findings `baseline` records; without a baseline every finding is new."""
    return baseline.apply(report) if baseline is not None else BaselineResult(report, 0, 0)


def write(report: Report, path: str) -> int:
    """Record every finding of `report` in a baseline file at `path`; returns how many."""
    base = os.path.dirname(os.path.abspath(path))
    entries = sorted(
        ({"code": f.code, "path": relative(f.path, base), "fingerprint": fingerprint(f, base),
          "message": printable(f.message)} for f in report.findings),
        key=lambda e: (e["path"], e["code"], e["fingerprint"]),
    )
    document = {"version": VERSION, "tool": {"name": "cachedoctor", "version": __version__},
                "findings": entries}
    os.makedirs(base, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(document, f, indent=2, ensure_ascii=False)
        f.write("\n")
    return len(entries)
