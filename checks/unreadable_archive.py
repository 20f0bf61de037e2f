"""## What it does
Reports a cache file that cannot be parsed as its format:

- a torch zip archive with no central directory (truncated or half-written), an entry that
  runs past the end of the file, or a missing `data.pkl` or storage record;
- a legacy torch stream that ends early;
- a safetensors header whose length or offsets are wrong;
- an npz member cut short;
- a gzip stream that ends before its end marker;
- an Arrow stream (a 🤗 datasets cache) cut inside a message or without its end-of-stream
  marker;
- an Arrow or Parquet field of pyarrow's pickled extension type (`arrow.py_extension_type`)
  whose pickle cannot be checked or names no class, which pyarrow before 14.0.1 unpickles;
- a file of zeros where a cache file should be.

## Why is this bad?
The trainer dies when it reaches the file, often hours in and on one rank of many, with an
error that rarely names the cause: `PytorchStreamReader failed reading zip archive: failed
finding central directory`, `OSError: [Errno 22] Invalid argument` (torch's reading of small
truncated files), `ValueError: negative seek value`, `unexpected EOF, expected N more bytes`,
`SafetensorError: Error while deserializing header: MetadataIncompleteBuffer`, or
`BadZipFile: File is not a zip file`, `ArrowInvalid: Expected to read N metadata bytes`. Files
half-written by concurrent writers (SimpleTuner #1147) look exactly like this. An Arrow stream
cut between two messages is worse: pyarrow loads the rows it holds without an error, and the
dataset trains on fewer samples than it was given.

## Example
```
CD101 error cache/text/10f34c853ae35b374b489315e55183a4-flux.pt
      no zip central directory: the file ends at 1,800 bytes inside entry '…/data/0'
```

## Fix
`cachedoctor fix` moves the file to the quarantine (`<cache>/.cachedoctor/quarantine/<run>/`);
with `--reencode` a new entry is encoded from the source image. The trainer also rebuilds a
missing entry on its next caching pass.
"""

from __future__ import annotations

from cachedoctor.findings import Finding, Severity
from cachedoctor.fix_kinds import FixKind
from cachedoctor.formats import UNREADABLE
from cachedoctor.formats.meta import EMPTY, FileMeta
from cachedoctor.inventory import TEMP
from cachedoctor.rule import Rule, RuleContext


def check(meta: FileMeta, ctx: RuleContext) -> Finding | None:
    if not meta.errors or meta.format in (UNREADABLE, EMPTY):
        return None
    if ctx.entry is not None and ctx.entry.role == TEMP:
        return None  # a half-written temp file is CD104's, not a broken cache entry
    container = f"{meta.compression}+{meta.format}" if meta.compression else meta.format
    return RULE.finding(meta.path, meta.errors[0], ctx, container=container,
                        errors=list(meta.errors))


RULE = Rule(
    code="CD101",
    name="unreadable-archive",
    severity=Severity.ERROR,
    summary="a cache file cannot be parsed as its format (truncated, half-written, damaged)",
    doc=__doc__,
    fix=FixKind.QUARANTINE,
    check_file=check,
)
