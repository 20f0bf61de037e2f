"""How fast `cachedoctor scan` checks a diffusion-pipe sharded cache, blob by blob.

Builds N latent items (default 10,000 `{"latents": [16, 1, 32, 32] bfloat16}`, about 34 KB each,
as diffusion-pipe's `Cache.add` writes them) into `shard_<n>.bin` files of `--shard-mb` MB with
their `metadata.db`, warms the page cache, then times, best of R:
  - `cachedoctor scan -j 1` on the cache (the real CLI in a subprocess, start-up included),
  - the same scan of an empty dir (its start-up alone),
  - what diffusion-pipe's `Cache.__getitem__` does for every item, in this process: seek, read
    the blob, `torch.load(BytesIO, map_location="cpu")` (here with weights_only=True).

    python benchmarks/diffusion_pipe_scan.py [--items N] [--shard-mb M] [--repeats R] [--keep]
"""

from __future__ import annotations

import argparse
import io
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def build(folder: Path, items: int, shard_mb: int) -> None:
    import torch

    from cachedoctor.fixtures.projects.diffusion_pipe import ShardWriter

    writer = ShardWriter(folder, shard_size=shard_mb * 1_000_000)
    g = torch.Generator().manual_seed(0)
    for _ in range(items):
        writer.add({"latents": torch.randn(16, 1, 32, 32, generator=g).to(torch.bfloat16)})
    writer.close()


def scan_seconds(target: Path) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "cachedoctor", "scan", "-j", "1", "--isolated",
                    "--fail-on", "never", str(target)], check=True, capture_output=True)
    return time.perf_counter() - started


def load_all_seconds(folder: Path) -> float:
    import torch

    con = sqlite3.connect(folder / "metadata.db")
    items = con.execute("SELECT shard, shard_index FROM items").fetchall()
    tables = {}
    for (name,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'"):
        if name.startswith("shard_"):
            tables[int(name[6:])] = con.execute(f"SELECT offset, size FROM {name}").fetchall()
    con.close()
    started = time.perf_counter()
    files = {}
    for shard, index in items:
        offset, size = tables[shard][index]
        f = files.get(shard) or files.setdefault(shard, open(folder / f"shard_{shard}.bin", "rb"))  # noqa: SIM115
        f.seek(offset)
        torch.load(io.BytesIO(f.read(size)), map_location="cpu", weights_only=True)
    for f in files.values():
        f.close()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=10_000)
    parser.add_argument("--shard-mb", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="cd-dpipe-bench-"))
    try:
        cache = work / "cache_1.000000x256x256x1" / "latents"
        empty = work / "empty"
        empty.mkdir()
        build(cache, args.items, args.shard_mb)
        total = sum(p.stat().st_size for p in cache.iterdir())
        shards = len(list(cache.glob("shard_*.bin")))
        load_all_seconds(cache)  # warm the page cache
        scans, starts, loads = [], [], []
        for _ in range(args.repeats):
            scans.append(scan_seconds(work))
            starts.append(scan_seconds(empty))
            loads.append(load_all_seconds(cache))
        scan, start, load = min(scans), min(starts), min(loads)
        n = args.items
        print(f"{n:,} blobs in {shards} shards, {total / 1e6:,.1f} MB; best of {args.repeats}, one process")
        print(f"scan:            {scan:.3f} s  ({n / scan:,.0f} blobs/s; start-up {start:.3f} s)")
        print(f"torch.load loop: {load:.3f} s  ({n / load:,.0f} blobs/s)")
        print(f"scan vs loop: {load / scan:.1f}x as measured")
        if scan > start:  # (a noisy machine can time the empty scan slower)
            print(f"scan less start: {scan - start:.3f} s  ({n / (scan - start):,.0f} blobs/s, "
                  f"{load / (scan - start):.1f}x the loop per blob)")
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
