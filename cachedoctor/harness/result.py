"""What a scenario run observed, and the verdict on it: plain data, no torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MODES = ("reproduce", "verify")


@dataclass(frozen=True)
class Observation:
    """What the ranks saw, as a scenario's `observe` reads it from their notes."""

    reproduced: bool  # the incident's failure happened
    failure: str | None  # the exception text (or measured symptom) that showed it
    fixed: bool  # the fixed pipeline ran the same load without the failure
    trained: bool  # every rank finished its training steps with a finite loss
    loss: float | None = None
    attempts: int | None = None  # tries a race took; None: one launch, no retries inside
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Result:
    scenario: str
    mode: str
    device: str
    ranks: int
    reproduced: bool
    failure: str | None
    detected: bool  # every expected code is among the scan's codes
    fixed: bool
    trained: bool
    seconds: float
    ok: bool  # the mode did what it promises
    attempts: int
    expected_codes: tuple[str, ...]
    codes: tuple[str, ...]  # every code the scan reported
    loss: float | None
    details: dict[str, Any]
    workdir: str | None  # where the run's files are, when they were kept

    def to_dict(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "mode": self.mode,
            "device": self.device,
            "ranks": self.ranks,
            "reproduced": self.reproduced,
            "failure": self.failure,
            "detected": self.detected,
            "fixed": self.fixed,
            "trained": self.trained,
            "seconds": round(self.seconds, 2),
            "ok": self.ok,
            "attempts": self.attempts,
            "expected_codes": list(self.expected_codes),
            "codes": list(self.codes),
            "loss": self.loss,
            "details": self.details,
            "workdir": self.workdir,
        }


def verdict(mode: str, observation: Observation, detected: bool, clean: bool) -> bool:
    """reproduce: the failure happened and scan named it; verify: no failure under the same
    load, scan clean of the scenario's codes, and training finished with a finite loss."""
    if mode == "reproduce":
        return observation.reproduced and detected
    return observation.fixed and not observation.reproduced and clean and observation.trained
