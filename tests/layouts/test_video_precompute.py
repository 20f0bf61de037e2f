"""Precomputed caches of two video trainers cachedoctor has no config for, scanned bare.

Each file is written as the trainer's own writer writes it; the writers ran on CPU with tiny
random diffusers VAEs and T5 encoders when these tests were made, and the keys, shapes,
dtypes and devices below are what they saved:
- LTX-Video-Trainer (Lightricks/LTX-Video-Trainer 31b1273): scripts/preprocess_dataset.py
  writes `<dataset dir>/.precomputed/{latents,conditions}/<media path>.pt` (and
  `reference_latents/` for IC-LoRA), mirroring the media's relative path;
  scripts/process_videos.py saves `{"latents": [F*H*W, 128] bf16 (src/ltxv_trainer/ltxv_utils.py
  encode_video packs the latent into a sequence), "num_frames", "height", "width", "fps"}`,
  scripts/process_captions.py `{"prompt_embeds": [128, 4096], "prompt_attention_mask": [128]
  bool}`, each `.cpu().contiguous()`.
  The dataset dir itself is the dataset's (src/ltxv_trainer/datasets.py PrecomputedDataset
  takes it for `.precomputed/`).
- finetrainers (a-r-r-o-w/finetrainers f476c37): finetrainers/data/precomputation.py
  `_save_item` writes `<precomputation_dir>/finetrainers-precomputed-data/{condition,latent}-<i>.pt`
  straight from the GPU (the LTX and Wan processors of models/*/base_specification.py and
  processors/t5.py; Wan's latents_mean/std made on the CPU), loaded with map_location.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import by_code, scan_paths

torch = pytest.importorskip("torch")

from cachedoctor.fixtures.devices import stored_as  # noqa: E402

SEVERE = 2  # warning and above


def severe(report) -> list:
    return [(f.code, Path(f.path).name, f.message) for f in report.findings
            if f.severity >= SEVERE]


# (media path, latent frames, height, width): buckets of several sizes and lengths, a still
LTX_MEDIA = [("videos/clip_a.mp4", 4, 2, 3), ("videos/clip_b.mp4", 4, 2, 3),
             ("videos/clip_c.mp4", 2, 3, 2), ("videos/sub/clip_d.mp4", 3, 2, 2),
             ("images/still_e.png", 1, 3, 3)]


def ltx_dataset(root: Path, reference: bool = False) -> Path:
    """A dataset dir as preprocess_dataset.py leaves it: media, dataset.json, .precomputed/."""
    pre = root / ".precomputed"
    folders = ("latents", "reference_latents") if reference else ("latents",)
    for media, f, h, w in LTX_MEDIA:
        (root / media).parent.mkdir(parents=True, exist_ok=True)
        (root / media).write_bytes(b"\x00\x00\x00\x18ftypisom")
        rel = Path(media).with_suffix(".pt")
        for folder in folders:
            out = pre / folder / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"latents": torch.randn(f * h * w, 128).to(torch.bfloat16).contiguous(),
                        "num_frames": f, "height": h, "width": w, "fps": 24.0}, out)
        out = pre / "conditions" / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        mask = torch.zeros(128, dtype=torch.bool)
        mask[: 5 + f] = True
        torch.save({"prompt_embeds": torch.randn(128, 4096).to(torch.bfloat16),
                    "prompt_attention_mask": mask}, out)
    (root / "dataset.json").write_text('[{"caption": "a clip", "media_path": "videos/clip_a.mp4"}]')
    return pre


@pytest.mark.parametrize("deep", [False, True])
def test_ltx_video_trainer_precomputed_folder_scans_clean(tmp_path: Path, deep: bool) -> None:
    """Latents of different buckets (packed sequences of different lengths) side by side, by
    design: no shape or channel finding, no foreign file."""
    pre = ltx_dataset(tmp_path / "ds", reference=True)
    for target in (pre, pre / "latents", pre / "conditions"):
        assert severe(scan_paths(target, deep=deep)) == [], target


def test_ltx_video_trainer_truncated_latent_is_still_cd101(tmp_path: Path) -> None:
    pre = ltx_dataset(tmp_path / "ds")
    broken = pre / "latents" / "videos" / "clip_a.pt"
    broken.write_bytes(broken.read_bytes()[:3000])
    assert [(c, name) for c, name, _ in severe(scan_paths(pre))] == [("CD101", "clip_a.pt")]


def test_ltx_video_trainer_dataset_dir_scans_clean(tmp_path: Path) -> None:
    """The dataset dir (which `data.preprocessed_data_root` may name) holds the dataset file
    beside `.precomputed/`: its files are the dataset's, not strays of a cache (CD107); with
    `--decode`, `.precomputed/decoded_videos/` mirrors the media."""
    root = tmp_path / "ds"
    pre = ltx_dataset(root)
    (root / "dataset.csv").write_text("caption,media_path\na clip,videos/clip_a.mp4\n")
    for media, *_ in LTX_MEDIA:
        decoded = pre / "decoded_videos" / media
        decoded.parent.mkdir(parents=True, exist_ok=True)
        decoded.write_bytes((root / media).read_bytes())
    for deep in (False, True):
        assert severe(scan_paths(root, deep=deep)) == []
    assert severe(scan_paths(tmp_path)) == []  # a folder of dataset dirs


def test_ltx_video_trainer_dataset_dir_still_judges_its_caches(tmp_path: Path) -> None:
    """A stray image among the latents is CD107 and a truncated latent CD101, scanned from the
    dataset dir as from `.precomputed/`."""
    root = tmp_path / "ds"
    pre = ltx_dataset(root)
    (pre / "latents" / "videos" / "frame.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    broken = pre / "conditions" / "videos" / "clip_c.pt"
    broken.write_bytes(broken.read_bytes()[:3000])
    for target in (root, pre):
        assert sorted((c, name) for c, name, _ in severe(scan_paths(target))) == [
            ("CD101", "clip_c.pt"), ("CD107", "frame.png")], target


def finetrainers_items(folder: Path, model: str, prefix: str = "", on: str = "cuda:0") -> None:
    """precomputation.py `_save_item` of each item, as saved from the rank's GPU (batch of 1)."""
    folder.mkdir(parents=True, exist_ok=True)
    # (latent frames, h, w) of videos of several sizes and an image
    sizes = [(2, 2, 3), (2, 2, 3), (3, 3, 2), (1, 2, 2)]
    for i, (f, h, w) in enumerate(sizes):
        if model == "ltx":
            mask = torch.zeros(1, 128, dtype=torch.bool)
            mask[0, : 3 + i] = True
            condition = {"encoder_hidden_states": torch.randn(1, 128, 4096).to(torch.bfloat16),
                         "encoder_attention_mask": mask}
            # compute_posterior=False: the VAE's moments (2 x 128 channels); the mean and std
            # are the VAE's buffers, on its device
            latent = {"latents": torch.randn(1, 256, f, h, w).to(torch.bfloat16),
                      "num_frames": f, "height": h, "width": w,
                      "latents_mean": torch.zeros(128, dtype=torch.bfloat16),
                      "latents_std": torch.ones(128, dtype=torch.bfloat16)}
            on_cpu: tuple[str, ...] = ()
        else:
            condition = {"encoder_hidden_states": torch.randn(1, 512, 4096).to(torch.bfloat16)}
            latent = {"latents": torch.randn(1, 32, f, 2 * h, 2 * w).to(torch.bfloat16),
                      "latents_mean": torch.randn(16), "latents_std": torch.rand(16) + 0.5}
            on_cpu = ("latents_mean", "latents_std")  # torch.tensor(vae.config.latents_mean)
        for kind, item, cpu in (("condition", condition, ()), ("latent", latent, on_cpu)):
            gpu = [v for k, v in item.items() if torch.is_tensor(v) and k not in cpu]
            with stored_as(on, only=gpu):
                torch.save(item, folder / f"{prefix or kind}-{i}.pt")


