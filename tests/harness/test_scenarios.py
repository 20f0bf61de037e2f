"""Every scenario in both modes, on the CPU with 2 real ranks: the observed failure, the codes
scan reports, and the training result.

Each (scenario, mode) runs once per session; its tests read the same Result and files. The
tests marked `awaits #3` need the SimpleTuner layout rules CD401/CD403/CD404. verify of
retained-batch and device-mismatch repairs the buggy cache twice in turn, with `cachedoctor
fix` and with the corrected writer (harness/repair.py), and shows both give the same cache.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from cachedoctor.harness.project import Project
from cachedoctor.harness.result import Result
from cachedoctor.harness.runner import run_scenario
from cachedoctor.harness.scenarios import SCENARIOS, clear_each_epoch, embed_write_race

RANKS = 2
SCENARIO_SECONDS = 60


@pytest.fixture(scope="session")
def run(tmp_path_factory):
    results: dict[tuple[str, str], Result] = {}

    def get(name: str, mode: str) -> Result:
        if (name, mode) not in results:
            workdir = tmp_path_factory.mktemp(f"{name}-{mode}")
            results[name, mode] = run_scenario(name, mode, ranks=RANKS, device="cpu", workdir=workdir, keep=True)
        return results[name, mode]

    return get


def project_of(result: Result) -> Project:
    assert result.workdir is not None
    return Project.load(Path(result.workdir) / "project.json")


def finished(result: Result) -> None:
    """Verify's promise: no failure, scan clean of the scenario's codes, a finite loss."""
    assert result.failure is None, result.failure
    assert not result.reproduced and result.fixed
    assert not set(result.expected_codes) & set(result.codes), result.details["scan"]
    assert result.trained and result.loss is not None and math.isfinite(result.loss)
    assert result.ok


@pytest.mark.parametrize("mode", ["reproduce", "verify"])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_each_run_is_quick_and_says_what_it_ran(run, name: str, mode: str) -> None:
    result = run(name, mode)
    assert (result.scenario, result.mode, result.device, result.ranks) == (name, mode, "cpu", RANKS)
    assert result.details["backend"] == "gloo"
    assert result.seconds < SCENARIO_SECONDS


# embed-write-race


def test_embed_write_race_readers_see_half_written_archives(run) -> None:
    result = run("embed-write-race", "reproduce")
    assert result.reproduced, result.details
    assert any(s in result.failure for s in embed_write_race.HALF_WRITTEN), result.failure
    assert result.details["writer_error"] == (
        "UnboundLocalError: cannot access local variable 'batch' where it is not associated with a value")
    assert 1 <= result.attempts <= embed_write_race.ATTEMPTS
    assert not result.trained


def test_embed_write_race_leaves_torn_files_that_scan_names_cd101(run) -> None:
    result = run("embed-write-race", "reproduce")
    assert result.detected and "CD101" in result.codes and result.ok
    project = project_of(result)
    torn = [p for p in project.text_cache_dir.iterdir() if not _loads(p)]
    assert torn, "the teardown should leave half-written files"
    # a writer killed before its first byte leaves an empty file: CD102 (empty-file), not CD101
    scan = result.details["scan"]
    assert sum(scan.get(code, {}).get("count", 0) for code in ("CD101", "CD102")) == len(torn)


def test_embed_write_race_fixed_writer_survives_the_same_load(run) -> None:
    result = run("embed-write-race", "verify")
    finished(result)
    assert result.details["rounds"] == embed_write_race.ROUNDS
    assert result.details["corrupt_files"] == 0 and result.details["temp_files"] == 0
    assert result.details["writer_alive_after_empty_poll"] and result.details["writer_error"] is None
    project = project_of(result)
    assert all(_loads(p) for p in project.text_cache_dir.iterdir())
    assert result.codes == ()


# clear-each-epoch


def test_clear_each_epoch_ranks_delete_each_others_latents(run) -> None:
    result = run("clear-each-epoch", "reproduce")
    assert result.reproduced, result.details
    assert result.failure.startswith(
        "Exception: (id=photos) Some images were not correctly cached during the VAE Cache operations. "
        "Ensure --skip_file_discovery=vae is not set.\nProblematic images: ['")
    assert 1 <= result.attempts <= clear_each_epoch.BOUNDARIES
    assert not result.trained
    project = project_of(result)
    images = sorted(project.image_dir.glob("*.png"))
    assert [i for i in images if not project.vae_cache_path(i).exists()], "the cache should have holes"


def test_clear_each_epoch_scan_names_the_option_and_the_holes(run) -> None:  # awaits #3
    result = run("clear-each-epoch", "reproduce")
    assert {"CD403", "CD404"} <= set(result.codes), result.details["scan"]
    assert result.detected and result.ok


def test_clear_each_epoch_without_clearing_keeps_every_entry(run) -> None:
    result = run("clear-each-epoch", "verify")
    finished(result)
    assert result.details["missing_entries"] == 0
    project = project_of(result)
    assert all(project.vae_cache_path(i).exists() for i in project.image_dir.glob("*.png"))


# device-mismatch


def test_device_mismatch_gpu_saved_files_fail_to_load_on_a_cpu_host(run) -> None:
    result = run("device-mismatch", "reproduce")
    assert result.reproduced
    # the error itself, or (torch 2.4) the same text wrapped in an UnpicklingError
    assert result.failure.startswith(("RuntimeError: ", "UnpicklingError: "))
    assert "Attempting to deserialize object on a CUDA device but torch.cuda.is_available() is False" in result.failure
    assert not result.trained


def test_device_mismatch_scan_names_gpu_and_mixed_tensors(run) -> None:
    result = run("device-mismatch", "reproduce")
    assert {"CD501", "CD502"} <= set(result.codes) and result.detected and result.ok
    images = len(list(project_of(result).image_dir.glob("*.png")))
    assert result.details["scan"]["CD501"]["count"] == images
    assert "cuda:" in result.details["scan"]["CD501"]["first"]


def test_device_mismatch_repaired_cache_loads_and_validates(run) -> None:
    result = run("device-mismatch", "verify")
    finished(result)
    assert "Attempting to deserialize object on a CUDA device" in result.details["before_repair"]
    assert math.isfinite(result.details["validation_loss"])
    assert result.codes == ()


def test_device_mismatch_cachedoctor_fix_and_the_corrected_writer_give_one_cache(run) -> None:
    result = run("device-mismatch", "verify")
    images = len(list(project_of(result).image_dir.glob("*.png")))
    fix, writer = result.details["repairs"]
    assert (fix["how"], writer["how"]) == ("cachedoctor fix", "corrected writer")
    # every file held a cuda:N latent beside CPU conditioning: rewritten on the CPU, lossless
    assert fix["actions"] == {"to-cpu": images} and not fix["failed"] and fix["codes_after"] == []
    assert fix["tensors_identical"] and writer["tensors_identical"]
    assert fix["losses"] == writer["losses"] and len(fix["losses"]) == RANKS
    assert math.isfinite(fix["validation_loss"]) and fix["validation_loss"] == writer["validation_loss"]


# retained-batch


def test_retained_batch_files_hold_their_whole_vae_batch(run) -> None:
    result = run("retained-batch", "reproduce")
    assert result.reproduced and result.details["ratio"] == 4.0  # --vae_batch_size 4
    assert "(x4.0)" in result.failure
    # the bytes on disk per latent byte, pickle and zip records included, is its own ratio
    disk = result.details["disk_bytes"] / result.details["latent_bytes"]
    assert result.details["disk_ratio"] == round(disk, 2) > 4.0
    assert f"(x{disk:.2f} on disk)" in result.failure
    assert result.trained  # the files load and train: only their size is wrong
    scan = result.details["scan"]
    assert set(result.codes) == {"CD201"} and result.detected and result.ok
    assert scan["CD201"]["count"] == len(list(project_of(result).image_dir.glob("*.png")))
    assert "(x4.0)" in scan["CD201"]["first"]


def test_retained_batch_repair_is_lossless(run) -> None:
    buggy, fixed = run("retained-batch", "reproduce"), run("retained-batch", "verify")
    finished(fixed)
    assert fixed.details["ratio"] == 1.0 and fixed.details["before_ratio"] == 4.0
    assert fixed.details["disk_bytes"] < fixed.details["before_disk_bytes"] / 2
    assert fixed.details["tensors_identical"]
    assert fixed.loss == fixed.details["loss_before"] == buggy.loss  # bit-identical training
    assert fixed.codes == ()


def test_retained_batch_cachedoctor_fix_and_the_corrected_writer_give_one_cache(run) -> None:
    buggy, fixed = run("retained-batch", "reproduce"), run("retained-batch", "verify")
    images = len(list(project_of(fixed).image_dir.glob("*.png")))
    fix, writer = fixed.details["repairs"]
    assert (fix["how"], writer["how"]) == ("cachedoctor fix", "corrected writer")
    assert fix["actions"] == {"compact": images} and not fix["failed"] and fix["codes_after"] == []
    for step in (fix, writer):
        assert step["ratio"] == 1.0 and step["tensors_identical"], step
        assert step["losses"] == [buggy.loss] * RANKS  # the loss of the clean cache, on every rank
    assert fix["disk_bytes"] == writer["disk_bytes"] < fixed.details["before_disk_bytes"] / 2
    # the fix went through the journal, as a user's `cachedoctor fix` does
    assert (project_of(fixed).vae_cache_dir / ".cachedoctor" / "journal.sqlite").exists()


# dir-overlap


def test_dir_overlap_cache_files_become_samples_and_a_batch_mixes_shapes(run) -> None:
    result = run("dir-overlap", "reproduce")
    assert result.reproduced
    assert result.failure.startswith("RuntimeError: stack expects each tensor to be equal size, but got [4, ")
    assert result.details["samples_found_at_restart"] == 2 * result.details["images"]
    assert not result.trained


def test_dir_overlap_scan_names_the_overlap(run) -> None:  # awaits #3
    result = run("dir-overlap", "reproduce")
    assert "CD401" in result.codes, result.details["scan"]
    assert result.detected and result.ok


def test_dir_overlap_separate_dirs_train(run) -> None:
    result = run("dir-overlap", "verify")
    finished(result)
    assert result.details["samples_found_at_restart"] == result.details["images"]
    assert result.codes == ()


# one rank


@pytest.mark.parametrize("name", ["embed-write-race", "clear-each-epoch"])
def test_the_races_need_several_ranks(name: str, tmp_path: Path) -> None:
    """"Fine on one GPU" (docs/incidents.md, #1 and #2): with one rank nobody writes or deletes another's files."""
    result = run_scenario(name, "reproduce", ranks=1, device="cpu", workdir=tmp_path, keep=False)
    assert not result.reproduced and result.failure is None, result.details
    assert result.trained and not result.codes


def _loads(path: Path) -> bool:
    try:
        torch.load(path, weights_only=True, map_location="cpu")
    except Exception:
        return False
    return True
