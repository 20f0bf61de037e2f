"""The repairs `verify` applies to a cache a buggy writer made, one after the other:

1. `cachedoctor fix` on the cache as the buggy writer left it. Rank 0 scans the project,
   builds the plan and applies it through the API the CLI runs (`fix <config> <cache dirs>
   --yes`: recover, scan, build_plan, Plan.execute, journaled and undoable). Then it scans
   again. The other ranks wait at the barriers, as they would wait for a pre-flight step.
2. The corrected writer: each rank encodes its share again over what is there.

After each, the scenario measures the cache, checks its tensors against the buggy cache's and
trains on it, so that both repairs are shown to give the same cache and the same loss.
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cachedoctor.harness.project import Project
    from cachedoctor.harness.rank import RankContext

FIX, WRITER = "cachedoctor fix", "corrected writer"


def repairs(ctx: RankContext, rewrite: Callable[[], object]) -> list[tuple[str, Callable[[], dict]]]:
    """(name, repair) in the order verify applies them; each repair returns what it did (rank
    0's account of the fix; an empty dict elsewhere)."""
    return [(FIX, lambda: fix_cache(ctx)), (WRITER, lambda: rewrite_cache(ctx, rewrite))]


def fix_cache(ctx: RankContext) -> dict[str, Any]:
    """`cachedoctor fix --yes` on the project's caches, by rank 0, between barriers."""
    ctx.barrier()
    done = fix_project(ctx.project) if ctx.main else {}
    ctx.barrier()
    return done


def rewrite_cache(ctx: RankContext, rewrite: Callable[[], object]) -> dict[str, Any]:
    """Every rank writes its share again with the corrected writer, between barriers."""
    ctx.barrier()
    rewrite()
    ctx.barrier()
    return {}


def fix_project(project: Project) -> dict[str, Any]:
    """Scan, plan and apply as `cachedoctor fix <config> <cache dirs> --yes` does; what the plan
    did and what a scan reports afterwards."""
    from cachedoctor.harness.detection import scan_project, scan_targets
    from cachedoctor.layouts import resolve
    from cachedoctor.repair import build_plan, recover_caches
    from cachedoctor.repair.caches import cache_roots

    # The index of fixed caches (for `undo` without --cache) goes to the run, not the user's home.
    os.environ["CACHEDOCTOR_STATE_DIR"] = str(project.output_dir / "cachedoctor-state")
    targets = scan_targets(project)
    roots = cache_roots(resolve(targets))
    recover_caches(roots)
    plan = build_plan(scan_project(project), roots)
    result = plan.execute(command=" ".join(["cachedoctor", "fix", *targets, "--yes"]))
    return {
        "run_id": result.run_id,
        "actions": dict(sorted(Counter(a.kind for a in plan.actions).items())),
        "failed": [f"{o.action.path}: {o.message}" for o in result.failed],
        "codes_after": sorted({f.code for f in scan_project(project).findings}),
    }


def tensor_digests(paths: Iterable[Path]) -> dict[str, str]:
    """file name -> sha256 over the file's tensors (name, dtype, shape, bytes), loaded on the
    CPU wherever they were stored: equal digests mean bit-identical tensors."""
    import torch

    out = {}
    for path in paths:
        entry = torch.load(path, weights_only=True, map_location="cpu")
        items = sorted(entry.items()) if isinstance(entry, dict) else [("", entry)]
        digest = hashlib.sha256()
        for key, tensor in items:
            digest.update(f"{key}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
            digest.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        out[path.name] = digest.hexdigest()
    return out


def summarize(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The ranks' accounts of each repair merged: rank 0's account of the fix, whether every
    rank found its tensors identical, and every rank's losses (in rank order)."""
    merged = []
    for step in zip(*per_rank, strict=True):
        first = step[0]
        merged.append({
            "how": first["how"],
            **{k: v for k, v in first.items() if k in ("actions", "failed", "codes_after", "run_id")},
            "tensors_identical": all(r["identical"] for r in step),
            "losses": [r["loss"] for r in step],
        })
    return merged
