"""CRC32 (the zip/gzip polynomial) at memory speed where the machine allows.

zlib's crc32 runs at about 4 GB/s a core, slower than reading a warm file: after numpy's
float16 test it was --deep's largest cost. zlib-ng's (a dependency) uses the CPU's carry-less
multiply and runs at tens of GB/s; zlib's is the fallback where zlib-ng is not installed.
zlib-ng is imported on the first CRC, not with the scan: its import takes milliseconds that a
metadata scan never needs.
"""

from __future__ import annotations

import functools


def crc32(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """zlib.crc32(data, value), by the fastest implementation installed."""
    return fast()(data, value)


@functools.cache
def fast():
    """The fastest crc32(data, value) installed, for a loop that takes many."""
    try:
        from zlib_ng.zlib_ng import crc32 as fast
    except ImportError:
        from zlib import crc32 as fast
    return fast
