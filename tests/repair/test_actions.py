"""Each action on the fixture of its defect: the rescan is clean, rewritten tensors are
bit-identical, the quarantine keeps every original, and undo restores the tree byte for byte."""

from __future__ import annotations

import gzip
import io
import os
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from repair_helpers import (
    MARKER,
    every_fixable_defect,
    fix_in_process,
    isolated_state,  # noqa: F401
    kept_copy,
    kept_digest,
    quarantine_of,
    tree_digest,
)

from cachedoctor.fix_kinds import COMPACT, QUARANTINE, TO_CPU
from cachedoctor.fixtures import BUILDERS, clean, mixed_devices, retained_batch, unsafe_pickle
from cachedoctor.fixtures.devices import stored_as
from cachedoctor.fixtures.latents import latent_batch, to_bytes
from cachedoctor.repair import undo_run
from cachedoctor.repair.journal import DONE, Journal
from cachedoctor.repair.rewrite import difference

from conftest import by_code, scan_paths

CASES = [
    ("CD101", {"how": "mid_entry"}, QUARANTINE),
    ("CD101", {"how": "before_directory"}, QUARANTINE),
    ("CD101", {"how": "gzip"}, QUARANTINE),
    ("CD101", {"how": "legacy"}, QUARANTINE),
    ("CD101", {"how": "safetensors"}, QUARANTINE),
    ("CD101", {"how": "npz"}, QUARANTINE),
    ("CD101", {"how": "zeroed"}, QUARANTINE),
    ("CD102", {}, QUARANTINE),
    ("CD103", {}, QUARANTINE),
    ("CD104", {"how": "atomicwrites"}, QUARANTINE),
    ("CD104", {"how": "dot_tmp"}, QUARANTINE),
    ("CD104", {"how": "lock"}, QUARANTINE),
    ("CD106", {}, QUARANTINE),
    ("CD201", {"container": "zip"}, COMPACT),
    ("CD201", {"container": "gzip"}, COMPACT),
    ("CD201", {"container": "legacy"}, COMPACT),
    ("CD201", {"container": "gzip", "key": "latents", "dtype": "bfloat16"}, COMPACT),
    ("CD501", {"location": "cuda:0"}, TO_CPU),
    ("CD501", {"location": "cuda:3"}, TO_CPU),
    ("CD501", {"location": "xpu:0"}, TO_CPU),
    ("CD502", {}, TO_CPU),
    ("CD502", {"across_files": True}, TO_CPU),
]


def load(path: Path) -> object:
    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")


@pytest.mark.parametrize(("code", "options", "kind"), CASES, ids=lambda v: str(v))
def test_action_fixes_its_finding_and_undo_restores_the_tree(code: str, options: dict, kind: str,
                                                             cache: Path) -> None:
    clean.build(cache / "clean", n=2)
    broken = BUILDERS[code](cache, **options)
    before = tree_digest(cache)
    assert by_code(scan_paths(cache, deep=True), code)

    plan, result = fix_in_process(cache)

    assert {a.kind for a in plan.actions} == {kind}
    assert {a.path for a in plan.actions} == {str(p) for p in broken}
    assert not result.failed and all(o.state == DONE for o in result.outcomes)
    assert not by_code(scan_paths(cache, deep=True), code)
    kept = quarantine_of(cache, result.run_id)
    for path in broken:
        original = kept_copy(cache, result.run_id, path.relative_to(cache))
        assert tree_digest(original.parent)[original.name] == before[str(path.relative_to(cache))]
        if kind == QUARANTINE:
            assert not path.exists()
        else:  # compact and to-cpu are lossless: same object, same bits
            assert difference(load(original), load(path), same_storages=kind == TO_CPU) is None
            assert path.read_bytes()[:2] == original.read_bytes()[:2]  # same container
            assert path.stat().st_mode == original.stat().st_mode
    if kind == COMPACT:
        assert all(p.stat().st_size < kept_copy(cache, result.run_id, p.relative_to(cache)).stat().st_size
                   for p in broken)

    [undone] = undo_run(result.run_id, [str(cache)])
    assert undone.restored == len(plan.actions) and not undone.conflicts
    assert tree_digest(cache) == before
    assert not any(kept.rglob("*")), "undo leaves nothing in the run's quarantine"


@pytest.mark.parametrize("how", unsafe_pickle.HOWS)
def test_hostile_files_are_quarantined_without_being_loaded(how: str, cache: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    marker = cache.parent / MARKER
    [hostile] = unsafe_pickle.build(cache, marker=marker, how=how)
    loads: list[object] = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(a) or pytest.fail("loaded"))
    before = tree_digest(cache)

    plan, result = fix_in_process(cache)

    # (an npz's object array is also CD101: a trainer's np.load refuses it)
    expected = ("CD101", "CD105") if how == "npz" else ("CD105",)
    assert [(a.kind, a.codes) for a in plan.actions] == [(QUARANTINE, expected)]
    assert not hostile.exists() and not result.failed
    assert not loads and not marker.exists()
    undo_run(result.run_id, [str(cache)])
    assert tree_digest(cache) == before and not marker.exists()


