"""Sharded preflight over W gloo ranks: per-rank peak memory and the bytes the ranks exchange.

Builds N latent files (default 200,000; `--unique` distinct files, hard-linked under the other
names: every name is read as a file of its own), 1,000 per folder, where one folder in 50
holds one latent of another shape (a CD301 finding each, so the rules' minority path runs).
Then, each in a fresh process that has imported torch.distributed:
  - W ranks (default 4) of one gloo group run `cachedoctor.preflight` over the whole tree;
  - the baseline: one process scans a quarter of the tree (N / W files, the same folders'
    kind) with `cachedoctor.preflight` and no process group.
`--layout simpletuner`: instead a SimpleTuner project (tests' fixture, scaled) of N/2 images,
every one listed in its bucket file, and their N/2 VAE cache entries (hard links), so the
coverage sketch of every image and entry is reduced too; the baseline is the same project with
N/W files. Reports each rank's peak RSS against the baseline's (target: <= 1.5x), the bytes each rank's
reduce gathered (target: < 5 MB; each rank gathers every rank's aggregates, so it counts the
others' bytes as well as its own), and the findings both found. Every rank runs one reader
process (`jobs=1`), as does the baseline.

    python benchmarks/sharded_preflight.py [--files N] [--world W] [--unique U]
                                           [--layout bare|simpletuner] [--dir DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

PER_DIR = 1000
ODD_EVERY = 50  # one folder in 50 holds an odd latent


def build(root: str, n: int, unique: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(0)
    sources = []
    os.makedirs(os.path.join(root, "sources"), exist_ok=True)
    for i in range(unique):
        path = os.path.join(root, "sources", f"{i:06d}.pt")
        if not os.path.exists(path):
            torch.save(torch.randn(4, 32, 32, generator=gen).half(), path)
        sources.append(path)
    odd = os.path.join(root, "sources", "odd.pt")
    if not os.path.exists(odd):
        torch.save(torch.randn(4, 32, 24, generator=gen).half(), odd)
    for tree, count in (("all", n), ("quarter", n // WORLD)):
        for i in range(count):
            # an aspect-ratio bucket folder each (a bare cache's other folders are no buckets,
            # and CD301 compares shapes within a bucket only)
            folder = os.path.join(root, tree, f"1.{i // PER_DIR:04d}")
            if i % PER_DIR == 0:
                os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, f"{i:08d}.pt")
            if os.path.exists(path):
                continue
            last = i % PER_DIR == PER_DIR - 1 and (i // PER_DIR) % ODD_EVERY == 0
            os.link(odd if last else sources[i % unique], path)


def build_simpletuner(root: str, n: int) -> str:
    """A healthy SimpleTuner project with n images and their n cache entries; its config."""
    from pathlib import Path

    from cachedoctor.fixtures.projects import simpletuner

    project = simpletuner.build(Path(root))
    photos = Path(root) / "datasets" / "photos"
    indices_file = photos / "aspect_ratio_bucket_indices_photos.json"
    metadata_file = photos / "aspect_ratio_bucket_metadata_photos.json"
    indices, metadata = json.loads(indices_file.read_text()), json.loads(metadata_file.read_text())
    cache = Path(root) / "output" / "models" / "cache" / "vae" / simpletuner.FAMILY / "photos"
    # every image of the project with its entry: new names link to them in turn (a file may
    # have at most 65,000 names on ext4)
    originals = [(bucket, image, cache / simpletuner.vae_name(Path(image)))
                 for bucket, images in indices["aspect_ratio_bucket_indices"].items()
                 for image in images]
    for i in range(max(0, n - len(originals))):
        bucket, image, entry = originals[i % len(originals)]
        name = photos / f"more_{i:07d}.png"
        os.link(image, name)
        os.link(entry, cache / simpletuner.vae_name(name))
        indices["aspect_ratio_bucket_indices"][bucket].append(str(name))
        metadata[str(name)] = metadata[image]
    mtime = min(os.stat(image).st_mtime for _, image, _ in originals)
    indices_file.write_text(json.dumps(indices))
    metadata_file.write_text(json.dumps(metadata))
    os.utime(indices_file, (mtime, mtime))  # as old as the images
    os.utime(metadata_file, (mtime, mtime))
    return str(project.config)


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def rank_main(rank: int, world: int, store: str, target: str, out: str) -> None:
    import torch.distributed as dist

    import cachedoctor
    from cachedoctor import api

    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                world_size=world)
    start = time.perf_counter()
    report = cachedoctor.preflight(target, fail_on="never", jobs=1, isolated=True)
    seconds = time.perf_counter() - start
    if world > 1:
        dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump({"rank": rank, "files": report.files, "findings": len(report.findings),
                   "codes": sorted({x.code for x in report.findings}), "seconds": seconds,
                   "peak_mb": _peak_mb(), "exchanged": api._last_exchange[0],
                   "collectives": api._last_exchange[1]}, f)


def _run(world: int, target: str, work: str, tag: str) -> list[dict]:
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(rank), "--world", str(world),
                               "--store", os.path.join(work, f"{tag}.store"), "--target", target,
                               "--out", os.path.join(work, f"{tag}{rank}.json")])
             for rank in range(world)]
    for p in procs:
        if p.wait() != 0:
            raise SystemExit(f"{tag}: a rank exited with {p.returncode}")
    return [json.load(open(os.path.join(work, f"{tag}{rank}.json"))) for rank in range(world)]


WORLD = 4


def main() -> None:
    global WORLD
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=200_000)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--unique", type=int, default=2_000)
    parser.add_argument("--layout", choices=("bare", "simpletuner"), default="bare")
    parser.add_argument("--dir")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--rank", type=int)
    parser.add_argument("--store")
    parser.add_argument("--target")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.world, args.store, args.target, args.out)
        return
    WORLD = args.world
    root = args.dir or tempfile.mkdtemp(prefix="cachedoctor-sharded-")
    try:
        started = time.perf_counter()
        if args.layout == "simpletuner":
            whole = build_simpletuner(os.path.join(root, "all"), args.files // 2)
            quarter = build_simpletuner(os.path.join(root, "quarter"), args.files // 2 // WORLD)
        else:
            build(root, args.files, min(args.unique, args.files))
            whole, quarter = os.path.join(root, "all"), os.path.join(root, "quarter")
        print(f"built {args.files:,} files (+ {args.files // WORLD:,} for the baseline) in "
              f"{time.perf_counter() - started:.0f} s under {root}")
        [baseline] = _run(1, quarter, root, "baseline")
        ranks = _run(WORLD, whole, root, "ranks")
        print(f"baseline: one process, {baseline['files']:,} files: peak RSS "
              f"{baseline['peak_mb']:.0f} MB, {baseline['seconds']:.1f} s, "
              f"{baseline['findings']} findings {baseline['codes']}")
        for r in ranks:
            print(f"rank {r['rank']} of {WORLD}, {r['files']:,} files in all: peak RSS "
                  f"{r['peak_mb']:.0f} MB ({r['peak_mb'] / baseline['peak_mb']:.2f}x the "
                  f"baseline; target <= 1.5x), gathered {r['exchanged'] / 1e6:.3f} MB in "
                  f"{r['collectives']} collectives (target < 5 MB), {r['seconds']:.1f} s, "
                  f"{r['findings']} findings {r['codes']}")
        worst = max(r["peak_mb"] for r in ranks) / baseline["peak_mb"]
        most = max(r["exchanged"] for r in ranks)
        expected = len(range(0, args.files // PER_DIR, ODD_EVERY)) if args.layout == "bare" else 0
        found = {r["findings"] for r in ranks}
        agree = len({json.dumps(r["codes"]) + str(r["findings"]) for r in ranks}) == 1
        print(f"worst rank: {worst:.2f}x the baseline's peak RSS; most gathered: "
              f"{most / 1e6:.3f} MB; CD301 findings expected {expected}, found {sorted(found)}: "
              f"{'every rank agrees' if agree else 'the ranks DISAGREE'}"
              f"{'' if found == {expected} else ' (NOT what was expected)'}")
    finally:
        if not args.keep and not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
