"""ai-toolkit video datasets (Wan 2.1), as ostris/ai-toolkit 27a03a91 writes them: a dataset
with `num_frames > 1` or `auto_frame_count` walks videos beside images (toolkit/data_loader.py
video_extensions), caches each clip as `_latent_cache/<stem>_<hash>.safetensors` with a 4-D
`latent` [C, F, h, w] and a 0-d `num_frames` (dataloader_mixins.py LatentCachingMixin), and
buckets clips by crop size and frame count apart from the images (BucketsMixin.setup_buckets
`bucket_key += f'x{num_frames}f'`). Builders in fixtures/projects/aitoolkit.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cachedoctor.fixtures.projects import aitoolkit

from conftest import by_code, scan_paths


def alarms(report) -> list:
    return [(f.code, f.path, f.message) for f in report.findings if f.severity >= 2]


@pytest.mark.parametrize(("auto", "i2v"), [(False, False), (True, False), (False, True)],
                         ids=["num_frames", "auto_frame_count", "do_i2v"])
def test_a_healthy_video_dataset_scans_clean(tmp_path: Path, auto: bool, i2v: bool) -> None:
    """Clips and images of one crop size are no split bucket (CD301), and the clips' entries
    are no orphans (CD405): before, both fired on every clip."""
    project, folder, entries = aitoolkit.video_dataset(tmp_path / "wan", auto, i2v)
    assert sum(name.endswith(".mp4") for name in entries) == 3
    assert not alarms(scan_paths(project.config))
    assert not alarms(scan_paths(folder))  # bare: the clips are sources there too


def test_a_clip_s_missing_entry_and_a_deleted_clip_are_reported(tmp_path: Path) -> None:
    project, folder, entries = aitoolkit.video_dataset(tmp_path / "wan")
    entries["clip_0.mp4"].unlink()
    (folder / "clip_3.mp4").unlink()

    report = scan_paths(project.config)

    assert [f.path for f in by_code(report, "CD404")] == [str(folder / "clip_0.mp4")]
    assert [f.path for f in by_code(report, "CD405")] == [str(entries["clip_3.mp4"])]
    # without the config, whether the dataset trains its clips is not known: no CD404 for one
    bare = scan_paths(folder)
    assert not by_code(bare, "CD404")
    assert [f.path for f in by_code(bare, "CD405")] == [str(entries["clip_3.mp4"])]


def test_a_clip_of_another_frame_count_in_its_bucket_is_cd301(tmp_path: Path) -> None:
    """num_frames: 33 clips are 9 latent frames; one of 5 in the same bucket breaks the stack."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    project, folder, entries = aitoolkit.video_dataset(tmp_path / "wan")
    path = entries["clip_6.mp4"]
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    crop = (int(metadata["crop_width"]), int(metadata["crop_height"]))
    for name in ("clip_7.mp4", "clip_8.mp4"):  # two more clips of its size: a clear majority
        (folder / name).write_bytes(aitoolkit.CLIP)
        aitoolkit.write_video_entry(folder, folder / name, crop, load_file(str(path)),
                                    {"num_frames": 33})
    tensors = load_file(str(path))
    tensors["latent"] = tensors["latent"][:, :5]
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    assert tensors["num_frames"].item() == 33 and tensors["latent"].dtype == torch.bfloat16

    (split,) = by_code(scan_paths(project.config), "CD301")
    assert split.path == str(path) and "x33f" in split.message, split.message
