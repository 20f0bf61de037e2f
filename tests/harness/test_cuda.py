"""device-mismatch and retained-batch on a GPU: real CUDA tensors, real cuda:N storages.

Skipped without CUDA (CI has none). One rank uses nccl; two ranks use nccl with two GPUs and
gloo on a single GPU (nccl refuses two ranks on one device).
"""

from __future__ import annotations

import math

import pytest
import torch

from cachedoctor.harness.runner import run_scenario

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

RANKS = [1, 2]


def _run(name: str, mode: str, ranks: int, tmp_path):
    result = run_scenario(name, mode, ranks=ranks, device="cuda", workdir=tmp_path, keep=True)
    assert (result.device, result.ranks) == ("cuda", ranks)
    assert result.details["backend"] == ("nccl" if ranks <= torch.cuda.device_count() else "gloo")
    return result


@pytest.mark.parametrize("ranks", RANKS)
def test_device_mismatch_validation_mixes_devices(ranks: int, tmp_path) -> None:
    result = _run("device-mismatch", "reproduce", ranks, tmp_path)
    assert result.reproduced, result.details
    assert "Expected all tensors to be on the same device" in result.failure
    assert {"CD501", "CD502"} <= set(result.codes) and result.ok
    assert "cuda:" in result.details["scan"]["CD501"]["first"]


@pytest.mark.parametrize("ranks", RANKS)
def test_device_mismatch_repaired_on_the_gpu(ranks: int, tmp_path) -> None:
    result = _run("device-mismatch", "verify", ranks, tmp_path)
    assert result.ok and result.fixed and result.trained and result.failure is None, result.details
    assert result.details["before_repair"] == "loads"  # on a GPU host the cuda:N files do load
    assert math.isfinite(result.details["validation_loss"])
    assert result.codes == ()
    fix, writer = result.details["repairs"]  # `cachedoctor fix`, then the corrected writer
    assert "to-cpu" in fix["actions"] and fix["codes_after"] == [] and not fix["failed"]
    assert fix["tensors_identical"] and writer["tensors_identical"] and fix["losses"] == writer["losses"]


@pytest.mark.parametrize("ranks", RANKS)
def test_retained_batch_on_the_gpu(ranks: int, tmp_path) -> None:
    buggy = _run("retained-batch", "reproduce", ranks, tmp_path)
    assert buggy.reproduced and buggy.details["ratio"] == 4.0 and "CD201" in buggy.codes and buggy.ok
    fixed = _run("retained-batch", "verify", ranks, tmp_path)
    assert fixed.ok and fixed.details["ratio"] == 1.0 and fixed.details["tensors_identical"], fixed.details
    assert fixed.loss == fixed.details["loss_before"]
    fix, writer = fixed.details["repairs"]  # `cachedoctor fix`, then the corrected writer
    assert "compact" in fix["actions"] and fix["codes_after"] == [] and not fix["failed"]
    assert fix["losses"] == writer["losses"] == [fixed.details["loss_before"]] * ranks
