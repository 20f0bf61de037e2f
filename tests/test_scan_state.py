"""What a scan learns while it reads (zip templates, twins' verdicts, folder listings, the
unpickler's copy budget) belongs to that scan: two scans in one process, in threads or one
after the other with other options, never see each other's."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

import cachedoctor.engine as engine
import cachedoctor.formats as formats
from cachedoctor.fixtures import retained_batch

from conftest import by_code, scan_paths

pytest.importorskip("torch")

STRICT = {"CD201": {"min-ratio": 1000.0}}  # no saved batch is that much bigger: CD201 stays quiet


def twins(cache: Path, batches: int = 3) -> Path:
    """Row i of every batch holds the same data.pkl: files of one layout, twins across
    batches. Two caches built alike hold byte-identical files (and one dataset name)."""
    for seed in range(batches):
        retained_batch.build(cache, batch_size=4, seed=seed, name=f"b{seed}")
    return cache


def test_two_threads_scanning_with_other_options_each_get_their_own_report(
        tmp_path: Path, monkeypatch) -> None:
    a, b = twins(tmp_path / "a" / "cache"), twins(tmp_path / "b" / "cache")
    alone = {a: scan_paths(a), b: scan_paths(b, settings=STRICT)}
    assert len(by_code(alone[a], "CD201")) == 12 and by_code(alone[b], "CD201") == []
    # The two scans read file for file in lockstep: whatever one learns from a file is there
    # before the other reads its own twin of it, which a shared cache would then hand over.
    lockstep = threading.Barrier(2, timeout=30)
    real = engine.read_entry

    def read(entry, deep, *rest):
        if threading.current_thread() is not threading.main_thread():
            lockstep.wait()
        return real(entry, deep, *rest)

    monkeypatch.setattr(engine, "read_entry", read)
    together: dict[Path, object] = {}
    errors: list[BaseException] = []

    def run(cache: Path, **options) -> None:
        try:
            together[cache] = scan_paths(cache, **options)
        except BaseException as exc:  # shown by the assertion below, not lost in the thread
            errors.append(exc)
            lockstep.abort()

    threads = [threading.Thread(target=run, args=(a,)),
               threading.Thread(target=run, args=(b,), kwargs={"settings": STRICT})]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert together == alone


def test_a_template_learnt_in_one_scan_is_not_used_by_the_next(tmp_path: Path,
                                                               monkeypatch) -> None:
    first, second = twins(tmp_path / "one", batches=1), twins(tmp_path / "two", batches=1)
    parsed: list[str] = []
    real = formats.read_directory

    def parse(src):
        parsed.append("parsed")
        return real(src)

    monkeypatch.setattr(formats, "read_directory", parse)
    scan_paths(first)
    once = len(parsed)
    assert 1 <= once < 4  # four files of one layout: the scan's later reads matched its template
    parsed.clear()
    scan_paths(second)  # the same layout, in a new scan: parsed again as often, not matched
    assert len(parsed) == once


def test_a_pickle_s_copy_budget_is_its_own_load_s(monkeypatch) -> None:
    """Calls charged outside a load count against nothing, and a load starts from zero
    however much the previous one copied."""
    import pickle

    from cachedoctor.formats import unpickler

    monkeypatch.setattr(unpickler, "MAX_COPIED_BYTES", 1000)
    unpickler._charge("x" * 5000)  # outside any load: no error, nothing carried over
    one = pickle.dumps({"a": set(range(10))}, protocol=2)  # builtins.set(list): 640 bytes
    for _ in range(3):  # under the budget every time, over it if the loads added up
        assert unpickler.load_restricted(one).obj["a"] == set(range(10))
    two = pickle.dumps([set(range(10)), set(range(11))], protocol=2)
    with pytest.raises(unpickler.UnpickleError, match="copy more than"):
        unpickler.load_restricted(two)  # one load over it: refused


def test_folder_listings_belong_to_one_resolve(tmp_path: Path) -> None:
    from cachedoctor.layouts import common

    with common.one_listing_each():
        assert common.names(str(tmp_path)) == ()
        (tmp_path / "new").mkdir()
        assert common.names(str(tmp_path)) == ()  # within one resolve, a folder is listed once
        elsewhere: list[tuple[str, ...]] = []
        thread = threading.Thread(target=lambda: elsewhere.append(common.names(str(tmp_path))))
        thread.start()
        thread.join()
        assert elsewhere == [("new",)]  # a resolve in another thread lists for itself
    assert common.names(str(tmp_path)) == ("new",)  # and so does the next one