def test_a_hostile_view_of_a_batch_is_quarantined_not_compacted(cache: Path) -> None:
    marker = cache.parent / MARKER
    batch = latent_batch(4)
    row = batch[2]
    row.meta = unsafe_pickle.Payload(marker)  # CD105 and CD201 in one file
    path = cache / "hostile_view.pt"
    path.write_bytes(to_bytes(row))
    assert {f.code for f in scan_paths(cache).findings} == {"CD105", "CD201"}

    plan, result = fix_in_process(cache)

    assert [(a.kind, a.codes) for a in plan.actions] == [(QUARANTINE, ("CD105", "CD201"))]
    assert not path.exists() and not marker.exists() and not result.failed


def test_a_rewrite_refuses_a_file_with_unsafe_globals_even_when_cd105_is_not_selected(cache: Path) -> None:
    marker = cache.parent / MARKER
    row = latent_batch(4)[1]
    row.meta = unsafe_pickle.Payload(marker)
    path = cache / "hostile_view.pt"
    path.write_bytes(to_bytes(row))
    before = tree_digest(cache)

    report = scan_paths(cache, select=("CD201",))
    from cachedoctor.repair import build_plan

    plan = build_plan(report, [str(cache)])
    result = plan.execute()

    assert [a.kind for a in plan.actions] == [COMPACT]
    [failed] = result.failed
    assert "CD105" in failed.message and "never loaded" in failed.message
    assert tree_digest(cache) == before and not marker.exists()


def test_a_rewrite_refuses_a_zip_with_a_hostile_case_twin_of_its_pickle(cache: Path) -> None:
    """torch finds zip members ignoring case: beside a benign `archive/data.pkl` that the check
    reads, torch may load a hostile `archive/DATA.PKL`."""
    import pickle
    import zipfile

    marker = cache.parent / MARKER
    benign = zipfile.ZipFile(io.BytesIO(to_bytes(latent_batch(4)[1])))  # CD201
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as twin:
        for info in benign.infolist():
            twin.writestr(info, benign.read(info))
            if info.filename.endswith("/data.pkl"):
                twin.writestr(info.filename[:-len("data.pkl")] + "DATA.PKL",
                              pickle.dumps(unsafe_pickle.Payload(marker), protocol=2))
    path = cache / "twin.pt"
    path.write_bytes(out.getvalue())
    before = tree_digest(cache)
    from cachedoctor.repair import build_plan

    report = scan_paths(cache)
    # the scan reads every candidate data.pkl: the twin is an error, never a compactable CD201
    assert {f.code for f in report.findings} >= {"CD105"} and "CD201" not in {f.code for f in report.findings}
    plan = build_plan(report, [str(cache)])
    assert COMPACT not in [a.kind for a in plan.actions]
    plan.execute()
    assert not marker.exists() and not path.exists()  # quarantined as the hostile file it is
    # and the rewrite's own gate refuses it, whatever a plan says (torch_io.checked reads the
    # bytes a compact would hand to torch)
    from cachedoctor.repair.torch_io import Unloadable, checked

    with pytest.raises(Unloadable, match=r"CD105|differ only in case"):
        checked(out.getvalue(), str(path))
    assert tree_digest(cache) != before


def test_every_removed_or_replaced_file_is_in_the_quarantine(cache: Path) -> None:
    every_fixable_defect(cache, cache.parent / MARKER)
    before = tree_digest(cache)

    plan, result = fix_in_process(cache)

    after = tree_digest(cache)
    kept = kept_digest(cache, result.run_id)
    touched = {os.path.relpath(a.path, cache) for a in plan.actions}
    assert not result.failed
    for rel, sha in before.items():
        if after.get(rel) != sha:
            assert rel in touched, f"{rel} changed without an action"
            assert kept.get(rel) == sha, f"{rel}: the original is not in the quarantine"
    assert set(kept) == touched
    assert set(after) <= set(before), "a fix adds no file (without --reencode)"
    assert not (cache.parent / MARKER).exists()
    assert not scan_paths(cache, deep=True).findings


def test_the_journal_records_hashes_before_and_after(cache: Path) -> None:
    [view] = retained_batch.build(cache, rows=[0])
    [tagged] = BUILDERS["CD501"](cache)
    before = tree_digest(cache)

    _, result = fix_in_process(cache)

    after = tree_digest(cache)
    with Journal.open(str(cache)) as journal:
        [run] = journal.runs()
        records = {r.relpath: r for r in journal.actions(result.run_id)}
    assert run.run_id == result.run_id and run.state == DONE
    for path in (view, tagged):
        record = records[path.name]
        assert (record.state, record.sha_before, record.sha_after) == (DONE, before[path.name], after[path.name])


