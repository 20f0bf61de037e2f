"""The scenarios, one per incident of docs/incidents.md, registered in one plain table.

A scenario module holds `NAME`, `SUMMARY`, `INCIDENT`, `EXPECTED` (the codes `scan` must report
on what its buggy mode leaves), `ATTEMPTS` (how many launches a race may take), and:

- `prepare(root, ranks, mode) -> Project`: write the SimpleTuner project (parent; no torch);
- `run_rank(ctx)`: what each rank does, noting what it sees (rank process; torch);
- `observe(mode, launch) -> Observation`: what happened, from the ranks' notes (parent).

Modules import torch inside `run_rank` only, so that listing and judging stay light.
"""

from __future__ import annotations

import importlib
from types import ModuleType

SCENARIOS: dict[str, str] = {
    "embed-write-race": "embed_write_race",
    "clear-each-epoch": "clear_each_epoch",
    "device-mismatch": "device_mismatch",
    "retained-batch": "retained_batch",
    "dir-overlap": "dir_overlap",
}


def load_scenario(name: str) -> ModuleType:
    return importlib.import_module(f"{__name__}.{SCENARIOS[name]}")
