"""Cache writers in SimpleTuner's style, each with the switch for the bug it once had.

- `LatentWriter`: one `sha256(stem).pt` per image from a VAE batch. `clone=False` saves
  `latents[i]`, a view that drags the whole batch into every file (SimpleTuner #550);
  `to_cpu=False` saves from the training device (OneTrainer's DiskCache, #459).
- `TextEmbedCache`: one `md5(caption)-<family>.pt` per caption through a writer thread fed by
  a queue (SimpleTuner's `batch_write_embeddings`). Buggy: the thread reads `batch` before it
  is assigned (#1147) and writes with a plain `open(path, "wb")`, no lock, no rename; fixed:
  `batch` initialised, temp file + fsync + rename under a per-file lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import queue
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from cachedoctor.fixtures.devices import stored_as


class LatentWriter:
    """Saves each row of an encoded batch as a SimpleTuner VAE cache entry."""

    def __init__(self, *, clone: bool = True, to_cpu: bool = True, gpu_stand_in: str | None = None,
                 with_conditioning: bool = False) -> None:
        self.clone = clone
        self.to_cpu = to_cpu
        self.gpu_stand_in = gpu_stand_in  # a CPU host's `cuda:<rank>` (see RankContext)
        self.with_conditioning = with_conditioning  # a dict with SDXL micro-conditioning

    def save_batch(self, paths: list[Path], batch: torch.Tensor, sizes: list[tuple[int, int] | None]) -> None:
        """`paths[i]` gets row i of `batch`, an encoded batch on the VAE's device."""
        if self.to_cpu:
            batch = batch.cpu()  # the whole batch at once, as the VAE stage hands it over
        for row, (path, size) in enumerate(zip(paths, sizes, strict=True)):
            latent = batch[row]  # a view into the whole batch's storage
            if self.clone:
                latent = latent.clone()
            entry: Any = latent
            if self.with_conditioning:
                # Built from Python ints, so on the CPU whatever device the VAE ran on.
                entry = {"latents": latent, "original_size": torch.tensor(size),
                         "crop_coordinates": torch.tensor([0, 0])}
            with self._device_tag(latent), open(path, "wb") as f:
                torch.save(entry, f)

    def _device_tag(self, latent: torch.Tensor) -> contextlib.AbstractContextManager:
        """Without `.cpu()` on a CPU-only host, tag the latent as the GPU rank would have saved it."""
        if self.to_cpu or self.gpu_stand_in is None or latent.is_cuda:
            return contextlib.nullcontext()
        return stored_as(self.gpu_stand_in, only=[latent])


def serialized(obj: Any) -> bytes:
    """torch.save to a file object, as SimpleTuner's writer does (archive prefix `archive/`)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def write_unlocked(path: Path, blob: bytes, pause: float) -> None:
    """SimpleTuner's text-embed write before PR #1160: `open(path, "wb")`, no lock, no rename.

    torch.save streams the archive into the open file; the bytes go in two halves with `pause`
    between, so a concurrent reader lands in the half-written window for sure rather than by luck.
    """
    with open(path, "wb") as f:
        f.write(blob[: len(blob) // 2])
        f.flush()
        time.sleep(pause)
        f.write(blob[len(blob) // 2 :])


def write_atomic(path: Path, blob: bytes, pause: float, lock_dir: Path) -> bool:
    """The fix: under a per-file lock, skip a file another rank already wrote, else write a temp
    file beside it (same two halves and pause), fsync, and rename it over. Returns True if written.

    Readers see the old state or the whole new file, never a part; the lock keeps two ranks from
    encoding one caption twice. Lock files live outside the cache dir, so none is left in it.
    """
    with _locked(lock_dir / f"{path.name}.lock"):
        if path.exists():
            return False
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as f:  # atomicwrites' tmpXXXXXXXX
            f.write(blob[: len(blob) // 2])
            f.flush()
            time.sleep(pause)
            f.write(blob[len(blob) // 2 :])
            f.flush()
            os.fsync(f.fileno())
        os.replace(f.name, path)
        return True


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class TextEmbedCache:
    """A queue of (entry, path) and one daemon writer thread, as SimpleTuner's TextEmbeddingCache.

    The thread starts with the cache, before the text encoder is ready: its first poll of the
    queue can come up empty, which is what tripped the buggy loop at start-up in #1147.
    """

    def __init__(self, *, buggy: bool, lock_dir: Path, pause: float = 0.02, poll: float = 0.05) -> None:
        self.buggy = buggy
        self.lock_dir = lock_dir
        self.pause = pause
        self.poll = poll  # SimpleTuner polls with timeout=1 s; the harness is 20x quicker
        self.write_queue: queue.Queue[tuple[bytes, Path]] = queue.Queue()
        self.polled = threading.Event()  # set once the thread has polled the queue
        self.error: BaseException | None = None
        self.written = 0
        self.running = True
        self.thread = self.start_writer()

    def start_writer(self) -> threading.Thread:
        """A new writer thread (its predecessor's error, if any, stays with the caller's notes)."""
        self.error = None
        loop = self._buggy_loop if self.buggy else self._fixed_loop
        thread = threading.Thread(target=self._run, args=(loop,), name="batch_write_thread", daemon=True)
        thread.start()
        return thread

    def save_to_cache(self, path: Path, entry: dict[str, torch.Tensor]) -> None:
        self.write_queue.put((serialized({k: v.cpu() for k, v in entry.items()}), path))

    def wait_for_pending_writes(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self.write_queue.unfinished_tasks and self.thread.is_alive():
            if time.monotonic() > deadline:
                raise TimeoutError("text embed writes did not finish")
            time.sleep(0.005)
        if self.error is not None:
            raise RuntimeError("One or more text embedding cache writes failed.") from self.error

    def stop(self) -> None:
        self.running = False
        self.thread.join(timeout=5)

    def _run(self, loop: Any) -> None:
        try:
            loop()
        except BaseException as exc:
            self.error = exc
            raise  # threading.excepthook prints it, as it printed in the users' logs

    def _get(self) -> tuple[bytes, Path]:
        try:
            return self.write_queue.get(timeout=self.poll)
        finally:
            self.polled.set()

    def _buggy_loop(self) -> None:
        # The shape of `batch_write_embeddings` in #1147's traceback: `batch` is bound only
        # after a successful get, but the Empty branch reads it.
        while True:
            try:
                first_item = self._get()
                batch = [first_item]
                while True:
                    batch.append(self.write_queue.get_nowait())
            except queue.Empty:
                if len(batch) > 0:  # UnboundLocalError when the very first poll finds nothing
                    self._write_batch(batch)
                    batch = []
                if not self.running:
                    return

    def _fixed_loop(self) -> None:
        batch: list[tuple[bytes, Path]] = []  # initialised: an empty first poll is harmless
        while True:
            try:
                batch.append(self._get())
                while True:
                    batch.append(self.write_queue.get_nowait())
            except queue.Empty:
                if batch:
                    self._write_batch(batch)
                    batch = []
                if not self.running:
                    return

    def _write_batch(self, batch: list[tuple[bytes, Path]]) -> None:
        for blob, path in batch:
            try:
                if self.buggy:
                    write_unlocked(path, blob, self.pause)
                    self.written += 1
                else:
                    self.written += write_atomic(path, blob, self.pause, self.lock_dir)
            finally:
                self.write_queue.task_done()
