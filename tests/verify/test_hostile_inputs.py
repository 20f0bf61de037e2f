"""`verify` on images, captions and cache entries someone else left: a PNG of a few bytes that
claims 100,000 x 100,000 pixels, a FIFO or /dev/zero in an image's or a caption's place, an
entry that is a pickle with globals. Each skips its own entry, saying why; the others are
still compared; nothing blocks, nothing runs."""

from __future__ import annotations

import contextlib
import os
import struct
import threading
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
from verify_helpers import pairs

from cachedoctor.fixtures.projects import kohya
from cachedoctor.fixtures.unsafe_pickle import build as unsafe_pickle
from cachedoctor.layouts import resolve
from cachedoctor.repair.encoders import ReferenceEncoder
from cachedoctor.verify import VerifyOptions, run
from cachedoctor.verify.captions import read_caption

DEADLINE = 60  # seconds: a blocked open() would be forever


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def bomb_png(width: int = 100_000, height: int = 100_000) -> bytes:
    """A valid PNG header claiming `width` x `height` RGB pixels, with one tiny IDAT."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(b"\0" * 1024))
            + _chunk(b"IEND", b""))


def _within(call: Callable[[], object], unblock: Callable[[], None] = lambda: None) -> object:
    """call() in a thread; fails the test (and unblocks the thread) when it takes too long."""
    out: list[object] = []
    thread = threading.Thread(target=lambda: out.append(call()), daemon=True)
    thread.start()
    thread.join(DEADLINE)
    if thread.is_alive():
        unblock()
        thread.join(10)
        pytest.fail(f"still running after {DEADLINE} s: blocked")
    return out[0]


def _verify(project):
    return run(resolve([str(project.config)]), ReferenceEncoder(), VerifyOptions())


def _one_skipped(project, entry: Path, why: str, unblock: Callable[[], None] = lambda: None) -> None:
    report = _within(lambda: _verify(project), unblock)
    [dataset] = report.datasets
    skipped = [c for c in dataset.checked if c.verdict == "skipped"]
    assert [c.entry for c in skipped] == [str(entry)], [(c.entry, c.note) for c in skipped]
    assert why in skipped[0].note and "\n" not in skipped[0].note, skipped[0].note
    assert len(dataset.compared) == 8 and not report.findings


def _fifo_unblocker(path: Path) -> Callable[[], None]:
    """Open the FIFO for writing (without blocking): a reader stuck in open() goes on."""
    def unblock() -> None:
        with contextlib.suppress(OSError):
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    return unblock


def test_a_png_claiming_100k_by_100k_pixels_is_skipped_not_decoded(tmp_path: Path) -> None:
    project = kohya.build(tmp_path / "kohya")
    entry, image = sorted(pairs(project).items())[1]
    image.write_bytes(bomb_png())
    assert image.stat().st_size < 200
    _one_skipped(project, entry, "decompression bomb")


def test_a_png_past_pillows_warning_limit_is_skipped_before_its_pixels_are_decoded(tmp_path: Path) -> None:
    """12,000 x 12,000: more than Pillow's 89 Mpx (a warning only, below twice that): decoding
    it would take 432 MB, and a float copy to resize it 1.7 GB."""
    project = kohya.build(tmp_path / "kohya")
    entry, image = sorted(pairs(project).items())[1]
    image.write_bytes(bomb_png(12_000, 12_000))
    _one_skipped(project, entry, "untrusted source")


def test_an_image_that_is_a_fifo_is_skipped_without_blocking(tmp_path: Path) -> None:
    project = kohya.build(tmp_path / "kohya")
    entry, image = sorted(pairs(project).items())[2]
    image.unlink()
    os.mkfifo(image)
    _one_skipped(project, entry, "not a regular file", _fifo_unblocker(image))


def test_an_image_that_is_a_symlink_to_dev_zero_is_skipped(tmp_path: Path) -> None:
    project = kohya.build(tmp_path / "kohya")
    entry, image = sorted(pairs(project).items())[3]
    image.unlink()
    image.symlink_to("/dev/zero")
    _one_skipped(project, entry, "not a regular file")


def test_a_cache_entry_that_is_a_pickle_with_globals_never_runs(tmp_path: Path) -> None:
    project = kohya.build(tmp_path / "kohya")
    entry = sorted(pairs(project))[4]
    marker = tmp_path / "PAYLOAD_RAN"
    [poisoned] = unsafe_pickle(tmp_path / "poison", marker=marker, how="npz")
    entry.write_bytes(poisoned.read_bytes())  # kohya's arrays, and an object array
    _one_skipped(project, entry, "scan's reader rejects it")
    assert not marker.exists()


def test_a_caption_that_is_a_fifo_or_dev_zero_is_no_caption(tmp_path: Path) -> None:
    fifo, zero, huge = tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "c.txt"
    os.mkfifo(fifo)
    zero.symlink_to("/dev/zero")
    huge.write_bytes(b"x" * (1 << 20))
    assert _within(lambda: read_caption(str(fifo)), _fifo_unblocker(fifo)) is None
    assert _within(lambda: read_caption(str(zero))) is None
    assert read_caption(str(huge)) is None
