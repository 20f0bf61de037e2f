"""One rank of a harness run: `python -m cachedoctor.harness.rank_process LAUNCH.json` (see
launcher.py). It joins the group, runs its scenario's `run_rank` with a RankContext (rank.py),
and exits at once. Kept apart from rank.py, which the scenarios import: this module imports the
scenarios, so the arrow points one way.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from cachedoctor.harness.project import Project
from cachedoctor.harness.rank import GROUP_TIMEOUT, RankContext, backend_for, describe, write_result
from cachedoctor.harness.scenarios import load_scenario


def main(argv: list[str]) -> NoReturn:
    spec = json.loads(Path(argv[1]).read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    result_path = Path(spec["run_dir"]) / f"rank{rank}-{spec['tag']}.json"
    notes: dict[str, Any] = {}
    try:
        backend = backend_for(spec["device"], world)
        device = torch.device("cpu")
        if spec["device"] == "cuda":
            device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
            # Repeatable convolutions, so that a loss compared across two runs can be equal.
            torch.backends.cudnn.deterministic = True
            torch.backends.cudnn.benchmark = False
        # device_id only for nccl: torch 2.1 has no such argument, and gloo needs none
        bound = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, init_method=spec["init_method"], rank=rank, world_size=world,
                                timeout=GROUP_TIMEOUT, **bound)
        ctx = RankContext(rank, world, spec["mode"], device, backend,
                          Project.load(Path(spec["project"])), result_path, notes)
        ctx.note(backend=backend, device=str(device))
        load_scenario(spec["scenario"]).run_rank(ctx)
        ctx.barrier()
        write_result(result_path, {"rank": rank, "notes": notes})
        code = 0
    except BaseException as exc:  # whatever ended the rank is the observation
        when = time.time()
        traceback.print_exc()
        write_result(result_path, {"rank": rank, "notes": notes, "error": describe(exc),
                                   "error_time": when})
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Exit at once, as a crashed trainer does: no group teardown, no joining of writer threads
    # (a daemon writer mid-file leaves that file as a real crash would).
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv)
