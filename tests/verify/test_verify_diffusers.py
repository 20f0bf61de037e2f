"""verify with a real diffusers AutoencoderKL: tiny, random weights, saved with save_pretrained
(factor 8), on the CPU; and the same on CUDA where there is a GPU. Skipped without diffusers."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from verify_helpers import BUILDERS, bucket_of, digest, pairs, replace_image, rewrite

from cachedoctor.fixtures.projects import kohya, simpletuner
from cachedoctor.images import load
from cachedoctor.layouts import resolve
from cachedoctor.repair.encoders import resolve as resolve_encoder
from cachedoctor.verify import VerifyOptions, run
from cachedoctor.verify.sample import SampleSize

# imported when a test runs, not at collection: tests/repair/test_reencode.py puts a fake
# diffusers on sys.path, which a module imported at collection would shadow
# (and leaves it in sys.modules)
REAL = importlib.util.find_spec("diffusers")
pytestmark = pytest.mark.skipif(REAL is None, reason="needs diffusers")


def autoencoder_kl() -> type:
    """diffusers.AutoencoderKL, imported late (the real one, not a fake another test left)."""
    loaded = sys.modules.get("diffusers")
    if loaded is not None and getattr(loaded, "__file__", None) != REAL.origin:
        for name in [n for n in sys.modules if n == "diffusers" or n.startswith("diffusers.")]:
            del sys.modules[name]
    from diffusers import AutoencoderKL

    return AutoencoderKL


def tiny_vae(directory: Path, seed: int, scaling_factor: float = 0.13025) -> Path:
    """A factor-8 AutoencoderKL (four blocks, three downsamplings) with random weights."""
    torch.manual_seed(seed)
    vae = autoencoder_kl()(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
        latent_channels=4, norm_num_groups=4, sample_size=64, scaling_factor=scaling_factor)
    vae.save_pretrained(directory)
    return directory


def mean_latent(vae_dir: Path, image: Path) -> torch.Tensor:
    """The posterior mean of the image, computed here as a trainer does it."""
    vae = autoencoder_kl().from_pretrained(vae_dir).eval()
    x = load(str(image)).float()[None] / 127.5 - 1.0
    with torch.no_grad():
        return vae.encode(x).latent_dist.mean[0]


def cache_with(project, vae_dir: Path, scale: float = 1.0) -> None:
    """Every entry written again as the latent of `vae_dir` (times `scale`)."""
    for entry, image in pairs(project).items():
        latent = mean_latent(vae_dir, image) * scale
        rewrite(entry, lambda _, latent=latent: latent)


def verify(project, vae_dir: Path, device: str = "cpu"):
    return run(resolve([str(project.config)]), resolve_encoder(f"diffusers:{vae_dir}"),
               VerifyOptions(sample=SampleSize.parse("all"), device=device))


@pytest.fixture(scope="module")
def vaes(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("vaes")
    return tiny_vae(root / "vae", 0), tiny_vae(root / "other", 1)


def test_a_cache_of_the_same_vae_verifies(vaes, tmp_path: Path) -> None:
    project = kohya.build(tmp_path / "kohya")
    cache_with(project, vaes[0])
    before = digest(project.root)
    report = verify(project, vaes[0])
    assert not report.findings and len(report.datasets[0].compared) == 9
    assert report.datasets[0].distribution()["distance"]["max"] < 0.01
    assert digest(project.root) == before


def test_a_cache_of_another_vae_is_cd601(vaes, tmp_path: Path) -> None:
    project = kohya.build(tmp_path / "kohya")
    cache_with(project, vaes[1])
    assert [f.code for f in verify(project, vaes[0]).findings] == ["CD601"]


def test_simpletuner_latents_stored_without_the_scaling_factor_are_cd602(vaes, tmp_path: Path) -> None:
    """SimpleTuner stores latents scaled by the VAE's scaling_factor: unscaled ones are x1/0.13025."""
    project = simpletuner.build(tmp_path / "simpletuner")
    cache_with(project, vaes[0])
    [finding] = verify(project, vaes[0]).findings
    assert finding.code == "CD602" and abs(finding.details["scale"] - 1 / 0.13025) < 0.05
    assert "x1/0.13025" in finding.message


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_same_on_cuda(vaes, tmp_path: Path) -> None:
    project = simpletuner.build(tmp_path / "simpletuner")
    cache_with(project, vaes[0], scale=0.13025)
    clean = verify(project, vaes[0], device="cuda")
    assert not clean.findings and clean.options.device == "cuda"
    assert clean.datasets[0].distribution()["distance"]["max"] < 0.05  # GPU kernels differ a little
    cache_with(project, vaes[1], scale=0.13025)
    assert [f.code for f in verify(project, vaes[0], device="cuda").findings] == ["CD601"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_cli_on_cuda_names_a_planted_defect(vaes, tmp_path: Path) -> None:
    """What the README tells a GPU host to run: `verify CONFIG --encoder diffusers:PATH --device
    cuda`; a mirrored entry among clean ones is CD603 there too."""
    import json

    from verify_helpers import pairs

    from conftest import invoke

    project = kohya.build(tmp_path / "kohya")
    cache_with(project, vaes[0])
    entry, image = sorted(pairs(project).items())[4]
    vae = autoencoder_kl().from_pretrained(vaes[0]).eval()
    with torch.no_grad():
        x = load(str(image)).flip(-1).float()[None] / 127.5 - 1.0
        mirrored = vae.encode(x).latent_dist.mean[0]
    rewrite(entry, lambda _: mirrored)
    result = invoke("verify", str(project.config), "--encoder", f"diffusers:{vaes[0]}", "--device", "cuda",
                    "--sample", "all", "--batch-size", "4", "--format", "json", "-q")
    data = json.loads(result.stdout)
    assert data["device"] == "cuda" and data["images_per_second"] > 0
    assert [(f["code"], f["path"]) for f in data["findings"]] == [("CD603", str(entry))]


# -- each planted defect, with the diffusers VAE, in each trainer's layout -----------------------

SCALED = {"simpletuner", "ai-toolkit"}  # they store latent * scaling_factor (0.13025 here)


def flipped_latent(vae_dir: Path, image: Path) -> torch.Tensor:
    """The posterior mean of the image mirrored left to right."""
    vae = autoencoder_kl().from_pretrained(vae_dir).eval()
    x = load(str(image)).float().flip(-1)[None] / 127.5 - 1.0
    with torch.no_grad():
        return vae.encode(x).latent_dist.mean[0]


@pytest.fixture(params=list(BUILDERS))
def encoded_project(request, vaes, tmp_path: Path):
    """A trainer's project whose every entry is the tiny VAE's latent, stored as it stores it."""
    project = BUILDERS[request.param](tmp_path / request.param)
    scale = 0.13025 if request.param in SCALED else 1.0
    cache_with(project, vaes[0], scale)
    return project, scale


def test_each_layout_verifies_clean_and_names_each_defect(vaes, encoded_project) -> None:
    project, scale = encoded_project
    assert verify(project, vaes[0]).findings == []
    ordered = sorted(pairs(project).items())
    # mirrored: one entry is the latent of its image flipped
    flipped, image = ordered[4]
    latent = flipped_latent(vaes[0], image) * scale
    rewrite(flipped, lambda _: latent)
    # swapped: two entries of one bucket hold each other's latents
    by_bucket = sorted((p for p in ordered if p[0] != flipped), key=lambda p: (bucket_of(p[1]), str(p[0])))
    (a, image_a), (b, image_b) = by_bucket[0], by_bucket[1]
    assert bucket_of(image_a) == bucket_of(image_b)
    latent_a, latent_b = mean_latent(vaes[0], image_a) * scale, mean_latent(vaes[0], image_b) * scale
    rewrite(a, lambda _: latent_b)
    rewrite(b, lambda _: latent_a)
    # stale: an image replaced since, its mtime put back
    stale, stale_image = next(p for p in ordered if p[0] not in (flipped, a, b))
    replace_image(stale_image, seed=999)

    codes: dict[str, list[str]] = {}
    for f in verify(project, vaes[0]).findings:
        codes.setdefault(f.code, []).append(f.path)
    assert codes == {"CD603": [str(flipped)], "CD605": sorted([str(a), str(b)]),
                     "CD606": [str(stale)]}


def test_each_layout_names_another_vae_and_a_scale(vaes, encoded_project, tmp_path: Path) -> None:
    project, scale = encoded_project
    cache_with(project, vaes[0], scale * 0.18215)  # SD 1.x's factor applied once more
    [finding] = verify(project, vaes[0]).findings
    assert finding.code == "CD602" and abs(finding.details["scale"] - 0.18215) < 0.01
    cache_with(project, vaes[1], scale)
    assert [f.code for f in verify(project, vaes[0]).findings] == ["CD601"]
