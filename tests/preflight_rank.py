"""One rank of tests/test_preflight_distributed.py: `python preflight_rank.py RANK WORLD STORE
CACHE OUT`. Joins a gloo group through a file store, runs `cachedoctor.preflight` twice and
writes what it saw to OUT as JSON: the verdict, the findings, the files this rank read; then
the error of a second preflight in which rank 1 fails inside its share of the files, and the
findings of a third in which the reader raises on one file.

`python preflight_rank.py trees RANK WORLD STORE OUT TARGET...` (tests/test_preflight_reduce.py):
one group preflights each target in turn and writes, per target, every finding (code, path,
message, fingerprint) and the bytes the reduce gathered."""

from __future__ import annotations

import json
import sys

import torch.distributed as dist

import cachedoctor
from cachedoctor import engine


def main(rank: int, world: int, store: str, cache: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    read: list[str] = []
    real_read = engine.read_entry

    def spy(entry, deep, *rest):
        read.append(entry.path)
        return real_read(entry, deep, *rest)

    engine.read_entry = spy
    seen: dict = {"rank": rank}
    try:
        cachedoctor.preflight(cache, jobs=1, isolated=True)
        seen["verdict"] = "passed"
    except cachedoctor.CacheProblems as exc:
        seen.update(verdict="raised", message=str(exc), files=exc.report.files,
                    findings=[(f.code, f.path, f.message) for f in exc.report.findings])
    seen["read"] = read
    engine.read_entry = real_read

    real_check_all_files = engine.check_all_files
    if rank == 1:
        def dying_disk(*args, **kwargs):
            raise OSError(5, "Input/output error")

        engine.check_all_files = dying_disk
    try:
        cachedoctor.preflight(cache, jobs=1, isolated=True)
        seen["failure"] = None
    except Exception as exc:
        seen["failure"] = [type(exc).__name__, str(exc), getattr(exc, "__notes__", [])]
    engine.check_all_files = real_check_all_files

    def buggy_reader(entry, deep, *rest):  # on whichever rank reads it: a finding, not an error
        if entry.path.endswith("empty_file.pt"):
            raise OverflowError("int too large to convert")
        return real_read(entry, deep, *rest)

    engine.read_entry = buggy_reader
    try:
        # (index=False: the index would give the file the verdict of the scan above; a patched
        # reader is no change of cachedoctor's source, which a real bug fix would be)
        cachedoctor.preflight(cache, jobs=1, isolated=True, index=False)
        seen["buggy"] = None
    except cachedoctor.CacheProblems as exc:
        seen["buggy"] = [(f.code, f.path, f.message) for f in exc.report.findings]
    engine.read_entry = real_read
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(seen, f)


def trees(rank: int, world: int, store: str, out: str, targets: list[str]) -> None:
    import os

    from cachedoctor import api
    from cachedoctor.baseline import fingerprint

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    seen = []
    for target in targets:
        report = cachedoctor.preflight(target, fail_on="never", jobs=1, isolated=True)
        base = target if os.path.isdir(target) else os.path.dirname(target)
        seen.append({"target": target, "files": report.files, "exchanged": api._last_exchange[0],
                     "findings": sorted([f.code, f.path, f.message, fingerprint(f, base)]
                                        for f in report.findings)})
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(seen, f)


if __name__ == "__main__":
    if sys.argv[1] == "trees":
        trees(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6:])
    else:
        main(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:6])
