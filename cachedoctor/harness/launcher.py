"""Start N ranks as real processes in one torch.distributed group, the way torchrun does.

Each rank is `python -m cachedoctor.harness.rank_process LAUNCH.json` with RANK, WORLD_SIZE and
LOCAL_RANK in its environment; the group meets through a file store in the run dir (no ports to
collide when tests run side by side). Like torchrun's agent, the launcher tears the whole group
down as soon as one rank fails: a rank that raised writes what it saw to `rank<k>.json` first,
and the others are terminated wherever they are (mid-write included). No torch here: the parent
process stays light.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GRACE_SECONDS = 5.0
POLL_SECONDS = 0.01


@dataclass(frozen=True)
class RankOutcome:
    rank: int
    exit_code: int | None
    error: str | None = None  # "Type: message" of the exception that ended the rank
    error_time: float | None = None
    notes: dict[str, Any] = field(default_factory=dict)  # what the scenario observed on the rank
    terminated: bool = False  # stopped by the launcher because another rank failed
    log: str = ""


@dataclass(frozen=True)
class Launch:
    outcomes: tuple[RankOutcome, ...]
    timed_out: bool
    seconds: float

    @property
    def first_error(self) -> RankOutcome | None:
        """The rank whose exception came first: the cause; later ones are its consequences."""
        failed = [o for o in self.outcomes if o.error]
        return min(failed, key=lambda o: o.error_time or float("inf")) if failed else None

    def notes(self, key: str) -> list[Any]:
        """`key` from every rank that noted it, in rank order."""
        return [o.notes[key] for o in self.outcomes if key in o.notes]


def launch(spec: dict[str, Any], ranks: int, run_dir: Path, timeout: float) -> Launch:
    """Run `spec` (scenario, mode, device, project) on `ranks` processes; wait for all of them."""
    run_dir.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    spec_path = run_dir / f"launch-{tag}.json"
    store = run_dir / f"rendezvous-{tag}"
    spec_path.write_text(json.dumps({**spec, "init_method": store.as_uri(), "run_dir": str(run_dir), "tag": tag}))
    started = time.monotonic()
    procs = []
    for rank in range(ranks):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_RANK": str(rank)}
        env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default with several ranks per host
        if spec["device"] == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU run behaves as on a CPU-only host, GPUs or not
        log = open(run_dir / f"rank{rank}-{tag}.log", "wb")  # noqa: SIM115 (closed below)
        procs.append((subprocess.Popen(
            [sys.executable, "-m", "cachedoctor.harness.rank_process", str(spec_path)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
        ), log))
    terminated: set[int] = set()
    timed_out = False
    try:
        while any(p.poll() is None for p, _ in procs):
            failed = any(p.returncode not in (None, 0) for p, _ in procs)
            timed_out = time.monotonic() - started > timeout
            if failed or timed_out:
                terminated = {r for r, (p, _) in enumerate(procs) if p.poll() is None}
                _tear_down([p for p, _ in procs])
                break
            time.sleep(POLL_SECONDS)
    finally:
        _tear_down([p for p, _ in procs])
        for _, log in procs:
            log.close()
    outcomes = tuple(
        _outcome(rank, p.returncode, run_dir, tag, rank in terminated) for rank, (p, _) in enumerate(procs)
    )
    store.unlink(missing_ok=True)
    return Launch(outcomes, timed_out, time.monotonic() - started)


def _tear_down(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every live rank, then SIGKILL what is left after a grace period (torchrun's way)."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_SECONDS
    for p in live:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _outcome(rank: int, exit_code: int | None, run_dir: Path, tag: str, terminated: bool) -> RankOutcome:
    log = (run_dir / f"rank{rank}-{tag}.log").read_bytes()[-4000:].decode(errors="replace")
    result = run_dir / f"rank{rank}-{tag}.json"
    if not result.exists():  # killed, or died before it could say why
        error = None if terminated else f"rank {rank} exited with code {exit_code} and left no result"
        return RankOutcome(rank, exit_code, error, time.time() if error else None, {}, terminated, log)
    data = json.loads(result.read_text())
    return RankOutcome(rank, exit_code, data.get("error"), data.get("error_time"), data.get("notes", {}),
                       terminated, log)
