"""ai-toolkit datasets with a list of resolutions (`resolution: [128, 192]`, as its example
configs): ai-toolkit splits such a dataset into one per resolution (config_modules.py
preprocess_dataset_raw_config), all caching into one `_latent_cache`, so an image has one entry
per distinct bucket. The geometry (BY_HAND) is worked out by hand from toolkit/buckets.py
get_bucket_for_image_size and BucketsMixin.setup_buckets (bucket_tolerance 64, centre crop):
in fixtures/projects/aitoolkit.py."""

from __future__ import annotations

from pathlib import Path

from safetensors import safe_open

from cachedoctor.fixtures.projects import aitoolkit
from cachedoctor.fixtures.projects.aitoolkit import BY_HAND
from cachedoctor.layouts.aitoolkit import Buckets, bucket_for

from conftest import by_code, codes, invoke, scan_paths


def test_buckets_follow_ai_toolkit() -> None:
    assert bucket_for(192, 128, 128, 64) == (128, 128)  # 128x64, 128x128, 192x64 fit; nearest
    assert bucket_for(1000, 600, 512, 64) == (640, 384)  # the only candidate under 512²
    assert bucket_for(192, 128, 192, 64) == (192, 128)  # under the cap: its own size
    buckets = Buckets((128, 192))
    for size, geometries in BY_HAND.items():
        assert tuple(buckets.geometry(size, r) for r in (128, 192)) == geometries
        assert buckets.crops(size) == list(dict.fromkeys(g[4:] for g in geometries))
    assert Buckets((512,), square=True).geometry((1000, 600), 512) == (854, 512, 171, 0, 512, 512)


def project(tmp_path: Path) -> tuple[Path, Path, dict[str, list[Path]]]:
    built, folder, entries = aitoolkit.multi_resolution(tmp_path / "ait")
    return built.config, folder, entries


def test_a_complete_multi_resolution_cache_is_clean(tmp_path: Path) -> None:
    config, _, _ = project(tmp_path)
    assert not [f for f in scan_paths(config).findings if f.severity >= 2]


def test_one_resolution_s_entry_gone_is_cd404_and_reencode_writes_that_one(tmp_path: Path) -> None:
    config, folder, entries = project(tmp_path)
    [small, large] = entries["img_100.png"]  # a 192x128 image: 128x128 and 192x128 buckets
    small.unlink()

    (missing,) = by_code(scan_paths(config), "CD404")
    assert missing.path == str(folder / "img_100.png")
    assert "128x128 bucket" in missing.message, missing.message
    assert not by_code(scan_paths(config), "CD405")  # its 192x128 entry is no orphan

    result = invoke("fix", str(config), "--reencode", "--encoder", "reference", "--yes")

    assert result.exit_code == 0, result.output
    assert small.exists() and large.exists()  # ai-toolkit's own name: the hash of its info
    assert not codes(scan_paths(config))


def test_a_quarantined_entry_is_encoded_again_at_its_own_resolution(tmp_path: Path) -> None:
    """The empty 128x128 entry of a 192x128 image: no header, so the resolution is the one
    whose info gives the hash in its name (not the other resolution of the same image size)."""
    config, _, entries = project(tmp_path)
    small, _ = entries["img_101.png"]
    small.write_bytes(b"")
    assert "CD102" in codes(scan_paths(config))

    result = invoke("fix", str(config), "--reencode", "--encoder", "reference", "--yes")

    assert result.exit_code == 0, result.output
    assert small.stat().st_size > 0

    with safe_open(str(small), "pt") as f:
        assert f.metadata()["crop_width"] == "128" and f.get_tensor("latent").shape == (4, 16, 16)
    assert not codes(scan_paths(config))