def compact_samples() -> dict[str, object]:
    batch = latent_batch(4, (4, 16, 16))
    small = torch.arange(4096, dtype=torch.float32)
    parameter = torch.nn.Parameter(torch.randn(64, 64, generator=torch.Generator().manual_seed(0))[:2],
                                   requires_grad=True)
    return {
        "shared_views": {"a": batch[1], "b": batch[1][:, :2], "label": 3, "name": "x", "size": (64, 64)},
        "strided": {"t": batch[2].transpose(1, 2), "every_other": batch[3, :, ::2]},
        "nested": [batch[0], (batch[1], batch[1, :, :8]), OrderedDict(k=batch[0][:2])],
        "odd_tensors": {"scalar": small[5], "empty": small[:0], "bool": (small > 3)[:4],
                        "bf16": small.bfloat16()[2:6], "param": parameter},
        "same_tensor_twice": {"a": batch[2], "b": None, "c": [batch[2]]},
    }


@pytest.mark.parametrize("container", ["zip", "gzip", "legacy"])
@pytest.mark.parametrize("sample", list(compact_samples()))
def test_compact_keeps_structure_dtypes_strides_and_sharing(sample: str, container: str, cache: Path) -> None:
    obj = compact_samples()[sample]
    path = cache / f"{sample}.pt"
    path.write_bytes(to_bytes(obj, container))
    original = load(path)

    plan, result = fix_in_process(cache, deep=False)

    assert [a.kind for a in plan.actions] == [COMPACT] and not result.failed
    rewritten = load(path)
    assert difference(original, rewritten, same_storages=False) is None
    assert path.stat().st_size < kept_copy(cache, result.run_id, path.name).stat().st_size
    assert not scan_paths(cache).findings


def test_compact_keeps_shared_storages_shared(cache: Path) -> None:
    batch = latent_batch(4, (4, 16, 16))
    path = cache / "shared.pt"
    path.write_bytes(to_bytes({"a": batch[1], "b": batch[1][:, :2], "c": batch[1][0]}))

    fix_in_process(cache, deep=False)

    loaded = load(path)
    pointers = {t.untyped_storage().data_ptr() for t in loaded.values()}
    assert len(pointers) == 1
    assert loaded["a"].untyped_storage().nbytes() == batch[1].numel() * 2


def test_to_cpu_keeps_every_storage_whole(cache: Path) -> None:
    path = cache / "on_gpu.pt"
    with stored_as("cuda:1"):
        torch.save({"latent": latent_batch(1)[0].clone(), "mask": torch.ones(2)}, path)
    original = load(path)

    plan, _ = fix_in_process(cache, deep=False)

    assert [a.kind for a in plan.actions] == [TO_CPU]
    assert difference(original, load(path), same_storages=True) is None
    assert not scan_paths(cache).findings


def test_a_batch_view_saved_from_a_gpu_is_compacted_onto_the_cpu(cache: Path) -> None:
    path = cache / "view_on_gpu.pt"
    with stored_as("cuda:1"):
        torch.save({"latent": latent_batch(4)[1]}, path)

    plan, _ = fix_in_process(cache, deep=False)

    assert [(a.kind, a.codes) for a in plan.actions] == [(COMPACT, ("CD201", "CD501"))]
    assert not scan_paths(cache).findings


def test_cd502_across_files_rewrites_only_the_off_cpu_files(cache: Path) -> None:
    [tagged] = mixed_devices.build(cache, across_files=True, n=4)
    before = tree_digest(cache)

    plan, _ = fix_in_process(cache)

    assert [(a.path, a.codes) for a in plan.actions] == [(str(tagged), ("CD501", "CD502"))]
    after = tree_digest(cache)
    assert {k for k in before if before[k] != after[k]} == {tagged.name}


def test_nothing_to_fix_is_an_empty_plan_and_changes_nothing(cache: Path) -> None:
    clean.build(cache, n=3)
    before = tree_digest(cache)
    plan, result = fix_in_process(cache)
    assert not plan.actions and not result.outcomes
    assert tree_digest(cache) == before


def test_a_file_reached_through_a_symlinked_folder_is_left_where_it_lives(cache: Path) -> None:
    """The scan follows a symlinked folder; the repair never moves a file out of its real place
    (a broken file behind `cache/linked -> ../outside` stayed a finding, but was quarantined)."""
    outside = cache.parent / "outside"
    outside.mkdir()
    (outside / "precious.pt").write_bytes(os.urandom(100))
    (cache / "linked").symlink_to(outside)
    (cache / "broken.pt").write_bytes(os.urandom(100))
    before = tree_digest(outside)
    plan, result = fix_in_process(cache)
    assert [a.path for a in plan.actions] == [str(cache / "broken.pt")]
    (note,) = [n for n in plan.notes if n.path == str(cache / "linked" / "precious.pt")]
    assert "symlinked folder" in note.message and str(outside) in note.message
    assert tree_digest(outside) == before and not result.failed
