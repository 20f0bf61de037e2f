"""SimpleTuner's `compress_cache` decides whether a cache file is gunzipped before torch.load.

bghira/SimpleTuner bc8e6ab7: `simpletuner/helpers/data_backend/local.py` `torch_load` runs
`_decompress_torch` (data_backend/base.py) only when the backend's `compress_cache` is on, and
that falls back to the bytes as they are when they are no gzip, so with it on plain and gzip
entries load alike; with it off, `torch.load(..., map_location="cpu")` gets the gzip bytes and
raises. `compress_cache` is the dataset's own, else `--compress_disk_cache` (default on:
field_registry/sections/advanced.py), for image datasets (builders/base.py
`_get_compression_setting`, config/image.py) and text embed datasets (config/text_embed.py).
The VAE cache is read by its image dataset's backend (factory.py `VAECache(cache_data_backend=
...)`), the text cache by its text_embeds dataset's (`TextEmbeddingCache(data_backend=...)`).
`_compress_torch` writes gzip around the bytes of `torch.save`, as `gzip_file` here does.
"""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path

import pytest
import torch

from cachedoctor.fixtures.projects import simpletuner

from conftest import by_code, scan_paths


def save(path: Path, compress_cache: bool) -> None:
    """Rewrite a cache file as SimpleTuner's `torch_save` writes it: `torch.save`, with
    compress_cache wrapped in gzip by `_compress_torch`."""
    data = torch.load(io.BytesIO(_plain(path.read_bytes())), map_location="cpu", weights_only=True)
    raw = io.BytesIO()
    torch.save(data, raw)
    if not compress_cache:
        path.write_bytes(raw.getvalue())
        return
    out = io.BytesIO()
    with gzip.GzipFile(fileobj=out, mode="wb") as f:
        f.write(raw.getvalue())
    path.write_bytes(out.getvalue())


def _plain(data: bytes) -> bytes:
    return gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data


def loads(path: Path, compress_cache: bool) -> bool:
    """Whether LocalDataBackend.torch_load reads the file with this compress_cache."""
    data = io.BytesIO(path.read_bytes())
    if compress_cache:
        try:  # _decompress_torch: the bytes as they are when they are no gzip
            data = io.BytesIO(gzip.GzipFile(fileobj=data, mode="rb").read())
        except Exception:
            data.seek(0)
    try:
        torch.load(data, map_location="cpu", weights_only=True)
    except Exception:
        return False
    return True


def _project(tmp_path: Path) -> tuple[simpletuner.Project, list[Path]]:
    project = simpletuner.build(tmp_path / "st")
    files = sorted((project.root / "cache").rglob("*.pt")) + sorted(
        (project.root / "output").rglob("*.pt"))
    for n, path in enumerate(files):  # one of three plain, as before compress_disk_cache was on
        save(path, bool(n % 3))
    return project, files


def _set(config: Path, key: str, value: object, index: int | None = None) -> None:
    data = json.loads(config.read_text())
    if index is None:
        data[key] = value
    else:
        data[index][key] = value
    config.write_text(json.dumps(data, indent=2))


def test_compress_disk_cache_on_reads_gzip_and_plain_alike(tmp_path: Path) -> None:
    project, files = _project(tmp_path)
    assert {p.read_bytes()[:2] == b"\x1f\x8b" for p in files} == {True, False}
    assert all(loads(p, True) for p in files)
    assert not by_code(scan_paths(project.config), "CD109")


def test_compress_disk_cache_off_is_cd109_on_each_gzip_entry(tmp_path: Path) -> None:
    project, files = _project(tmp_path)
    _set(project.config, "--compress_disk_cache", False)
    rejected = sorted(str(p) for p in files if not loads(p, False))
    assert rejected and len(rejected) < len(files)
    found = by_code(scan_paths(project.config), "CD109")
    assert sorted(f.path for f in found) == rejected
    assert "config.json" in found[0].message and found[0].severity.name == "ERROR"
    # scanned without the config, the loader is unknown
    assert not by_code(scan_paths(project.root / "cache"), "CD109")


@pytest.mark.parametrize("dataset_value", [True, False])
def test_a_dataset_s_compress_cache_wins_over_the_global_flag(tmp_path: Path,
                                                              dataset_value: bool) -> None:
    project, files = _project(tmp_path)
    _set(project.config, "--compress_disk_cache", not dataset_value)
    backend = project.config.parent / "multidatabackend.json"
    backends = json.loads(backend.read_text())
    text = next(i for i, b in enumerate(backends) if b.get("dataset_type") == "text_embeds")
    _set(backend, "compress_cache", dataset_value, text)  # the text embed dataset only
    text_dir = project.root / "cache" / "text"
    found = {f.path for f in by_code(scan_paths(project.config), "CD109")}
    texts = {str(p) for p in files if p.is_relative_to(text_dir)}
    assert texts
    expect_text = set() if dataset_value else {p for p in texts if not loads(Path(p), False)}
    expect_vae = {str(p) for p in files if str(p) not in texts and not loads(p, False)} \
        if dataset_value else set()
    assert found == expect_text | expect_vae


@pytest.mark.parametrize("embeds_compress", [True, False])
def test_the_image_embeds_backend_a_dataset_names_reads_its_vae_cache(
        tmp_path: Path, embeds_compress: bool) -> None:
    """factory.py `_get_image_embed_backend`: a dataset with `image_embeds: <id>` has its VAE
    cache read through that image_embeds dataset's backend (`VAECache(cache_data_backend=...)`),
    so that backend's compress_cache decides, not the dataset's own."""
    project, files = _project(tmp_path)
    backend = project.config.parent / "multidatabackend.json"
    backends = json.loads(backend.read_text())
    photos = next(i for i, b in enumerate(backends) if b.get("id") == "photos")
    backends[photos]["image_embeds"] = "vae-store"
    backends[photos]["compress_cache"] = not embeds_compress
    backends.append({"id": "vae-store", "type": "local", "dataset_type": "image_embeds",
                     "compress_cache": embeds_compress})
    backend.write_text(json.dumps(backends, indent=2))
    text_dir = project.root / "cache" / "text"
    vae = {str(p) for p in files if not p.is_relative_to(text_dir)}
    found = {f.path for f in by_code(scan_paths(project.config), "CD109")}
    assert found == (set() if embeds_compress else {p for p in vae if not loads(Path(p), False)})
    assert found or embeds_compress
