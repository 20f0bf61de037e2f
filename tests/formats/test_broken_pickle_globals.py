"""A pickle that breaks (cut off, damaged, rejected by the guard) still names its payload."""

from __future__ import annotations

import os
import pickle

import pytest

from cachedoctor.formats import read_bytes
from cachedoctor.formats.unpickler import UnpickleError, load_restricted, scan_globals


class Payload:
    def __reduce__(self):
        return os.system, ("touch /nonexistent/cachedoctor-marker",)


@pytest.mark.parametrize("protocol", range(6))
def test_scan_globals_reads_every_protocol(protocol: int) -> None:
    data = pickle.dumps({"a": [1, (2, "x")], "b": Payload(), "c": Payload()}, protocol=protocol)
    assert scan_globals(data) == (["posix.system"], ["posix.system"])


@pytest.mark.parametrize("protocol", range(6))
def test_cut_off_pickle_keeps_the_payload_global(protocol: int) -> None:
    data = pickle.dumps([Payload(), list(range(1000))], protocol=protocol)
    cut = data[: len(data) - 40]
    with pytest.raises(UnpickleError) as info:
        load_restricted(cut)
    assert "posix.system" in info.value.unsafe_globals
    meta = read_bytes(cut, "x.pkl")
    assert meta.errors and "posix.system" in meta.unsafe_globals


def test_payload_after_an_unreadable_part_is_still_found() -> None:
    torch = pytest.importorskip("torch")
    # pickle.dumps of a tensor goes through torch.storage._load_from_bytes; the payload follows
    data = pickle.dumps({"latent": torch.zeros(2, 2), "meta": Payload()}, protocol=2)
    meta = read_bytes(data, "x.pkl")
    assert "posix.system" in meta.unsafe_globals
