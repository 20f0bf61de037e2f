"""## What it does
Reports cache clearing that races with other processes: SimpleTuner's
`vae_cache_clear_each_epoch: true` on a dataset trained with more than one process
(`--num_processes`, `TRAINING_NUM_PROCESSES`), and OneTrainer's `clear_cache_before_training`
(the default) in a config whose `cache_dir` another OneTrainer config of the same working dir
(its `training_presets/`, or its own folder) uses too.

## Why is this bad?
At each epoch rollover every SimpleTuner rank clears the dataset's cache and rebuilds its own
share, without waiting for the others: ranks delete latents another rank has just written or
is about to read, and epoch 2 stops with `Some images were not correctly cached during the VAE
Cache operations` (docs/incidents.md, incident 2; SimpleTuner #848). OneTrainer clears `image/` and
`text/` under `cache_dir` at every start, so a second run on the same cache dir deletes the
first one's cache under its feet.

## Example
```
CD403 warning config/multidatabackend.json:14
      vae_cache_clear_each_epoch is true with 8 processes (config/config.json:5): every rank
      clears the cache on its own and deletes latents the others still need
```

## Fix
None automatic: the config change is shown, `"vae_cache_clear_each_epoch": false` (keep the
cache for the run), or for OneTrainer a `cache_dir` of each config's own.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from cachedoctor.findings import Finding, Severity, display_path
from cachedoctor.layouts.base import Layout
from cachedoctor.rule import Rule, RuleContext


def check_layouts(layouts: Sequence[Layout], ctx: RuleContext) -> Iterator[Finding]:
    for layout in layouts:
        for d in layout.datasets:
            origin = d.origin("vae_cache_clear_each_epoch")
            if d.options.get("vae_cache_clear_each_epoch") is True and d.processes > 1 and origin:
                where = d.origin("processes")
                yield RULE.config_finding(
                    origin,
                    f"vae_cache_clear_each_epoch is true with {d.processes} processes"
                    f"{f' ({display_path(str(where))})' if where else ''}: every rank clears the cache on its own "
                    "and deletes latents the others still need; set "
                    '"vae_cache_clear_each_epoch": false',
                    d.id, '"vae_cache_clear_each_epoch": false', processes=d.processes)
        for d in layout.datasets:
            shared = d.options.get("cache_shared_with")
            origin = d.origin("clear_cache_before_training") or d.origin("latent_cache_dir")
            if shared and origin is not None:
                names = ", ".join(display_path(p) for p in shared)
                yield RULE.config_finding(
                    origin,
                    f'clear_cache_before_training with cache_dir '
                    f'"{display_path(d.options["cache_dir"])}", which {names} uses too: each '
                    "run's start deletes the other's image/ and text/ caches; set "
                    '"clear_cache_before_training": false or give each config a cache_dir of '
                    "its own",
                    d.id, '"clear_cache_before_training": false', shared_with=list(shared))


RULE = Rule(
    code="CD403",
    name="clear-each-epoch-multi-process",
    severity=Severity.WARNING,
    summary="vae_cache_clear_each_epoch with more than one process (or clear_cache_before_training on a shared cache)",
    doc=__doc__,
    check_layouts=check_layouts,
)
