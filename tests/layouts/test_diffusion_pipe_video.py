"""diffusion-pipe video caches with the items its caching really stores (tdrussell/diffusion-pipe
8f83dbf2): utils/dataset.py `latents_map_fn` hands `_map_and_cache` a batch of `latents`,
`mask` (None without a mask file), `image_spec` and `caption`, which `unbatch_iter` splits and
clones into one item per video; `text_embedding_map_fn` adds `image_spec` to the text
encoder's output (models/wan/wan.py: `text_embeddings` [512, 4096] and `seq_lens`). Wan's
latents are [16, (F-1)//4+1, H/8, W/8], one size bucket `cache_<AR>x<W>x<H>x<F>` per frame
bucket. Upstream's utils/cache.py `Cache` wrote such a project on CPU when this test was made
(items as above, frame buckets [1, 17, 33]) and it scanned clean; here the fixture's
ShardWriter, which makes the same statements, writes it (the text feature size cut from 4096
to 64 to keep the test small).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cachedoctor.fixtures.projects import diffusion_pipe as dp

from conftest import by_code, scan_paths

torch = pytest.importorskip("torch")

SEVERE = 2
# (file, W, H, frames): two AR buckets, frame buckets 1, 17 and 33
MEDIA = [("v0.mp4", 128, 96, 33), ("v1.mp4", 128, 96, 33), ("v2.mp4", 128, 96, 17),
         ("v3.mp4", 96, 128, 17), ("i4.png", 128, 96, 1), ("i5.png", 96, 128, 1)]


def wan_project(root: Path) -> Path:
    folder = root / "dataset"
    cache = folder / "cache" / "wan"
    buckets: dict[tuple, list] = {}
    for name, w, h, f in MEDIA:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(b"\x00" * 16)
        (folder / name).with_suffix(".txt").write_text(f"a clip {name}")
        buckets.setdefault((w, h, f), []).append(name)
    (cache / "metadata").mkdir(parents=True)
    (cache / "metadata" / "grouping_keys.json").write_text(
        json.dumps([[round(w / h, 3), w, h, f] for w, h, f in buckets]))
    for (w, h, f), names in buckets.items():
        bucket = cache / dp.bucket_dir(w, h, f)
        latents, texts = dp.ShardWriter(bucket / "latents"), dp.ShardWriter(bucket / "text_embeddings_1")
        for name in names:
            spec = (None, str(folder / name))
            latents.add({"latents": torch.randn(16, (f - 1) // 4 + 1, h // 8, w // 8).to(torch.bfloat16),
                         "mask": None, "image_spec": spec, "caption": f"a clip {name}"})
            texts.add({"text_embeddings": torch.randn(512, 64).to(torch.bfloat16),
                       "seq_lens": torch.tensor(3 + len(name)), "image_spec": spec})
        latents.close()
        texts.close()
    uncond = dp.ShardWriter(cache / "uncond_text_embeddings_1")
    uncond.add({"text_embeddings": torch.randn(512, 64).to(torch.bfloat16), "seq_lens": torch.tensor(1)})
    uncond.close()
    (root / "dataset.toml").write_text(
        "resolutions = [112]\nenable_ar_bucket = true\nmin_ar = 0.5\nmax_ar = 2.0\n"
        "num_ar_buckets = 2\nframe_buckets = [1, 17, 33]\n\n[[directory]]\npath = 'dataset'\n")
    (root / "config.toml").write_text(
        "output_dir = 'runs'\ndataset = 'dataset.toml'\n\n[model]\ntype = 'wan'\ndtype = 'bfloat16'\n")
    return root


@pytest.mark.parametrize("deep", [False, True])
def test_wan_video_buckets_of_several_frame_counts_scan_clean(tmp_path: Path, deep: bool) -> None:
    root = wan_project(tmp_path / "p")
    for target in (root / "config.toml", root / "dataset.toml", root, root / "dataset"):
        report = scan_paths(target, deep=deep)
        assert [(f.code, f.path) for f in report.findings if f.severity >= SEVERE] == [], target


def test_a_latent_of_another_frame_count_in_a_bucket_is_cd301(tmp_path: Path) -> None:
    """A 33-frame bucket's cache holding a 17-frame clip's latent (one item added by another
    frame_buckets setting) disagrees in shape with the bucket."""
    root = wan_project(tmp_path / "p")
    bucket = root / "dataset" / "cache" / "wan" / dp.bucket_dir(128, 96, 33) / "latents"
    writer = dp.ShardWriter(bucket)
    writer.add({"latents": torch.randn(16, 5, 12, 16).to(torch.bfloat16), "mask": None,
                "image_spec": (None, "v9.mp4"), "caption": "a clip"})
    writer.add({"latents": torch.randn(16, 9, 12, 16).to(torch.bfloat16), "mask": None,
                "image_spec": (None, "v8.mp4"), "caption": "a clip"})
    writer.close()
    found = by_code(scan_paths(root / "config.toml"), "CD301")
    assert [Path(f.path).name for f in found] == ["shard_1.bin@0"]
    assert "[16, 5, 12, 16]" in found[0].message
