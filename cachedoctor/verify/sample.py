"""Which entries to verify: a dataset's latent entries, and a reproducible random sample.

The entries are the latent files under the dataset's latent cache dir (named and classified
as the scan classifies them); the sample depends on the seed and the dataset id only, so that
the same command picks the same entries on any machine.
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass

from cachedoctor.inventory import LATENT, classify


class SampleError(ValueError):
    """A --sample that is not N, P% or all."""


@dataclass(frozen=True)
class SampleSize:
    """`--sample`: a count per dataset, a percentage of it, or every entry."""

    count: int | None = None
    percent: float | None = None

    @classmethod
    def parse(cls, text: str) -> SampleSize:
        text = text.strip()
        if text == "all":
            return cls(percent=100.0)
        try:
            if text.endswith("%"):
                percent = float(text[:-1])
                if not 0 < percent <= 100:
                    raise ValueError
                return cls(percent=percent)
            count = int(text)
            if count < 1:
                raise ValueError
            return cls(count=count)
        except ValueError:
            raise SampleError(f"--sample {text!r}: expected a count (64), a percentage (1%) or all") from None

    def of(self, total: int) -> int:
        """How many of `total` entries to take (at least one of a non-empty dataset)."""
        if self.count is not None:
            return min(self.count, total)
        return min(total, max(1, math.ceil(total * (self.percent or 0) / 100))) if total else 0

    def __str__(self) -> str:
        if self.count is not None:
            return str(self.count)
        return "all" if self.percent == 100.0 else f"{self.percent:g}%"


def latent_entries(directory: str | None) -> list[str]:
    """The latent cache files under `directory`, sorted (hidden folders and files skipped)."""
    if directory is None or not os.path.isdir(directory):
        return []
    out = []
    for dirpath, dirnames, names in os.walk(directory):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        out.extend(os.path.join(dirpath, n) for n in names
                   if not n.startswith(".") and classify(n, dirpath) == LATENT)
    return sorted(out)


def choose(entries: list[str], size: SampleSize, seed: int, dataset: str) -> list[str]:
    """A sample of `entries`, the same for the same seed and dataset id, in name order."""
    wanted = size.of(len(entries))
    if wanted >= len(entries):
        return list(entries)
    return sorted(random.Random(f"{seed}:{dataset}").sample(entries, wanted))
