"""What the incremental index saves, against a bare walk measured in the same run.

Builds N small latent files (default 200,000 copies of one 4x8x8 fp16 safetensors latent, 1,000
per folder (--per-dir), made an hour old: the index records no file modified in the 2 s before a scan),
warms the page cache, then times, in this process (`engine.scan`, every core):
  - walk:         os.scandir over the tree and an os.stat of every file (the floor a rescan
                  that must stat every file cannot beat),
  - scan:         a first scan without the index (`index=False`),
  - scan+index:   a first scan that builds the index (its .cachedoctor/ removed before each),
  - rescan:       a scan of the unchanged tree with the index built,
best of R (default 3), interleaved. Targets (issue #14): rescan within 2x of the walk; the first
scan with the index no more than 10% slower than without. Also: a rescan after 1% of the files
were touched (read again), and the index's size on disk.

    python benchmarks/index_rescan.py [--files N] [--per-dir N] [--repeats R] [--jobs J]
                                      [--dir DIR] [--keep] [--reuse]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import struct
import sys
import tempfile
import time

PER_DIR = 1000


def latent_bytes() -> bytes:
    """A safetensors file of one [4, 8, 8] float16 tensor (`latents`), written by hand (the
    format is a length, a JSON header and the raw bytes)."""
    data = bytes(4 * 8 * 8 * 2)
    header = json.dumps({"latents": {"dtype": "F16", "shape": [4, 8, 8],
                                     "data_offsets": [0, len(data)]}}).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + data


def build(root: str, n: int, per_dir: int = PER_DIR) -> None:
    blob = latent_bytes()
    past = time.time() - 3600
    for start in range(0, n, per_dir):
        folder = os.path.join(root, "latents", f"{start // per_dir:04d}")
        os.makedirs(folder)
        for i in range(start, min(n, start + per_dir)):
            path = os.path.join(folder, f"img_{i:07d}.safetensors")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.write(fd, blob)
                os.utime(fd, (past, past))
            finally:
                os.close(fd)


def first_files(root: str, count: int) -> list[str]:
    """The first `count` (at least one) files of the tree, by folder and name."""
    found: list[str] = []
    for folder in sorted(os.listdir(os.path.join(root, "latents"))):
        path = os.path.join(root, "latents", folder)
        found += [os.path.join(path, n) for n in sorted(os.listdir(path))[:max(1, count) - len(found)]]
    return found


def walk(root: str) -> int:
    files, stack = 0, [root]
    while stack:
        with os.scandir(stack.pop()) as listing:
            for child in listing:
                if child.is_dir(follow_symlinks=False):
                    if child.name != ".cachedoctor":
                        stack.append(child.path)
                else:
                    os.stat(child.path)
                    files += 1
    return files


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=None)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--per-dir", type=int, default=PER_DIR,
                        help="files per folder (a kohya or SimpleTuner cache may hold 100,000)")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--reuse", action="store_true",
                        help="time the tree a --keep run left in --dir (another commit's code "
                             "on the same files: PYTHONPATH=<its checkout>)")
    args = parser.parse_args()

    from cachedoctor import engine
    from cachedoctor.options import ScanOptions

    base = args.dir or tempfile.mkdtemp(prefix="cachedoctor-index-bench-")
    root = os.path.join(base, "cache")
    state = os.path.join(root, ".cachedoctor")
    try:
        if args.reuse and os.path.isdir(root):
            shutil.rmtree(state, ignore_errors=True)
            for path in first_files(root, args.files // 100):  # (the last run's 1% touched)
                os.utime(path, (time.time() - 3600,) * 2)
        else:
            t, _ = timed(lambda: build(root, args.files, args.per_dir))
            print(f"built {args.files:,} files in {t:.1f} s ({root})", file=sys.stderr)
        options = ScanOptions() if args.jobs is None else ScanOptions(jobs=args.jobs)
        plain = dataclasses.replace(options, index=False)

        walk(root)  # warm the page cache and the dentries
        engine.scan([root], plain)
        best = {"walk": [], "scan": [], "scan+index": [], "rescan": []}
        for r in range(args.repeats):
            t, n = timed(lambda: walk(root))
            best["walk"].append(t)
            assert n == args.files, n
            t, report = timed(lambda: engine.scan([root], plain))
            best["scan"].append(t)
            assert report.files == args.files and not report.findings, report.findings[:3]
            shutil.rmtree(state, ignore_errors=True)  # (deleting the old index is not the scan's)
            t, report = timed(lambda: engine.scan([root], options))
            best["scan+index"].append(t)
            assert report.index["reused"] == 0, report.index
            t, report = timed(lambda: engine.scan([root], options))
            best["rescan"].append(t)
            assert report.index["reused"] == args.files and not report.findings, report.index
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in best.items()),
                  file=sys.stderr)
        figures = {k: min(v) for k, v in best.items()}
        rounds = {"rescan / walk": [round(r / w, 2) for r, w in zip(best["rescan"], best["walk"], strict=True)],
                  "scan+index / scan": [round(i / s, 3) for i, s in
                                        zip(best["scan+index"], best["scan"], strict=True)]}
        # 1% of the files touched: read again, the rest reused
        touched = 0
        for path in first_files(root, args.files // 100):
            os.utime(path, (time.time() - 60, time.time() - 60))
            touched += 1
        t, report = timed(lambda: engine.scan([root], options))
        assert report.index["read"] == touched, report.index
        figures["rescan, 1% touched"] = t
        size = sum(os.path.getsize(os.path.join(state, n)) for n in os.listdir(state))
        out = {
            "files": args.files,
        "files per folder": args.per_dir,
            "jobs": options.jobs,
            f"seconds (best of {args.repeats})": {k: round(v, 3) for k, v in figures.items()},
            "rescan / walk": round(figures["rescan"] / figures["walk"], 2),
            "scan+index / scan": round(figures["scan+index"] / figures["scan"], 3),
            "rescan / scan": round(figures["rescan"] / figures["scan"], 3),
            "ratios per round": rounds,
            "index bytes": size,
            "index bytes per file": round(size / args.files, 1),
            "targets": {"rescan / walk <= 2.0": figures["rescan"] / figures["walk"] <= 2.0,
                        "scan+index / scan <= 1.10": figures["scan+index"] / figures["scan"] <= 1.10},
        }
        print(json.dumps(out, indent=2))
    finally:
        if not args.keep:
            shutil.rmtree(base if args.dir is None else root, ignore_errors=True)


if __name__ == "__main__":
    main()
