"""The harness's parts in one process: SimpleTuner's names and files, the writers' bugs and fixes."""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import pytest
import torch

from cachedoctor.harness.encoders import TinyTextEncoder, read_images, vae_on
from cachedoctor.harness.project import (
    BUCKETS,
    MIN_PER_BUCKET,
    discover,
    read_buckets,
    write_bucket_files,
    write_project,
)
from cachedoctor.harness.writers import LatentWriter, TextEmbedCache, serialized, write_atomic, write_unlocked

from conftest import codes, scan_paths

CPU = torch.device("cpu")


def test_project_uses_simpletuner_names_and_files(tmp_path: Path) -> None:
    project = write_project(tmp_path, processes=2, family="flux", clear_each_epoch=True)
    config = json.loads(project.config_path.read_text())
    assert config["--num_processes"] == 2 and config["--model_family"] == "flux"
    assert config["--data_backend_config"] == str(project.backend_path)
    image_entry, text_entry = json.loads(project.backend_path.read_text())
    assert image_entry["instance_data_dir"] == str(project.image_dir)
    assert image_entry["cache_dir_vae"] == str(project.vae_cache_dir) != str(project.image_dir)
    assert image_entry["vae_cache_clear_each_epoch"] is True
    assert text_entry == {"id": "text-embeds", "type": "local", "dataset_type": "text_embeds", "default": True,
                          "cache_dir": str(project.text_cache_dir)}
    image = project.image_dir / "img_003.png"
    assert project.vae_cache_path(image).name == hashlib.sha256(b"img_003").hexdigest() + ".pt"
    caption = (project.image_dir / "img_003.txt").read_text().strip()
    assert project.text_cache_path(caption).name == hashlib.md5(caption.encode()).hexdigest() + "-flux.pt"
    assert project.channels == 16


def test_bucket_files_round_trip(tmp_path: Path) -> None:
    project = write_project(tmp_path, processes=1)
    found = discover(project)
    assert len(found) == len(BUCKETS) * MIN_PER_BUCKET
    assert {s.bucket for s in found} == set(BUCKETS)
    write_bucket_files(project, found)
    indices = json.loads(project.bucket_file("indices").read_text())
    assert set(indices["aspect_ratio_bucket_indices"]) == set(BUCKETS)
    metadata = json.loads(project.bucket_file("metadata").read_text())
    assert metadata[found[0].path]["target_size"] == list(found[0].size)
    assert read_buckets(project) == found


def test_overlapping_dirs_make_cache_files_samples(tmp_path: Path) -> None:
    project = write_project(tmp_path, processes=1, overlap=True)
    assert project.vae_cache_dir == project.image_dir
    (project.vae_cache_path("img_000.png")).write_bytes(b"not an image")
    stray = [s for s in discover(project) if s.path.endswith(".pt")]
    assert len(stray) == 1 and stray[0].size is None and stray[0].bucket == "1.0" and stray[0].caption == ""


@pytest.mark.parametrize(("writer", "expected"), [
    (LatentWriter(), set()),
    (LatentWriter(clone=False), {"CD201"}),
    (LatentWriter(to_cpu=False, gpu_stand_in="cuda:1", with_conditioning=True), {"CD501", "CD502"}),
])
def test_latent_writer_bugs_are_what_scan_reports(tmp_path: Path, writer: LatentWriter, expected: set) -> None:
    project = write_project(tmp_path / "project", processes=1)
    images = sorted(project.image_dir.glob("img_00[0-3].png"))
    batch = vae_on(CPU, project.channels).encode(read_images(images, CPU))
    cache = tmp_path / "cache"
    cache.mkdir()
    writer.save_batch([cache / f"{i}.pt" for i in range(4)], batch, [(128, 128)] * 4)
    assert codes(scan_paths(cache)) == expected


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the point of the test
def test_buggy_writer_thread_dies_when_its_first_poll_is_empty(tmp_path: Path) -> None:
    cache = TextEmbedCache(buggy=True, lock_dir=tmp_path, poll=0.01)
    assert cache.polled.wait(10)
    cache.thread.join(10)
    assert isinstance(cache.error, UnboundLocalError)
    assert str(cache.error) == "cannot access local variable 'batch' where it is not associated with a value"


def test_fixed_writer_thread_survives_it_and_writes(tmp_path: Path) -> None:
    cache = TextEmbedCache(buggy=False, lock_dir=tmp_path, poll=0.01, pause=0.0)
    assert cache.polled.wait(10)
    entry = TinyTextEncoder(CPU).encode("a fox")
    cache.save_to_cache(tmp_path / "a.pt", entry)
    cache.wait_for_pending_writes()
    cache.stop()
    assert cache.error is None and cache.written == 1
    assert torch.equal(torch.load(tmp_path / "a.pt", weights_only=True)["prompt_embeds"], entry["prompt_embeds"])


def _embed_blob() -> bytes:
    return serialized(TinyTextEncoder(CPU).encode("a watercolor of a lighthouse"))


def test_a_reader_meets_the_unlocked_write_half_way(tmp_path: Path) -> None:
    blob, path = _embed_blob(), tmp_path / "e.pt"
    writer = threading.Thread(target=write_unlocked, args=(path, blob, 1.0))
    writer.start()
    while not (path.exists() and path.stat().st_size == len(blob) // 2):
        pass
    with pytest.raises(RuntimeError, match="failed finding central directory"):
        torch.load(path, weights_only=True)
    writer.join()
    torch.load(path, weights_only=True)


def test_the_atomic_write_is_whole_or_absent(tmp_path: Path) -> None:
    blob, path = _embed_blob(), tmp_path / "e.pt"
    locks = tmp_path / "locks"
    locks.mkdir()
    writer = threading.Thread(target=write_atomic, args=(path, blob, 0.3, locks))
    writer.start()
    sizes = set()
    while writer.is_alive():
        if path.exists():
            sizes.add(path.stat().st_size)
    writer.join()
    assert sizes <= {len(blob)} and path.read_bytes() == blob
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("tmp")] == []
    assert write_atomic(path, blob, 0.0, locks) is False  # another rank wrote it: skipped
