"""Text embeds written by older SimpleTuner: before the dict format (d27ed803, 2025-03 model
refactor) `save_to_cache` stored a tuple, `(prompt_embeds, add_text_embeds)` for SDXL
(helpers/caching/text_embeds.py at 2f8fc6e7, 2024-11); bc8e6ab7 still loads it
(`load_from_cache` converts tuples)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cachedoctor.fixtures.latents import save_latent
from cachedoctor.fixtures.projects import age_all, simpletuner

from conftest import by_code, scan_paths


def test_tuple_text_embeds_are_clean_and_a_foreign_one_is_cd305(tmp_path: Path) -> None:
    project = simpletuner.build(tmp_path / "st")
    text = project.root / "cache" / "text" / "sdxl"
    for n, path in enumerate(sorted(text.glob("*.pt"))):
        embeds = simpletuner.text_embeds(n)
        save_latent(path, (embeds["prompt_embeds"], embeds["pooled_prompt_embeds"][None]),
                    "gzip" if n % 2 else "zip")
    age_all(project.root)
    for target in (project.config, text):
        assert [f for f in scan_paths(target).findings if f.severity >= 2] == []
    flux = simpletuner.text_embeds(99, "flux")
    bad = text / simpletuner.text_name("an old flux caption\n")
    save_latent(bad, (flux["prompt_embeds"], flux["pooled_prompt_embeds"][None],
                      torch.zeros(1, 3)), "gzip")
    age_all(project.root)
    assert [Path(f.path) for f in by_code(scan_paths(project.config), "CD305")] == [bad]


# -- aspect bucket files ------------------------------------------------------------------------
# SimpleTuner loads `aspect_ratio_bucket_indices<suffix>.json` with `cache_data.get(
# "aspect_ratio_bucket_indices", {})` and makes its keys floats through `.items()`
# (simpletuner/helpers/metadata/backends/discovery.py `reload_cache`, bc8e6ab7): a JSON object
# without the key is no buckets, re-bucketed and rewritten at the next start.


def _indices(project) -> Path:
    return project.root / "datasets" / "photos" / "aspect_ratio_bucket_indices_photos.json"


def _serious(target: Path) -> list[tuple[str, str]]:
    return [(f.code, f.message) for f in scan_paths(target).findings if f.severity >= 2]


def test_a_june_2023_bucket_file_is_no_error(tmp_path: Path) -> None:
    """From 172f2949 (2023-06-17) to 0dc45f37 (2023-08-15) helpers/dreambooth_dataset.py
    dumped the mapping itself, `json.dump(self.aspect_ratio_bucket_indices, f)`, with no
    wrapper and no `config`; a caption dataset's file (metadata/backends/caption.py, since
    17294646) holds `{"config", "ordered_ids"}`."""
    project = simpletuner.build(tmp_path / "st")
    path = _indices(project)
    wrapped = json.loads(path.read_text())
    path.write_text(json.dumps(wrapped["aspect_ratio_bucket_indices"]))
    assert _serious(project.config) == []
    path.write_text(json.dumps({"config": wrapped["config"], "ordered_ids": ["a", "b"]}))
    assert _serious(project.config) == []
    path.write_text(json.dumps({"config": wrapped["config"], "aspect_ratio_bucket_indices": None}))
    assert _serious(project.config) == []


@pytest.mark.parametrize(("content", "why"), [
    ('["1.0", "0.67"]', "holds a list: expected a JSON object"),
    ('{"config": {}, "aspect_ratio_bucket_indices": ["/data/a.png"]}',
     "aspect_ratio_bucket_indices is a list"),
    ('{"config": {}, "aspect_ratio_bucket_indices": {"1.0": ["/data/a.png"]', "not valid JSON"),
])
def test_a_bucket_file_simpletuner_cannot_load_is_cd409(tmp_path: Path, content: str,
                                                         why: str) -> None:
    project = simpletuner.build(tmp_path / "st")
    _indices(project).write_text(content)
    (finding,) = by_code(scan_paths(project.config), "CD409")
    assert why in finding.message and Path(finding.path) == _indices(project)


def test_a_null_cache_file_suffix_names_the_file_without_one(tmp_path: Path) -> None:
    """`"cache_file_suffix": null` keeps the name SimpleTuner used before 9b833d22f (2024-08-22)
    made the id the default (MetadataBackend: `if cache_file_suffix is not None`), as that
    commit told users to set it: the bucket file read is `aspect_ratio_bucket_indices.json`."""
    project = simpletuner.build(tmp_path / "st")
    backends = project.root / "config" / "multidatabackend.json"
    config = json.loads(backends.read_text())
    config[0]["cache_file_suffix"] = None
    backends.write_text(json.dumps(config))
    photos = project.root / "datasets" / "photos"
    for kind in ("indices", "metadata"):
        (photos / f"aspect_ratio_bucket_{kind}_photos.json").rename(
            photos / f"aspect_ratio_bucket_{kind}.json")
    age_all(project.root)
    assert _serious(project.config) == []
    (photos / "aspect_ratio_bucket_indices.json").write_text('{"aspect_ratio_bucket_indices": [1]}')
    assert [code for code, _ in _serious(project.config)] == ["CD409"]


def test_an_unhashed_vae_cache_scanned_from_above_is_no_bucket_split(tmp_path: Path) -> None:
    """Before hashing (SimpleTuner before d647d99f, 2024-08-05, or `hash_filenames: false` until
    3a00257a) caching/vae.py `generate_vae_cache_filename` named a latent `<stem>.pt`, in the
    image's sub-folder under `cache_dir_vae`: one folder holds every aspect bucket. Scanned bare
    from any folder above, no folder of it is a bucket; a bucket-named folder still is."""
    from cachedoctor.fixtures.projects import encode, images

    cache = tmp_path / "output" / "cache" / "vae" / "sdxl" / "photos"
    written = images(tmp_path / "photos", n_per_bucket=2, caption=False)
    written += images(tmp_path / "photos" / "closeups", n_per_bucket=2, seed=3, caption=False)
    for n, (path, width, height, seed) in enumerate(written):
        folder = cache / path.parent.relative_to(tmp_path / "photos")
        folder.mkdir(parents=True, exist_ok=True)
        save_latent(folder / f"{path.stem}.pt", encode(path, width, height, seed, dtype="bfloat16"),
                    "gzip" if n % 2 else "zip")
    age_all(tmp_path)
    for target in (cache, cache.parent, cache.parent.parent, tmp_path / "output"):
        assert [(f.code, f.path) for f in scan_paths(target).findings] == [], target
    bucket = cache / "1024x1024"  # a folder named for a bucket: its latents must agree
    bucket.mkdir()
    for path, width, height, seed in written[:3]:
        save_latent(bucket / f"{path.stem}.pt", encode(path, width, height, seed, dtype="bfloat16"))
    assert [f.code for f in scan_paths(tmp_path / "output").findings] == ["CD301"]
