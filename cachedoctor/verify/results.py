"""One dataset's verify result: the entries sampled, their comparisons and the distribution."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cachedoctor.verify.diagnose import Checked


@dataclass
class DatasetResult:
    id: str
    trainer: str
    cache_dir: str | None
    entries: int = 0
    checked: list[Checked] = field(default_factory=list)
    note: str = ""  # why the dataset was not verified
    kind: str = "latents"  # or "text": caption embeddings (verify/text.py)
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def compared(self) -> list[Checked]:
        return [c for c in self.checked if c.close is not None]

    def distribution(self) -> dict[str, dict[str, float]]:
        """min, median, the bad tail (p95; p5 of cosine) and max of each metric over the compared
        entries."""
        out = {}
        for metric in ("error", "cosine", "distance"):
            values = sorted(getattr(c.close, metric) for c in self.compared)
            if values:  # the bad tail: the 5th percentile of cosine, the 95th of the others
                tail = ("p5", 0.05) if metric == "cosine" else ("p95", 0.95)
                out[metric] = {"min": round(values[0], 5), "median": round(_quantile(values, 0.5), 5),
                               tail[0]: round(_quantile(values, tail[1]), 5), "max": round(values[-1], 5)}
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind, "trainer": self.trainer, "cache_dir": self.cache_dir,
                **self.details, "entries": self.entries, "sampled": len(self.checked),
                "compared": len(self.compared), **({"note": self.note} if self.note else {}),
                "distribution": self.distribution(), "results": [c.as_dict() for c in self.checked]}


def _quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]
