"""The rule catalogue: one module per rule, registered here in one table.

Codes are a public contract (DESIGN.md §4): never renumber, only add.
"""

from __future__ import annotations

from cachedoctor.checks import (
    checksum_mismatch,
    empty_file,
    foreign_file,
    interrupted_write,
    io_error,
    mixed_devices,
    non_finite_values,
    retained_batch_storage,
    tensors_on_accelerator,
    unreadable_archive,
    unsafe_pickle,
)
from cachedoctor.rule import Rule

RULES: dict[str, Rule] = {
    module.RULE.code: module.RULE
    for module in (
        io_error,
        unreadable_archive,
        empty_file,
        checksum_mismatch,
        interrupted_write,
        unsafe_pickle,
        non_finite_values,
        foreign_file,
        retained_batch_storage,
        tensors_on_accelerator,
        mixed_devices,
    )
}


def get(code: str) -> Rule | None:
    """The rule with this code, or with this name (`retained-batch-storage`)."""
    code = code.strip()
    return RULES.get(code.upper()) or next((r for r in RULES.values() if r.name == code), None)
