"""## What it does
Reports two datasets of one config that share a latent (VAE) cache dir, or a latent cache dir
that is a text-embedding cache dir, after resolving symlinks, `..`, trailing slashes and case
(and when one lies inside the other). Caches kept beside the images by design (kohya,
ai-toolkit) are not compared.

## Why is this bad?
The datasets' latents mix in one cache: a file of one dataset's resolution is found where the
other expects its own, buckets mix shapes and batches fail to stack (SimpleTuner #788, #1074);
text embeddings in the VAE dir are taken for latents (`Could not find image path for cache file
…-flux.pt`, SimpleTuner #643). SimpleTuner refuses the exact same string at start-up, but not
two spellings of one directory.

## Example
```
CD402 error config/multidatabackend.json:21
      cache_dir_vae "/data/cache/vae/shared" of dataset closeups is the same dir as dataset photos's
      (config/multidatabackend.json:8): their latents mix in one cache
```

## Fix
None automatic: give each dataset a cache dir of its own in the config (the finding shows the
trainer's default), then rebuild the cache.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from cachedoctor.findings import Finding, Severity, display_path
from cachedoctor.layouts.base import Layout
from cachedoctor.layouts.paths import relation
from cachedoctor.rule import Rule, RuleContext

RELATION = {"same": "is the same dir as", "inside": "lies inside", "contains": "holds"}


def check_layouts(layouts: Sequence[Layout], ctx: RuleContext) -> Iterator[Finding]:
    for layout in layouts:
        latent = [(d, d.latent_cache_dir, d.origin("latent_cache_dir")) for d in layout.datasets
                  if d.latent_cache_dir and not d.caches_beside_images
                  and d.origin("latent_cache_dir") is not None]
        text = [(d, d.text_cache_dir, d.origin("text_cache_dir")) for d in layout.datasets
                if d.text_cache_dir and not d.caches_beside_images
                and d.origin("text_cache_dir") is not None]
        for i, (d, path, origin) in enumerate(latent):
            for other, other_path, other_origin in latent[:i]:
                how = relation(path, other_path)
                if how is not None:
                    where = display_path(str(other_origin))
                    yield _finding(d, origin, path, f"{RELATION[how]} dataset {other.id}'s "
                                   f"({where})", "their latents mix in one cache", how)
                    break
            for other, other_path, other_origin in text:
                if other is d and other_origin == origin:
                    continue  # one configured dir split by the trainer (OneTrainer image/, text/)
                how = relation(path, other_path)
                if how is not None:
                    where = display_path(str(other_origin))
                    yield _finding(d, origin, path, f"{RELATION[how]} the text embed cache dir "
                                   f'"{display_path(other_path)}" ({where})', "text embeddings "
                                   "are taken for latents and latents for embeddings", how)
                    break


def _finding(d, origin, path: str, what: str, why: str, how: str) -> Finding:
    change = d.options.get("suggest:latent_cache_dir")
    message = f'{origin.key} "{display_path(path)}" of dataset {d.id} {what}: {why}'
    if change:
        message += f"; use {change}"
    return RULE.config_finding(origin, message, d.id, change, relation=how, cache_dir=path)


RULE = Rule(
    code="CD402",
    name="shared-cache-dir",
    severity=Severity.ERROR,
    summary="two datasets share a VAE cache dir, or a VAE cache dir is a text-embed cache dir",
    doc=__doc__,
    check_layouts=check_layouts,
)
