"""## What it does
Reports a gzip-compressed torch file in a cache whose trainer reads it without decompressing
it: a SimpleTuner dataset (or text embed dataset) whose `compress_cache` is off, on the dataset
or through `--compress_disk_cache false`. Scanned without a trainer config, nothing is reported:
the loader is unknown.

## Why is this bad?
SimpleTuner gunzips a cache file only when its backend has `compress_cache` on
(`LocalDataBackend.torch_load`: `_decompress_torch`, which passes a plain file through as it
is, so with it on both kinds load). With it off, `torch.load` gets the gzip bytes and raises
(`Unsupported operand 31` under `weights_only`, `invalid load key, '\\x1f'` before PyTorch 2.6,
when SimpleTuner also deletes the file). SimpleTuner takes the entry as cached because the file
exists, so training stops at the first batch that holds it. This is what turning
`compress_disk_cache` off (or setting `compress_cache: false` on one dataset) over a cache
written with it on leaves.

## Example
```
CD109 error cache/vae/sdxl/photos/3f2a…c1.pt  gzip-compressed, but compress_cache is off for
      this dataset (config/config.json:5): SimpleTuner hands the gzip bytes to torch.load,
      which raises at the first batch that holds this entry
```

## Fix
None automatic: turn `compress_cache` on for the dataset again (SimpleTuner then reads gzip and
plain entries alike), or delete the gzip entries and let SimpleTuner cache them again.
"""

from __future__ import annotations

from cachedoctor.findings import Finding, Severity, display_path
from cachedoctor.formats.meta import FileMeta
from cachedoctor.rule import Rule, RuleContext


def check(meta: FileMeta, ctx: RuleContext) -> Finding | None:
    facts = ctx.facts
    if meta.compression != "gzip" or facts is None or facts.options.get("reads_gzip", True):
        return None
    if ctx.entry is not None and ctx.entry.area != "cache":
        return None
    origin = facts.origin("reads_gzip")
    where = f" ({display_path(str(origin))})" if origin else ""
    return RULE.finding(
        meta.path,
        f"gzip-compressed, but compress_cache is off for this dataset{where}: SimpleTuner "
        "hands the gzip bytes to torch.load, which raises at the first batch that holds this "
        "entry",
        ctx, change='"compress_cache": true',
    )


RULE = Rule(
    code="CD109",
    name="gzip-not-read",
    severity=Severity.ERROR,
    summary="a gzip-compressed cache file the trainer loads without decompressing it",
    doc=__doc__,
    check_file=check,
)
