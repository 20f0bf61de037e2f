"""Time and peak RSS of `cachedoctor scan` on hostile safetensors headers, one file per run.

    python benchmarks/hostile_safetensors.py [--mb 99] [--dir DIR] [--keep] [--only NAME ...]
                                             [--library]

Each file has a header of about `--mb` MB (safetensors' own limit is 100,000,000 bytes:
MAX_HEADER_SIZE in huggingface/safetensors safetensors/src/tensor.rs), shaped to cost a
reader as much as it can: millions of tiny tensors, deep nesting, huge numbers, millions of
duplicate keys, huge or countless `__metadata__` entries, shapes of millions of dims, huge
data_offsets. Each is scanned alone (`cachedoctor scan FILE --format json --isolated
--no-index`) under `/usr/bin/time -v`; the table gives wall time, peak RSS, and the first
finding. On a shared machine wall time drifts: CPU time (user + system) is given beside
it. `--library` also times `safe_open` on the same file (numpy framework) and prints
whether it loads, so the verdicts can be compared by eye. Real-size files (a latent, a
text-encoder cache, a 3,000-tensor checkpoint header) run as the control.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

U8 = b'{"dtype":"U8","shape":[1],"data_offsets":[%d,%d]}'


def _frame(header: bytes, data: bytes = b"") -> Iterator[bytes]:
    yield struct.pack("<Q", len(header))
    yield header
    yield data


def many_tensors(size: int) -> Iterator[bytes]:
    """~1.4 million 1-byte U8 tensors at 99 MB: a file safetensors loads."""
    parts, total, i = [], 2, 0
    while total < size - 80:
        part = b'"t%07d":' % i + U8 % (i, i + 1)
        parts.append(part)
        total += len(part) + 1
        i += 1
    return _frame(b"{" + b",".join(parts) + b"}", b"\0" * i)


def duplicate_tensors(size: int) -> Iterator[bytes]:
    """One name, declared ~1.5 million times: serde keeps the last, so the file loads."""
    part = b'"x":' + U8 % (0, 1)
    n = (size - 2) // (len(part) + 1)
    return _frame(b"{" + b",".join([part] * n) + b"}", b"\0")


def nested(size: int) -> Iterator[bytes]:
    """An unknown tensor field `[[[[...` as deep as the header allows."""
    depth = (size - 80) // 2
    head = b'{"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"z":'
    return _frame(head + b"[" * depth + b"]" * depth + b"}}", b"\0")


def nested_open(size: int) -> Iterator[bytes]:
    """`[[[[...` never closed: the root is an array, size-1 deep."""
    return _frame(b"[" * size)


def huge_float(size: int) -> Iterator[bytes]:
    """A float of `size` digits in an unknown field: no f64 holds it."""
    head = b'{"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"z":1.'
    return _frame(head + b"1" * (size - len(head) - 8) + b"e999999}}", b"\0")


def huge_int(size: int) -> Iterator[bytes]:
    """An integer of ~`size` digits as a shape dim (Python refuses more than 4,300)."""
    head = b'{"x":{"dtype":"U8","shape":[1'
    tail = b'],"data_offsets":[0,1]}}'
    return _frame(head + b"0" * (size - len(head) - len(tail)) + tail, b"\0")


def many_ints(size: int) -> Iterator[bytes]:
    """As many 4,000-digit integers in an unknown field as fit: each is legal for Python."""
    head = b'{"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"z":['
    one = b"9" * 4000
    n = (size - len(head) - 4) // (len(one) + 1)
    return _frame(head + b",".join([one] * n) + b"]}}", b"\0")


def huge_metadata_value(size: int) -> Iterator[bytes]:
    """One `__metadata__` string of ~`size` bytes: a file safetensors loads."""
    head = b'{"__metadata__":{"big":"'
    return _frame(head + b"a" * (size - len(head) - 3) + b'"}}')


def many_metadata_keys(size: int) -> Iterator[bytes]:
    """~7 million `__metadata__` keys: a file safetensors loads."""
    parts, total, i = [], 20, 0
    while total < size - 20:
        part = b'"k%d":""' % i
        parts.append(part)
        total += len(part) + 1
        i += 1
    return _frame(b'{"__metadata__":{' + b",".join(parts) + b"}}")


def duplicate_metadata_keys(size: int) -> Iterator[bytes]:
    """One `__metadata__` key, ~14 million times: the last counts, the file loads."""
    part = b'"k":""'
    n = (size - 20) // (len(part) + 1)
    return _frame(b'{"__metadata__":{' + b",".join([part] * n) + b"}}")


def many_dims(size: int) -> Iterator[bytes]:
    """A shape of ~50 million 1s: numel 1, so the file loads."""
    head = b'{"x":{"dtype":"U8","data_offsets":[0,1],"shape":['
    n = (size - len(head) - 4) // 2
    return _frame(head + b",".join([b"1"] * n) + b"]}}", b"\0")


def overflow_dims(size: int) -> Iterator[bytes]:
    """A shape of millions of u64::MAX dims: the product overflows at the second."""
    head = b'{"x":{"dtype":"U8","data_offsets":[0,1],"shape":['
    one = b"18446744073709551615"
    n = (size - len(head) - 4) // (len(one) + 1)
    return _frame(head + b",".join([one] * n) + b"]}}", b"\0")


def huge_offsets(size: int) -> Iterator[bytes]:
    """Many tensors whose data_offsets reach u64::MAX: offsets not contiguous from 0."""
    parts, total, i = [], 2, 0
    big = 2**64 - 1
    while total < size - 120:
        part = b'"t%07d":{"dtype":"U8","shape":[0],"data_offsets":[%d,%d]}' % (i, big, big)
        parts.append(part)
        total += len(part) + 1
        i += 1
    return _frame(b"{" + b",".join(parts) + b"}")


def _real(n_tensors: int, shape: tuple[int, ...], metadata: dict[str, str]) -> Callable:
    def build(size: int) -> Iterator[bytes]:
        numel = 1
        for d in shape:
            numel *= d
        header: dict = {"__metadata__": metadata}
        at = 0
        for i in range(n_tensors):
            header[f"model.layers.{i // 10}.block.{i % 10}.weight"] = {
                "dtype": "BF16", "shape": list(shape), "data_offsets": [at, at + 2 * numel]}
            at += 2 * numel
        return _frame(json.dumps(header).encode(), b"\0" * at)
    return build


SHAPES: dict[str, Callable[[int], Iterator[bytes]]] = {
    "many_tensors": many_tensors,
    "duplicate_tensors": duplicate_tensors,
    "nested": nested,
    "nested_open": nested_open,
    "huge_float": huge_float,
    "huge_int": huge_int,
    "many_ints": many_ints,
    "huge_metadata_value": huge_metadata_value,
    "many_metadata_keys": many_metadata_keys,
    "duplicate_metadata_keys": duplicate_metadata_keys,
    "many_dims": many_dims,
    "overflow_dims": overflow_dims,
    "huge_offsets": huge_offsets,
}
REAL = {  # built at their own size, whatever --mb says
    "real_latent": _real(1, (16, 128, 128), {"format": "pt"}),
    "real_text_cache": _real(40, (77, 8), {"format": "pt"}),
    "real_checkpoint_3000": _real(3000, (4, 4), {"format": "pt", "modelspec.title": "x" * 2000}),
}


def write(path: str, chunks: Iterator[bytes]) -> int:
    with open(path, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
        return f.tell()


def measure(path: str) -> dict:
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "cachedoctor", "scan", path,
           "--format", "json", "--isolated", "--no-index", "--fail-on", "never"]
    with tempfile.TemporaryDirectory() as cwd:
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
        wall = time.perf_counter() - start
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    cpu = sum(float(m) for m in re.findall(r"(?:User|System) time \(seconds\): ([\d.]+)",
                                           proc.stderr))
    try:
        findings = json.loads(proc.stdout)["findings"]
        first = (f"{findings[0]['code']} {findings[0]['message'][:90]}" if findings
                 else "no finding")
    except (ValueError, KeyError):
        first = f"NO JSON (rc {proc.returncode}): {proc.stderr.strip().splitlines()[-1][:90]}"
    return {"wall_s": wall, "cpu_s": cpu, "rss_mb": int(rss.group(1)) / 1024 if rss else None, "first": first,
            "traceback": "Traceback" in proc.stderr}


def library(path: str) -> str:
    code = ("import sys,time\nfrom safetensors import safe_open\nt=time.perf_counter()\n"
            "try:\n with safe_open(sys.argv[1],'np') as f: r='loads %d' % len(list(f.keys()))\n"
            "except Exception as e: r='refuses: '+str(e)[:60]\n"
            "print(f'{time.perf_counter()-t:.1f}s {r}')")
    return subprocess.run([sys.executable, "-c", code, path], capture_output=True,
                          text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=99.0, help="header size in MB (1e6 bytes)")
    parser.add_argument("--dir", help="build the files here (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the built files")
    parser.add_argument("--only", nargs="*", help="only these shapes")
    parser.add_argument("--library", action="store_true", help="also time safe_open")
    args = parser.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="hostile-st-")
    os.makedirs(root, exist_ok=True)
    size = int(args.mb * 1e6)
    rows = []
    try:
        for name, build in {**REAL, **SHAPES}.items():
            if args.only and name not in args.only:
                continue
            path = os.path.join(root, f"{name}.safetensors")
            if not os.path.exists(path):
                write(path, build(size))
            row = {"shape": name, "file_mb": os.path.getsize(path) / 1e6, **measure(path)}
            if args.library:
                row["library"] = library(path)
            rows.append(row)
            print(f"{name:24} {row['file_mb']:7.1f} MB  {row['wall_s']:6.1f} s  "
                  f"{row['cpu_s']:6.1f} s CPU  "
                  f"{row['rss_mb']:7.0f} MB RSS  {'TRACEBACK ' if row['traceback'] else ''}"
                  f"{row['first']}" + (f"\n{'':24} library: {row['library']}"
                                       if args.library else ""), flush=True)
    finally:
        if not (args.keep or args.dir):
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
