"""## What it does
Reports images that have no cache entry where the trainer expects one, in a dataset whose cache
already holds entries (an empty or absent cache is one the trainer has yet to build). Which
images count is the trainer's call: SimpleTuner expects an entry for every image its bucket file
lists (every image, before the first bucket scan) unless `vae_cache_ondemand` or
`vae_cache_disable`; kohya for every image of a subset (`<stem>_<W>x<H>_<arch>.npz` or
`<stem>.npz` beside it); OneTrainer for every image of an enabled concept that mgds has cached
(an entry in some `aggregate.pt`; a concept none lists an image of is one it caches at its
start, a `VALIDATION` one only with `validation` on), unless it clears its cache at each start; ai-toolkit with
`cache_latents_to_disk`, for every image (a `_latent_cache/<stem>_<hash>.safetensors` whose
header names it; with a list of resolutions, one per distinct bucket they give the image;
scanned without the job config, for every image whose folder holds a `_latent_cache/`, one per
bucket that images of its size have). In a
diffusion-pipe cache, it reports the shards that `metadata.db`'s items point at but that are
missing (no `shard_<n>.bin`, or no `shard_<n>` offsets table).

## Why is this bad?
A partial cache is what a caching pass that died (out of memory, SimpleTuner #859), a cache
cleared by another rank (`vae_cache_clear_each_epoch`, CD403), or a skipped discovery
(`skip_file_discovery=vae`) leaves. SimpleTuner then stops mid-training with `Some images were
not correctly cached during the VAE Cache operations`; other trainers encode on the fly, at the
cost of a slow first epoch and a VAE kept in memory. diffusion-pipe counts its items and, finding
as many as the dataset has rows, trusts the cache: it fails with `FileNotFoundError` on the first
item of a missing shard, mid-training.

## Example
```
CD404 error datasets/photos/beach_0042.png  no cached latent: 4c1f…9e.pt is missing from cache/vae/sdxl/photos
```

## Fix
`cachedoctor fix CONFIG --reencode --encoder SPEC` encodes the missing entries in the trainer's
own naming, bucket and format (SimpleTuner, kohya, ai-toolkit, and OneTrainer samples its
`aggregate.pt` lists); or let the trainer's caching pass run again (with SimpleTuner, without
`skip_file_discovery=vae`). OneTrainer pairs image and text cache entries by sample number, so
an image no `aggregate.pt` lists needs its caching pass: clear that concept's cache. A
diffusion-pipe cache folder (`metadata.db` and every `shard_<n>.bin`) is quarantined as a whole:
its items are positional, so diffusion-pipe rebuilds the folder.
"""

from __future__ import annotations

from collections.abc import Iterator

from cachedoctor.findings import Finding, Severity, display_path
from cachedoctor.fix_kinds import FixKind
from cachedoctor.formats.meta import FileMeta
from cachedoctor.formats.shard_blobs import INDEX_FORMAT
from cachedoctor.rule import Rule, RuleContext, no_files
from cachedoctor.summary import DatasetView


def check_dataset(view: DatasetView, ctx: RuleContext) -> Iterator[Finding]:
    facts = ctx.facts
    if facts is None or facts.cache_rebuilt_at_start or not view.has_cache_entries():
        return
    where = display_path(facts.latent_cache_dir) if facts.latent_cache_dir else "the cache"
    for path, key in view.missing():
        yield RULE.finding(path, f"no cached latent: {facts.naming.missing_text(path, where)}",
                           ctx, key=key, expected_entry=facts.naming.expected_entry(path),
                           cache_dir=facts.latent_cache_dir)


def check_file(meta: FileMeta, ctx: RuleContext) -> Finding | None:
    missing = meta.metadata.get("missing_shards") if meta.format == INDEX_FORMAT else None
    if not missing:
        return None
    shards = [f"shard_{n}.bin" for n in missing.split(",")]
    items = int(meta.metadata.get("missing_items", "0"))
    return RULE.finding(meta.path, f"{items:,} items point at {', '.join(shards[:5])}"
                        f"{' …' if len(shards) > 5 else ''}, which "
                        f"{'is' if len(shards) == 1 else 'are'} missing (file or offsets table)",
                        ctx, fix="quarantine", shards=shards, missing_items=items)


RULE = Rule(
    code="CD404",
    name="missing-cache-entries",
    severity=Severity.ERROR,
    summary="images with no cache entry where the trainer expects one",
    doc=__doc__,
    fix=FixKind.REENCODE,
    check_dataset=check_dataset,
    select=no_files,
    check_file=check_file,
)
