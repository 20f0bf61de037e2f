"""How fast `cachedoctor scan --deep` reads a cache, against a plain parallel full read of the
same files with the same process count, measured in the same run; and where --deep's time goes.

Builds N latent files (default 2,000, 330 MB), a quarter in each of four caches:
[4,128,128] torch.save zips of float32, float16 and bfloat16 (bare tensors, as SimpleTuner
writes them: stored entries with CRC32s) and float16 safetensors files. Every file is read once
first, so every figure below is warm (page cache), both sides alike. Then, best of R and
interleaved (this machine's speed drifts):
  - a plain full read: `jobs` forked processes, each opening its share of the files and reading
    every byte into memory (the floor: what any check of every byte pays at least),
  - `cachedoctor scan` (metadata only) and `cachedoctor scan --deep` as a user runs them (the
    CLI in a subprocess, `-j jobs`, `--no-index` so that every round reads every file); their
    start-up (a scan of an empty dir; for --deep, a --deep scan of one file, numpy's import
    included) is shown and taken out, so the throughputs compare per byte;
  - steady state: the plain read and --deep's reader (read_path(deep=True), what a scan's
    worker runs, without the rules) in one pool of `jobs` processes started and warmed before
    the clock: no start-up on either side, the fairest per-byte comparison on a busy machine.
Target (issue #14): --deep at >= 50% of the plain read's throughput.

Then one process reads every file with --deep under cProfile and splits its time by phase:
CRC32, inflate, NaN/Inf count (numpy's, or the compiled test's: formats/native.py), the
layout match of twins (zip_templates), I/O syscalls, and parse/other (the readers' Python,
which the profiler slows most: its share is an upper bound). CACHEDOCTOR_NO_NATIVE=1 runs it
all without the compiled checks.

    python benchmarks/deep_speed.py [--files N] [--shape C,H,W] [--links K] [--jobs J] [--repeats R]
                                    [--dir DIR] [--keep]

`--links K` (default 4) gives every file K names (hard links in copies of the cache folders):
K times the files and bytes to read, the same disk and page cache.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import multiprocessing
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import time

REPEATS = 3
SHAPE = (4, 128, 128)
CACHES = ("pt_float32", "pt_float16", "pt_bfloat16", "st_float16")
SCAN_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def build(root: str, n: int, shape: tuple[int, ...] = SHAPE) -> list[str]:
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    paths = []
    for i in range(n):
        cache = CACHES[i % len(CACHES)]
        kind, dtype = cache.split("_")
        folder = os.path.join(root, cache)
        os.makedirs(folder, exist_ok=True)
        latent = torch.randn(shape, generator=gen)
        path = os.path.join(folder, f"{i:06d}.{'pt' if kind == 'pt' else 'safetensors'}")
        if not os.path.exists(path):
            latent = latent.to(getattr(torch, dtype))
            if kind == "pt":
                torch.save(latent, path)
            else:
                save_file({"latent": latent}, path)
        paths.append(path)
    return paths


def linked(root: str, paths: list[str], links: int) -> tuple[list[str], list[str]]:
    """Every path and `links` - 1 hard links to it, in copies of the cache folders: (paths,
    cache folders). More bytes to read without more disk or page cache: the processes' start
    (numpy's import among it) is spread over more work, as on a real cache."""
    out, caches = list(paths), [os.path.join(root, c) for c in CACHES]
    for k in range(1, links):
        for path in paths:
            cache, name = path.rsplit(os.sep, 2)[1:]
            folder = os.path.join(root, f"{cache}-{k}")
            os.makedirs(folder, exist_ok=True)
            link = os.path.join(folder, name)
            if not os.path.exists(link):
                os.link(path, link)
            out.append(link)
        caches += [os.path.join(root, f"{c}-{k}") for c in CACHES]
    return out, caches


def _read_all(paths: list[str]) -> int:
    """Every byte of every file into memory, one file at a time: the floor."""
    total = 0
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            total += len(os.read(fd, size))
        finally:
            os.close(fd)
    return total


def timed_read(paths: list[str], jobs: int) -> float:
    start = time.perf_counter()
    if jobs == 1:
        _read_all(paths)
    else:
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            pool.map(_read_all, [paths[i::jobs] for i in range(jobs)])
    return time.perf_counter() - start


def _warm_worker(path: str) -> None:
    """A pool worker's imports and first read (numpy, the memo of data.pkl): paid once."""
    from cachedoctor.formats import read_path

    read_path(path, deep=True)


def _deep_all(paths: list[str]) -> int:
    """--deep's reader over every file, as a scan's worker runs it (with the zip templates it
    learns as it goes; no rules, no report)."""
    from cachedoctor.formats import read_path
    from cachedoctor.formats.zip_templates import Templates

    bad, templates = 0, Templates()
    for p in paths:
        meta = read_path(p, deep=True, templates=templates)
        bad += bool(meta.errors or meta.crc_errors or meta.nonfinite)
    return bad


def timed_steady(pool, fn, shares: list[list[str]]) -> float:
    """`fn` over every share in a pool already started and warm: no start-up on either side."""
    start = time.perf_counter()
    pool.map(fn, shares, chunksize=1)
    return time.perf_counter() - start


def timed_scan(targets: list[str], jobs: int, deep: bool) -> tuple[float, dict]:
    # --no-index: every round reads every file (with the index, a second round would reuse
    # the first's verdicts and read nothing)
    cmd = [sys.executable, "-m", "cachedoctor", "scan", *targets, "--format", "json", "--no-index",
           "-j", str(jobs), "--fail-on", "never", *(["--deep"] if deep else [])]
    start = time.perf_counter()
    out = subprocess.run(cmd, stdout=subprocess.PIPE, check=True, env=SCAN_ENV).stdout
    return time.perf_counter() - start, json.loads(out)


# cProfile's names for the calls of each phase (builtins and the modules that do the work)
def _phase(func: tuple[str, int, str]) -> str:
    filename, _, name = func
    if "crc32" in name:
        return "CRC32"
    if "decompress" in name:
        return "inflate"
    if filename.endswith("nonfinite.py") or "numpy" in filename or "numpy" in name or (
            "_native.finite" in name):
        return "NaN/Inf count"
    if "_native.span" in name or filename.endswith("zip_templates.py"):
        return "layout match"
    if name.startswith("<built-in method posix.") and name[23:-1] in (
            "read", "open", "close", "fstat", "lseek", "pread"):
        return "I/O syscalls"
    return "parse/other"


def profile_deep(paths: list[str]) -> tuple[float, dict[str, float], float]:
    """(plain seconds, {phase: profiled seconds}, profiled total) for read_path(deep=True) of
    every path in this process, with a scan's zip templates."""
    from cachedoctor.formats import read_path
    from cachedoctor.formats.zip_templates import Templates

    for p in paths[:50]:  # imports, numpy's first use, the data.pkl memo: not per-file costs
        read_path(p, deep=True)
    start = time.perf_counter()
    templates = Templates()  # as a scan's worker reads: learning layouts as it goes
    for p in paths:
        read_path(p, deep=True, templates=templates)
    plain = time.perf_counter() - start
    profiler = cProfile.Profile()
    templates = Templates()
    profiler.enable()
    for p in paths:
        read_path(p, deep=True, templates=templates)
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # func -> (calls, ncalls, tottime, cumtime, callers)
    phases: dict[str, float] = {}
    for func, (_, _, tottime, _, _) in stats.items():
        phase = _phase(func)
        phases[phase] = phases.get(phase, 0.0) + tottime
    return plain, phases, sum(phases.values())


def whole_scan_cpu(paths: list[str], targets: list[str], repeats: int) -> tuple[float, float]:
    """(plain read, --deep scan) CPU seconds in this process, best of `repeats` each: the
    scan as the CLI runs it with -j 1, less its start-up; CPU time, which a busy machine's
    other work disturbs less than wall time does."""
    from cachedoctor.engine import scan
    from cachedoctor.options import ScanOptions

    options = ScanOptions(jobs=1, deep=True, index=False)

    def cpu(work) -> float:
        start = time.process_time()
        work()
        return time.process_time() - start

    scan(targets, options)  # warm: imports, numpy's first use
    read_s = min(cpu(lambda: _read_all(paths)) for _ in range(repeats))
    scan_s = min(cpu(lambda: scan(targets, options)) for _ in range(repeats))
    return read_s, scan_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=2_000)
    parser.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)),
                        help="processes for the read and the scans (default: every core)")
    parser.add_argument("--shape", default=",".join(map(str, SHAPE)),
                        help="latent shape, C,H,W (default 4,128,128; Flux-class: 16,128,128)")
    parser.add_argument("--links", type=int, default=4,
                        help="K names per built file (hard links; default 4)")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="best of R (default 3)")
    parser.add_argument("--dir", help="build (or reuse) the files here instead of a temp dir")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir")
    args = parser.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="cachedoctor-deep-")
    jobs = args.jobs
    try:
        t0 = time.perf_counter()
        shape = tuple(int(n) for n in args.shape.split(","))
        paths, targets = linked(root, build(root, args.files, shape), args.links)
        total = sum(os.path.getsize(p) for p in paths)
        named = f" ({args.links} names each)" if args.links > 1 else ""
        print(f"{len(paths):,} files{named} of {list(shape)}, {total / 1e6:.0f} MB in {root} (built in "
              f"{time.perf_counter() - t0:.0f} s); {len(os.sched_getaffinity(0))} cores, "
              f"{jobs} processes")
        _read_all(paths)  # warm: every figure below reads from the page cache
        print("page cache: warm (every file read once before the timings, both sides alike)")
        empty = tempfile.mkdtemp(prefix="cachedoctor-deep-empty-")
        startup = min(timed_scan([empty], 1, False)[0] for _ in range(args.repeats))
        # --deep's own start-up: numpy's import (~0.1 s here, in each worker, in parallel) and
        # zlib-ng's, measured as a --deep scan of one file
        one = os.path.join(empty, os.path.basename(paths[0]))
        os.link(paths[0], one)
        deep_startup = min(timed_scan([empty], 1, True)[0] for _ in range(args.repeats))
        shutil.rmtree(empty)
        read_s = scan_s = deep_s = float("inf")
        for _ in range(args.repeats):
            read_s = min(read_s, timed_read(paths, jobs))
            elapsed, report = timed_scan(targets, jobs, False)
            assert report["summary"]["files"] == len(paths), report["summary"]
            scan_s = min(scan_s, elapsed)
            elapsed, deep_report = timed_scan(targets, jobs, True)
            assert deep_report["summary"]["files"] == len(paths), deep_report["summary"]
            deep_s = min(deep_s, elapsed)
        gb = total / 1e9
        print(f"start-up, taken out: {startup:.2f} s for scan (a scan of an empty dir), "
              f"{deep_startup:.2f} s for --deep (a --deep scan of one file: numpy's import)")
        print(f"{'':<28}{'seconds':>9}{'GB/s':>8}{'vs read':>9}")
        for label, seconds in (("plain full read", read_s), ("scan (metadata)", scan_s - startup),
                               ("scan --deep", deep_s - deep_startup)):
            print(f"{label:<28}{seconds:>9.2f}{gb / seconds:>8.2f}{read_s / seconds:>8.0%}")
        print(f"findings: scan {report['summary']['findings']}, --deep "
              f"{deep_report['summary']['findings']}")
        ratio = read_s / (deep_s - deep_startup)
        print(f"target (--deep >= 50% of the plain read's throughput): "
              f"{'met' if ratio >= 0.5 else 'MISSED'} ({ratio:.0%}; as measured, start-up in: "
              f"{read_s / deep_s:.0%})")

        shares = [paths[i::jobs] for i in range(jobs)]
        with multiprocessing.get_context("fork").Pool(jobs, _warm_worker, (paths[0],)) as pool:
            pool.map(_read_all, shares, chunksize=1)
            read_ss = deep_ss = float("inf")
            for _ in range(args.repeats * 2):
                read_ss = min(read_ss, timed_steady(pool, _read_all, shares))
                deep_ss = min(deep_ss, timed_steady(pool, _deep_all, shares))
        print(f"steady state, {jobs} warm processes: plain read {gb / read_ss:.2f} GB/s "
              f"({read_ss:.2f} s), --deep's reader {gb / deep_ss:.2f} GB/s ({deep_ss:.2f} s): "
              f"{read_ss / deep_ss:.0%} ({'met' if read_ss / deep_ss >= 0.5 else 'MISSED'})")

        plain, phases, profiled = profile_deep(paths)
        one_read = timed_read(paths, 1)
        print(f"\none process: --deep reads {gb / plain:.2f} GB/s ({plain:.2f} s), a plain read "
              f"{gb / one_read:.2f} GB/s ({one_read:.2f} s): {one_read / plain:.0%}")
        read_cpu, scan_cpu = whole_scan_cpu(paths, targets, args.repeats)
        print(f"one process, the whole scan (engine.scan in this process: reader, rules, "
              f"summaries, dataset rules; no start-up), CPU time: --deep "
              f"{scan_cpu / len(paths) * 1e6:.1f} us a file, a plain read "
              f"{read_cpu / len(paths) * 1e6:.1f} us: {read_cpu / scan_cpu:.0%}")
        print(f"where --deep's time goes (cProfile, {profiled:.2f} s profiled; "
              f"{plain / len(paths) * 1e6:.0f} us a file unprofiled):")
        for phase, seconds in sorted(phases.items(), key=lambda kv: -kv[1]):
            print(f"  {phase:<16}{seconds:>7.2f} s {seconds / profiled:>5.0%}  "
                  f"({seconds / profiled * plain / len(paths) * 1e6:.0f} us a file, scaled)")
    finally:
        if not args.dir and not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
