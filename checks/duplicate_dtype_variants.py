"""## What it does
Reports a musubi-tuner cache file that holds one key in two dtypes: `varlen_vl_embed_bfloat16`
beside `varlen_vl_embed_float16`, or `latents_1x16x16_bfloat16` beside
`latents_1x16x16_float32`. Only files with musubi's header (`architecture`,
`format_version`) are checked.

## Why is this bad?
musubi's loader strips the dtype from every key, so both variants land under one name and the
item contributes two tensors where every other item contributes one: the batch is misaligned
or `torch.stack` fails. Text-encoder caches got this way when they were cached again in another
precision (fp8 toggled, another `--text_encoder_dtype`): the writer merged the new outputs into
the existing file and kept the old copy (musubi-tuner fixed the merge in
`save_text_encoder_output_cache_common`; files written before the fix keep both).

## Example
```
CD307 error cache/qwen/img_201_qi_te.safetensors
      varlen_vl_embed_bfloat16 and varlen_vl_embed_float16 are read as one key, vl_embed
```

## Fix
`cachedoctor fix` quarantines the file; musubi-tuner's caching script writes it again with
one dtype.
"""

from __future__ import annotations

import re

from cachedoctor.checks.key_declaration_mismatch import DTYPES
from cachedoctor.findings import Finding, Severity
from cachedoctor.formats.meta import FileMeta
from cachedoctor.rule import Rule, RuleContext

# the loader drops a latent key's last `_` segment: `<F>x<H>x<W>`, or FLUX.2's `<H>x<W>`
# (bucket.py BucketBatchManager.__getitem__, kohya-ss/musubi-tuner 30c658c4)
SIZE = re.compile(r"_\d+x\d+(?:x\d+)?$")


def variants(meta: FileMeta) -> dict[str, list[str]]:
    """{the name musubi's loader reads a key as: [keys]} for each name two keys share. The
    loader drops the dtype, and a latent key's size (`_<F>x<H>x<W>`, `_<H>x<W>`) too."""
    seen: dict[str, list[str]] = {}
    for tensor in meta.tensors:
        if len(tensor.path) != 1 or not isinstance(tensor.path[0], str):
            continue
        key = tensor.path[0]
        dtype = next((d for d in DTYPES if key.endswith("_" + d)), None)
        if dtype is None:
            continue
        base = key[: -len(dtype) - 1]
        if base.startswith("latents_"):
            base = SIZE.sub("", base)
        seen.setdefault(base.removeprefix("varlen_"), []).append(key)
    return {base: sorted(keys) for base, keys in seen.items() if len(keys) > 1}


def check(meta: FileMeta, ctx: RuleContext) -> Finding | None:
    if meta.format != "safetensors" or "format_version" not in meta.metadata or (
            "architecture" not in meta.metadata):
        return None
    found = variants(meta)
    if not found:
        return None
    parts = [f"{' and '.join(keys)} are read as one key, {base}"
             for base, keys in sorted(found.items())]
    return RULE.finding(meta.path, "; ".join(parts), ctx, keys=found)


RULE = Rule(
    code="CD307",
    name="duplicate-dtype-variants",
    severity=Severity.ERROR,
    summary="a musubi-tuner cache file holds one key in two dtypes (cached again in another precision)",
    doc=__doc__,
    fix="quarantine",
    check_file=check,
)
