"""## What it does
Reports a file in a cache dir that is no cache format: an image, a caption, a JSON or text
file, an archive of something else.

## Why is this bad?
It usually means the image dir and the cache dir are one folder (or nested): the trainer then
takes cache files for images and images for cache entries, skips preprocessing for some samples
and stacks tensors of different shapes into one batch (docs/incidents.md, incident 5; SimpleTuner
issues #643 and #788). Check the dataset config for CD401 and CD402.

## Example
```
CD107 warning cache/vae/photos/img_0001.png  an image in a cache dir: is the image dir the cache dir?
```

## Fix
None automatic: separate the image and cache dirs in the trainer config, then move the stray
files back where they belong.
"""

from __future__ import annotations

from cachedoctor.findings import Finding, Severity
from cachedoctor.formats.meta import EMPTY, IMAGE, JSON, TEXT, UNKNOWN, ZIP, FileMeta
from cachedoctor.inventory import METADATA, TEMP
from cachedoctor.rule import Rule, RuleContext

WHAT = {
    IMAGE: "an image in a cache dir: is the image dir the cache dir?",
    TEXT: "a text file (caption?) in a cache dir: is the image dir the cache dir?",
    JSON: "a JSON file that no trainer keeps in a cache dir",
    ZIP: "a zip archive that is neither a torch file nor an npz",
    UNKNOWN: "not a cache format (no torch, safetensors or numpy signature)",
    EMPTY: "an empty file that is no cache entry",
}


def check(meta: FileMeta, ctx: RuleContext) -> Finding | None:
    entry = ctx.entry
    if meta.format not in WHAT or (entry is not None and entry.area != "cache"):
        return None
    if meta.errors or (entry is not None and entry.role in (METADATA, TEMP)):
        return None  # a broken cache file is CD101's; temp and metadata files belong here
    if meta.format == EMPTY and entry is not None and entry.role != "other":
        return None  # an empty cache file is CD102's
    return RULE.finding(meta.path, WHAT[meta.format], ctx, format=meta.format)


RULE = Rule(
    code="CD107",
    name="foreign-file",
    severity=Severity.WARNING,
    summary="a file in a cache dir that is no cache format (an image, a caption)",
    doc=__doc__,
    check_file=check,
)
