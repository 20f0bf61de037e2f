"""How fast `cachedoctor scan` reads a musubi-tuner project through its dataset TOML.

Builds N items as musubi-tuner lays them out (a 64x64 PNG and its caption in images/, a
Qwen-Image latent [16, 1, 8, 8] bfloat16 and a text-encoder output [32, 64] bfloat16 in
cache/, both with musubi's header metadata), then times, best of R:
  - `cachedoctor scan dataset.toml` (the real CLI in a subprocess, start-up included), with
    -j 1 and with every core, and with --deep,
  - a loop of safetensors.torch.load_file over every cache file (what musubi's
    BucketBatchManager calls for each item of a batch), in this process.
The config scan reads every caption at start (for CD410): its cost is part of the scan's.

    python benchmarks/musubi_scan.py [--items N] [--repeats R] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DATASET_TOML = """[general]
resolution = [64, 64]
caption_extension = ".txt"
enable_bucket = true

[[datasets]]
image_directory = "images"
cache_directory = "cache"
"""


def build(root: str, n: int) -> None:
    import torch
    from safetensors.torch import save_file

    from cachedoctor.fixtures.images import write_png

    images, cache = os.path.join(root, "images"), os.path.join(root, "cache")
    os.makedirs(images)
    os.makedirs(cache)
    with open(os.path.join(root, "dataset.toml"), "w") as f:
        f.write(DATASET_TOML)
    gen = torch.Generator().manual_seed(0)
    head = {"architecture": "qwen_image", "format_version": "1.0.1"}
    for i in range(n):
        stem = f"img_{i:06d}"
        write_png(Path(images, stem + ".png"), 64, 64, i)
        caption = f"a photo number {i}"
        with open(os.path.join(images, stem + ".txt"), "w") as f:
            f.write(caption)
        latent = torch.randn(16, 1, 8, 8, generator=gen).to(torch.bfloat16)
        save_file({"latents_1x8x8_bfloat16": latent},
                  os.path.join(cache, f"{stem}_0064x0064_qi.safetensors"),
                  metadata={**head, "width": "64", "height": "64"})
        embed = torch.randn(32, 64, generator=gen).to(torch.bfloat16)
        save_file({"varlen_vl_embed_bfloat16": embed},
                  os.path.join(cache, f"{stem}_qi_te.safetensors"),
                  metadata={**head, "caption1": caption})


def best(repeats: int, run) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir")
    args = parser.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="cachedoctor-musubi-")
    try:
        if not os.path.exists(os.path.join(root, "dataset.toml")):
            build(root, args.items)
        config = os.path.join(root, "dataset.toml")
        files = 2 * args.items

        def scan(*extra: str):
            return lambda: subprocess.run(
                [sys.executable, "-m", "cachedoctor", "scan", "--format", "json", "-o",
                 os.devnull, config, *extra], check=True, capture_output=True)

        from safetensors.torch import load_file

        cache = os.path.join(root, "cache")
        names = sorted(os.listdir(cache))
        results = {
            "scan -j 1": best(args.repeats, scan("-j", "1")),
            f"scan -j {os.cpu_count()}": best(args.repeats, scan()),
            "scan --deep -j 1": best(args.repeats, scan("--deep", "-j", "1")),
            "load_file loop": best(args.repeats,
                                   lambda: [load_file(os.path.join(cache, n)) for n in names]),
        }
        print(f"{args.items:,} items ({files:,} cache files, {args.items:,} images and captions)")
        for what, seconds in results.items():
            print(f"  {what:18s} {seconds:7.2f} s  {files / seconds:9,.0f} cache files/s")
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
