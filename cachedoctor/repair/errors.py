"""The one base of every expected repair failure: its message says what went wrong, and the
action it hit is rolled back and reported while the run goes on."""

from __future__ import annotations


class RepairError(Exception):
    """An action cannot be done, or its result failed verification."""
