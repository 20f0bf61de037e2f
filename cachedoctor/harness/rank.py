"""What one rank of a harness run works with: its RankContext (rank, group, project, notes), and
the helpers its process and the scenarios share. The process itself is rank_process.py.

A rank joins the group (gloo on the CPU; nccl when every rank has a GPU of its own), runs its
scenario's `run_rank`, and writes what it observed to `rank<k>-<tag>.json` as it goes, so that a
rank the launcher terminates still tells what it saw. An exception is recorded with the time it
was raised; the launcher takes the earliest as the failure.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from cachedoctor.harness.project import Project, shard

T = TypeVar("T")
GROUP_TIMEOUT = datetime.timedelta(seconds=60)


@dataclass
class RankContext:
    rank: int
    world: int
    mode: str  # "reproduce" runs the buggy pipeline, "verify" the fixed one
    device: torch.device
    backend: str
    project: Project
    result_path: Path
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def buggy(self) -> bool:
        return self.mode == "reproduce"

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def gpu_stand_in(self) -> str | None:
        """On a CPU-only host, the location a GPU rank's storages would carry (`cuda:<rank>`).

        Buggy writers tag their files with it (fixtures.devices.stored_as), so the files are
        the ones a GPU run writes; on a GPU host the tensors really are there: None.
        """
        return f"cuda:{self.rank}" if self.device.type == "cpu" else None

    def note(self, **observed: Any) -> None:
        """Record observations; written through at once, in case this rank is terminated."""
        self.notes.update(observed)
        write_result(self.result_path, {"rank": self.rank, "notes": self.notes})

    def barrier(self) -> None:
        dist.barrier()

    def shard(self, items: Sequence[T]) -> list[T]:
        return shard(items, self.rank, self.world)

    def all_reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        """Average `tensor` over the ranks, in place (via the CPU when gloo carries CUDA tensors)."""
        staged = tensor.cpu() if self.backend == "gloo" and tensor.is_cuda else tensor
        dist.all_reduce(staged)
        staged /= self.world
        if staged is not tensor:
            tensor.copy_(staged)
        return tensor

    def all_reduce_min(self, value: int) -> int:
        count = torch.tensor([value], dtype=torch.int64,
                             device=self.device if self.backend == "nccl" else "cpu")
        dist.all_reduce(count, op=dist.ReduceOp.MIN)
        return int(count.item())


def backend_for(device: str, world: int) -> str:
    """nccl needs one GPU per rank ("Duplicate GPU detected" otherwise); else gloo."""
    if device == "cuda" and world <= torch.cuda.device_count():
        return "nccl"
    return "gloo"


def write_result(path: Path, data: dict[str, Any]) -> None:
    temp = path.with_name(path.name + ".tmp")
    temp.write_text(json.dumps(data, default=str))
    os.replace(temp, path)


def describe(exc: BaseException) -> str:
    """`Type: message`, as the last line of a traceback shows it (`Type` alone with no message)."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__

