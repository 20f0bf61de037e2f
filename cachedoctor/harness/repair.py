"""The repair step of `verify` for caches a buggy writer made: the seam for `cachedoctor fix`."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cachedoctor.harness.rank import RankContext


def repair_cache(ctx: RankContext, reencode: Callable[[], object]) -> str:
    """Bring the cache back to health behind barriers; return how it was done.

    `cachedoctor fix` (issue #4) does not exist yet, so each rank re-encodes its share with the
    corrected writer. Once it does, rank 0 runs `cachedoctor fix <cache dirs> --yes` here
    (`compact` for CD201, `to-cpu` for CD501/CD502) and the scenarios check its result unchanged.
    """
    ctx.barrier()
    reencode()
    ctx.barrier()
    return "re-encoded with the corrected writer"
