"""## What it does
Reports a musubi-tuner text-encoder cache (`<stem>_<arch>_te.safetensors`) whose caption, which
musubi stores in the file's `caption1` metadata, is not the caption the dataset now gives its
image or video: the caption file beside it (`caption_extension`, read and stripped as musubi
reads it) or the `caption` of its jsonl line. Needs the dataset config (a bare cache dir names
no captions).

## Why is this bad?
The embedding is what the model trains on, not the caption file. musubi never compares the
two when it trains, and its caching script run with `--skip_existing` keeps every existing
file: after captions are edited, the model goes on learning the old captions without a word.

## Example
```
CD410 warning cache/qwen/img_100_qi_te.safetensors
      embeds 'a photo, bucket 1, number 0', but images/img_100.txt now says 'a completely
      different caption': the model trains on the old caption
```

## Fix
`cachedoctor fix` quarantines the file; musubi-tuner's text-encoder caching script
(`cache_text_encoder_outputs.py` or the architecture's, with `--skip_existing`) encodes the
current caption.
"""

from __future__ import annotations

import os

from cachedoctor.findings import Finding, Severity
from cachedoctor.formats.meta import FileMeta
from cachedoctor.inventory import TEXT
from cachedoctor.layouts.musubi import TEXT_ENTRY
from cachedoctor.rule import Rule, RuleContext


def _short(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def applies(meta: FileMeta, ctx: RuleContext) -> bool:
    """Whether a file with these facts may be judged at all, whatever its name: a sound text
    embedding that stores its caption, in a dataset whose captions were read."""
    facts, entry = ctx.facts, ctx.entry
    return facts is not None and entry is not None and entry.role == TEXT and not meta.errors \
        and bool(facts.options.get("captions")) and meta.metadata.get("caption1") is not None


def check(meta: FileMeta, ctx: RuleContext) -> Finding | None:
    if not applies(meta, ctx):
        return None
    facts = ctx.facts
    captions = facts.options.get("captions")
    stored = meta.metadata.get("caption1")
    match = TEXT_ENTRY.match(os.path.basename(meta.path))
    if match is None:
        return None
    current = captions.get(match["stem"])
    if current is None or current == stored:
        return None
    extension = facts.options.get("caption_extension")
    media = facts.image_dirs[0] if facts.image_dirs else None
    source = (os.path.join(os.path.basename(media), match["stem"] + extension)
              if media and extension else "its jsonl line")
    return RULE.finding(
        meta.path,
        f"embeds {_short(stored)}, but {source} now says {_short(current)}: the model "
        "trains on the old caption", ctx, caption=stored, current_caption=current)


RULE = Rule(
    code="CD410",
    name="stale-caption-embedding",
    severity=Severity.WARNING,
    summary="a text-encoder cache embeds another caption than the caption file now holds",
    doc=__doc__,
    fix="quarantine",
    check_file=check,
    names=True,  # (the file's name is read: see rule.py)
    applies=applies,
)
