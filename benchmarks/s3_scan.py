"""`cachedoctor scan s3://…` against the naive check, on a loopback S3 server with latency.

Starts moto's S3 server (its WSGI app under werkzeug, as moto's ThreadedMotoServer does) on
127.0.0.1 behind a middleware that sleeps DELAY ms per request, fills a bucket with N latents
as SimpleTuner writes them (torch.save of a bf16 [4, 16, 16] tensor; 64 distinct ones cycled)
with the delay off, then, with the delay on, times in one run:
  - `cachedoctor scan s3://bucket/cache` (the real CLI in a subprocess, every core),
  - the naive check: list the prefix, then for each object GET it whole and torch.load it
    (weights_only=True), one after another (a subprocess),
  - the same naive check with the scan's 48 requests in flight (a thread pool), for fairness.
Each figure is the best of R, and the ratio is naive / scan from the same run; peak RSS is
that of each child and the processes it starts (the scan's workers), summed, sampled.

    python benchmarks/s3_scan.py [--objects N] [--delay-ms 5] [--repeats R]

Nothing leaves the machine: the server listens on 127.0.0.1 only, with fake credentials.
"""

from __future__ import annotations

import argparse
import io
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

BUCKET = "bench"
PREFIX = "cache/vae/sdxl/photos"


class Slow:
    """WSGI middleware: every request waits `delay` seconds first (a network's round trip)."""

    def __init__(self, app, delay: float = 0.0) -> None:
        self.app, self.delay = app, delay

    def __call__(self, environ, start_response):
        if self.delay:
            time.sleep(self.delay)
        return self.app(environ, start_response)


def serve() -> tuple[str, Slow]:
    import logging

    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    slow = Slow(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", port, slow, threaded=True, request_handler=MotoRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{port}", slow


def fill(endpoint: str, n: int) -> int:
    import boto3
    import torch

    s3 = boto3.client("s3", endpoint_url=endpoint)
    s3.create_bucket(Bucket=BUCKET)
    gen = torch.Generator().manual_seed(0)
    blobs = []
    for _ in range(64):
        buf = io.BytesIO()
        torch.save(torch.randn(4, 16, 16, generator=gen).to(torch.bfloat16), buf)
        blobs.append(buf.getvalue())

    def put(i: int) -> None:
        s3.put_object(Bucket=BUCKET, Key=f"{PREFIX}/{i:064x}.pt", Body=blobs[i % 64])

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, range(n)))
    return sum(len(blobs[i % 64]) for i in range(n))


def naive(threads: int) -> int:
    """The check a user writes without cachedoctor: every object downloaded and loaded."""
    import boto3
    import torch
    from botocore.config import Config

    s3 = boto3.client("s3", config=Config(max_pool_connections=threads + 4))
    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=PREFIX)
            for o in page.get("Contents", ())]
    bad = 0

    def check(key: str) -> int:
        data = s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
        try:
            torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception:
            return 1
        return 0

    if threads <= 1:
        bad = sum(check(k) for k in keys)
    else:
        with ThreadPoolExecutor(threads) as pool:
            bad = sum(pool.map(check, keys))
    return bad


def timed(command: list[str], env: dict) -> tuple[float, int]:
    """(seconds, peak RSS in bytes) of a child run: the RSS of the child and every process it
    started, summed, sampled every 20 ms (ru_maxrss would count this parent's RSS too: Linux
    keeps the high-water mark across exec)."""
    import psutil

    start = time.perf_counter()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak = 0
    watched = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            tree = [watched, *watched.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
        except psutil.Error:
            pass
        time.sleep(0.02)
    seconds = time.perf_counter() - start
    err = proc.stderr.read() if proc.stderr else ""
    if proc.returncode != 0:
        raise SystemExit(f"{command[2:]} failed ({proc.returncode}): {err[-2000:]}")
    return seconds, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=100_000)
    parser.add_argument("--delay-ms", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--child", choices=("scan", "naive", "naive-threads"))
    args = parser.parse_args()
    if args.child:  # a measured subprocess
        if args.child == "scan":
            from cachedoctor.cli import main as cli

            sys.argv = ["cachedoctor", "scan", f"s3://{BUCKET}/{PREFIX}", "--format", "json",
                        "-o", os.devnull, "--fail-on", "never"]
            cli()
        else:
            naive(48 if args.child == "naive-threads" else 1)
        return
    for var in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3"):
        os.environ.pop(var, None)
    endpoint, slow = serve()
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
           "AWS_EC2_METADATA_DISABLED": "true",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint}
    os.environ.update(env)
    start = time.perf_counter()
    nbytes = fill(endpoint, args.objects)
    print(f"{args.objects:,} objects ({nbytes / 2**20:.1f} MiB) uploaded in "
          f"{time.perf_counter() - start:.1f} s; {args.delay_ms:g} ms per request from now on")
    slow.delay = args.delay_ms / 1000
    results = {}
    for name in ("scan", "naive-threads", "naive"):
        best = None
        for _ in range(args.repeats):
            seconds, rss = timed([sys.executable, __file__, "--child", name], env)
            if best is None or seconds < best[0]:
                best = (seconds, rss)
        results[name] = best
        print(f"  {name:<14} {best[0]:8.1f} s  {args.objects / best[0]:8.0f} objects/s  "
              f"peak RSS {best[1] / 2**20:6.0f} MiB", flush=True)
    scan = results["scan"][0]
    print(f"naive / scan: {results['naive'][0] / scan:.1f}x (sequential), "
          f"{results['naive-threads'][0] / scan:.1f}x (48 threads); "
          f"peak RSS scan / naive: {results['scan'][1] / results['naive'][1]:.2f}")


if __name__ == "__main__":
    main()
