"""Repair: build a plan from a scan's findings, then apply it under a lock, journaled, undoably.

README, "Repairing: fix and undo". The shape follows huggingface_hub's cache manager: `build_plan` returns a frozen
`Plan` (actions, `expected_freed_size`, `bytes_rewritten`) that changes nothing until its
`execute()` runs. Every change is journaled in `<cache>/.cachedoctor/journal.sqlite` before it
happens, every replaced or removed file is kept in `<cache>/.cachedoctor/quarantine/<run>/`, and
`undo_run` puts a run back byte for byte. Importing this package does not import torch.
"""

from __future__ import annotations

from cachedoctor.repair.plan import Action, Note, Plan, build_plan
from cachedoctor.repair.session import recover_caches
from cachedoctor.repair.undo import undo_run

__all__ = ["Action", "Note", "Plan", "build_plan", "recover_caches", "undo_run"]
