"""## What it does
Reports a cache dir that is an image dir, lies inside one, or holds one, after resolving
symlinks, `..`, trailing slashes and, on a case-insensitive file system, case. Every image dir
of a config is compared with every cache dir of it (a dataset's own, and the others'). Caches
that a trainer keeps beside the images by design are not reported: kohya's npz files, and
ai-toolkit's `_latent_cache` inside each image folder.

## Why is this bad?
The trainer then takes cache files for images and images for cache entries: preprocessing is
skipped for some samples, latents of different shapes land in one bucket, and a batch fails
to stack (docs/incidents.md, incident 5). SimpleTuner refuses two VAE caches in one dir and a VAE
cache in the text cache dir (CD402) but compares the strings only, and does not compare cache
dirs with image dirs at all.

## Example
```
CD401 error config/multidatabackend.json:9
      cache_dir_vae "/data/photos/cache" lies inside instance_data_dir "/data/photos": the trainer
      takes cache files for images and images for cache entries; use
      "cache_dir_vae": "{output_dir}/cache/vae/{model_family}/photos"
```

## Fix
None automatic: move the cache dir out of the image dir in the config (the finding shows the
trainer's default, e.g. `"cache_dir_vae": "{output_dir}/cache/vae/{model_family}/photos"`),
then move or delete the old cache files.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from cachedoctor.findings import Finding, Severity, display_path
from cachedoctor.layouts.base import Layout
from cachedoctor.layouts.paths import relation
from cachedoctor.rule import Rule, RuleContext

RELATION = {"same": "is", "inside": "lies inside", "contains": "holds"}


def check_layouts(layouts: Sequence[Layout], ctx: RuleContext) -> Iterator[Finding]:
    for layout in layouts:
        caches = []
        for d in layout.datasets:
            if d.caches_beside_images:
                continue
            for fact in ("latent_cache_dir", "text_cache_dir"):
                path, origin = getattr(d, fact), d.origin(fact)
                if path and origin is not None:
                    caches.append((d, fact, path, origin))
        seen = set()
        for owner in layout.datasets:
            for image_dir in owner.image_dirs:
                image_origin = owner.image_origin(image_dir)
                for d, fact, cache_dir, origin in caches:
                    how = relation(cache_dir, image_dir)
                    if how is None or (origin, image_dir) in seen:
                        continue
                    seen.add((origin, image_dir))
                    whose = "" if owner is d else f" of dataset {owner.id}"
                    image_key = image_origin.key if image_origin else "the image dir"
                    change = d.options.get(f"suggest:{fact}")
                    message = (f'{origin.key} "{display_path(cache_dir)}" {RELATION[how]} '
                               f'{image_key} "{display_path(image_dir)}"{whose}: the trainer '
                               "takes cache files for images and images for cache entries")
                    if change:
                        message += f"; use {change}"
                    yield RULE.config_finding(origin, message, d.id, change, relation=how,
                                              cache_dir=cache_dir, image_dir=image_dir)


RULE = Rule(
    code="CD401",
    name="image-cache-overlap",
    severity=Severity.ERROR,
    summary="an image dir and a cache dir are the same or nested (after symlinks, `..` and case)",
    doc=__doc__,
    check_layouts=check_layouts,
)