@pytest.mark.parametrize("model", ["ltx", "wan"])
@pytest.mark.parametrize("deep", [False, True])
def test_finetrainers_precomputed_data_scans_clean(tmp_path: Path, model: str, deep: bool) -> None:
    """Saved from the GPU (Wan's latents beside CPU means in one file) and loaded with
    map_location=torch.device(rank): neither CD501 nor CD502, from any folder above."""
    output = tmp_path / "output"
    data = output / "precomputed" / "finetrainers-precomputed-data"
    finetrainers_items(data, model)
    for target in (data, data.parent, output):
        assert severe(scan_paths(target, deep=deep)) == [], target


def test_finetrainers_older_layout_scans_clean(tmp_path: Path) -> None:
    """finetrainers 61d14a7 (trainer.py prepare_precomputations):
    `<data_root>/<model>_<id>_precomputed/{conditions,latents}/<folder>-<process>-<i>.pt`,
    saved from the GPU, loaded with map_location="cpu" (dataset.py)."""
    pre = tmp_path / "data" / "ltx_video_Lightricks-LTX-Video_precomputed"
    for folder in ("conditions", "latents"):
        finetrainers_items(pre / folder, "wan", prefix=f"{folder}-0")
    assert sorted(p.name for p in (pre / "latents").iterdir())[0] == "latents-0-0.pt"
    assert severe(scan_paths(tmp_path / "data")) == []


def test_the_same_files_elsewhere_are_still_judged_by_their_devices(tmp_path: Path) -> None:
    """Only finetrainers' folders are known to be loaded with a map_location: the same Wan
    items in a folder of another name keep CD501 and CD502, and a truncated item in
    finetrainers' folder is still CD101."""
    finetrainers_items(tmp_path / "other", "wan")
    report = scan_paths(tmp_path / "other")
    assert len(by_code(report, "CD502")) == 4  # cuda:0 latents beside CPU means
    assert by_code(report, "CD501")
    data = tmp_path / "out" / "finetrainers-precomputed-data"
    finetrainers_items(data, "ltx")
    broken = data / "latent-2.pt"
    broken.write_bytes(broken.read_bytes()[:3000])
    assert [(c, name) for c, name, _ in severe(scan_paths(data))] == [("CD101", "latent-2.pt")]
