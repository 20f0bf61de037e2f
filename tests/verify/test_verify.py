"""`cachedoctor verify` on each trainer's project: a clean cache verifies, each planted defect is
named with its CD6xx diagnosis, nothing is written, and the sample is reproducible."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from verify_helpers import BUILDERS, bucket_of, digest, encoded, pairs, replace_image, rewrite

from cachedoctor.fixtures.clean import kohya_arrays
from cachedoctor.fixtures.images import pixels
from cachedoctor.fixtures.projects import kohya
from cachedoctor.layouts import resolve
from cachedoctor.repair.encoders import ReferenceEncoder
from cachedoctor.verify import VerifyOptions, run
from cachedoctor.verify.sample import SampleSize

from conftest import invoke

TRAINERS = list(BUILDERS)


def verify(project, **options):
    return run(resolve([str(project.config)]), ReferenceEncoder(), VerifyOptions(**options))


def codes_of(report) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for f in report.findings:
        out.setdefault(f.code, []).append(f.path)
    return out


@pytest.fixture(params=TRAINERS)
def project(request, tmp_path: Path):
    return BUILDERS[request.param](tmp_path / request.param)


def test_a_clean_cache_verifies_and_nothing_is_written(project) -> None:
    before = digest(project.root)
    report = verify(project, sample=SampleSize.parse("all"))
    [dataset] = [d for d in report.datasets if d.entries]
    assert dataset.entries == 9 and len(dataset.compared) == 9
    assert not report.findings and all(c.verdict == "ok" for c in dataset.checked)
    assert dataset.distribution()["cosine"]["min"] > 0.999
    assert report.exit_code() == 0 and report.images == 9
    assert digest(project.root) == before


def test_another_encoder_is_cd601(project) -> None:
    for entry, image in pairs(project).items():
        rewrite(entry, lambda _, image=image: encoded(image, seed=1))
    report = verify(project)
    assert list(codes_of(report)) == ["CD601"]
    [finding] = report.findings
    assert finding.details["entries"] == 9 and report.exit_code() == 1


def test_a_scaling_factor_applied_once_more_is_cd602_with_the_factor(project) -> None:
    for entry in pairs(project):
        rewrite(entry, lambda latent: latent.float() * 0.18215)
    report = verify(project)
    [finding] = report.findings
    assert finding.code == "CD602" and abs(finding.details["scale"] - 0.18215) < 0.002
    assert "x0.18" in finding.message and "SD 1.x/2.x's 0.18215" in finding.message


def test_a_latent_of_the_mirrored_image_is_cd603(project) -> None:
    entry, image = sorted(pairs(project).items())[4]
    rewrite(entry, lambda _: encoded(image, flip=True))
    report = verify(project, sample=SampleSize.parse("all"))
    assert codes_of(report) == {"CD603": [str(entry)]}


def test_swapped_latents_are_cd605_naming_the_other_image(project) -> None:
    found = sorted(pairs(project).items(), key=lambda p: (bucket_of(p[1]), str(p[0])))
    (a, image_a), (b, image_b) = found[0], found[1]
    assert bucket_of(image_a) == bucket_of(image_b)
    latent_a, latent_b = encoded(image_a), encoded(image_b)
    rewrite(a, lambda _: latent_b)
    rewrite(b, lambda _: latent_a)
    report = verify(project, sample=SampleSize.parse("all"))
    assert codes_of(report) == {"CD605": sorted([str(a), str(b)])}
    matches = {f.path: f.details["matches"] for f in report.findings}
    assert matches == {str(a): str(image_b), str(b): str(image_a)}


def test_an_image_replaced_with_its_mtime_kept_is_cd606(project) -> None:
    entry, image = sorted(pairs(project).items())[2]
    replace_image(image, seed=999)
    report = verify(project, sample=SampleSize.parse("all"))
    assert codes_of(report) == {"CD606": [str(entry)]}
    assert report.exit_code() == 0 and report.exit_code("warning") == 1


def test_a_shifted_crop_is_cd604(tmp_path: Path) -> None:
    """kohya centres the crop of an image wider than its bucket: a latent of the left edge is
    another crop (the image is 288x256, its bucket 256x256: kohya's crop is at x=16)."""
    project = kohya.build(tmp_path / "kohya")
    folder = project.root / "train" / kohya.DATASET
    image = folder / "img_099.png"
    wide = pixels(288, 256, 99)
    from cachedoctor.fixtures.images import encode_png

    image.write_bytes(encode_png(wide))
    left = torch.from_numpy(wide[:, :256]).permute(2, 0, 1)
    latent = ReferenceEncoder().encode(left, 4)
    entry = folder / kohya.npz_name(image, 288, 256)
    arrays = kohya_arrays(latent)
    np.savez(entry, **{**arrays, "original_size": np.array([288, 256]),
                       "crop_ltrb": np.array([16, 0, 272, 256])})
    report = verify(project, sample=SampleSize.parse("all"))
    assert codes_of(report) == {"CD604": [str(entry)]}
    [finding] = report.findings
    assert finding.details["crop"] == (0, 0) and finding.details["expected_crop"] == (16, 0)


def test_the_sample_is_reproducible_and_per_dataset(tmp_path: Path) -> None:
    project = kohya.build(tmp_path / "kohya")
    first = verify(project, sample=SampleSize.parse("3"), seed=7)
    again = verify(project, sample=SampleSize.parse("3"), seed=7)
    other = [verify(project, sample=SampleSize.parse("3"), seed=s) for s in range(8)]
    picked = [c.entry for c in first.datasets[0].checked]
    assert len(picked) == 3 and picked == [c.entry for c in again.datasets[0].checked]
    assert len({tuple(c.entry for c in r.datasets[0].checked) for r in other}) > 1
    assert SampleSize.parse("10%").of(1_000_000) == 100_000 and SampleSize.parse("1%").of(5) == 1
    assert SampleSize.parse("all").of(9) == 9 and SampleSize.parse("64").of(9) == 9


@pytest.mark.parametrize("bad", ["0", "-1", "0%", "101%", "some", "1.5"])
def test_a_bad_sample_is_one_line_and_exit_2(bad: str, tmp_path: Path) -> None:
    project = kohya.build(tmp_path / "kohya")
    result = invoke("verify", str(project.config), "--encoder", "reference", "--sample", bad)
    assert result.exit_code == 2 and "--sample" in result.stderr and len(result.stderr.splitlines()) == 1


def test_the_cli_prints_the_distribution_findings_and_throughput(tmp_path: Path) -> None:
    project = kohya.build(tmp_path / "kohya")
    entry, image = sorted(pairs(project).items())[4]
    rewrite(entry, lambda _: encoded(image, flip=True))
    text = invoke("verify", str(project.config), "--encoder", "reference", "--fail-on", "warning")
    assert text.exit_code == 1
    assert "CD603 warning" in text.stdout and "images/s on cpu" in text.stdout
    assert "cosine" in text.stdout and "9 of 9 entries sampled" in text.stdout
    assert "entries encoded" in text.stderr  # progress
    out = invoke("verify", str(project.config), "--encoder", "reference", "--format", "json", "-q")
    assert out.exit_code == 0 and out.stderr == ""
    data = json.loads(out.stdout)
    [dataset] = data["datasets"]
    assert dataset["compared"] == 9 and set(dataset["distribution"]) == {"error", "cosine", "distance"}
    assert [f["code"] for f in data["findings"]] == ["CD603"] and data["images_per_second"] > 0
    verdicts = {Path(r["entry"]).name: r["verdict"] for r in dataset["results"]}
    assert verdicts[entry.name] == "CD603" and list(verdicts.values()).count("ok") == 8


def test_cuda_without_a_gpu_is_one_line(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    project = kohya.build(tmp_path / "kohya")
    result = invoke("verify", str(project.config), "--encoder", "reference", "--device", "cuda")
    assert result.exit_code == 2 and "no CUDA device" in result.stderr


def test_a_broken_entry_is_skipped_and_the_others_judged(tmp_path: Path) -> None:
    project = kohya.build(tmp_path / "kohya")
    entry = sorted(pairs(project))[0]
    entry.write_bytes(entry.read_bytes()[:100])
    report = verify(project)
    [dataset] = report.datasets
    skipped = [c for c in dataset.checked if c.verdict == "skipped"]
    assert [c.entry for c in skipped] == [str(entry)] and "scan" in skipped[0].note
    assert len(dataset.compared) == 8 and not report.findings


def test_a_bare_cache_is_not_verified_and_says_why(tmp_path: Path) -> None:
    """SimpleTuner's hash-named entries without its config: no entry says which image it is of."""
    project = BUILDERS["simpletuner"](tmp_path / "simpletuner")
    bare = tmp_path / "bare"
    shutil.copytree(project.root / "output/models/cache/vae/sdxl/photos", bare)
    before = digest(bare)
    report = run(resolve([str(bare)]), ReferenceEncoder(), VerifyOptions())
    [dataset] = report.datasets
    assert not report.findings and not dataset.checked and "trainer's config" in dataset.note
    assert digest(bare) == before


def test_a_kohya_image_dir_without_its_config_skips_each_entry_saying_why(tmp_path: Path) -> None:
    project = kohya.build(tmp_path / "kohya")
    bare = tmp_path / "bare"
    shutil.copytree(project.root / "train" / kohya.DATASET, bare)
    report = run(resolve([str(bare)]), ReferenceEncoder(), VerifyOptions())
    [dataset] = report.datasets
    assert not report.findings and len(dataset.checked) == 9
    assert all(c.verdict == "skipped" and "resolution" in c.note for c in dataset.checked)


def test_an_encoder_that_raises_is_one_line_and_exit_2(tmp_path: Path) -> None:
    project = kohya.build(tmp_path / "kohya")
    result = invoke("verify", str(project.config), "--encoder", "verify_helpers:failing_encoder", "-q")
    assert result.exit_code == 2 and len(result.stderr.splitlines()) == 1
    assert "failing_encoder failed" in result.stderr and "out of memory" in result.stderr


def test_a_module_callable_encoder_is_used_and_its_scale_named(tmp_path: Path) -> None:
    project = kohya.build(tmp_path / "kohya")
    result = invoke("verify", str(project.config), "--encoder", "verify_helpers:halving_encoder",
                    "--format", "json", "-q")
    data = json.loads(result.stdout)
    [finding] = data["findings"]
    assert result.exit_code == 1 and finding["code"] == "CD602" and abs(finding["details"]["scale"] - 2) < 1e-3


def test_an_unreadable_image_skips_its_entry_only(tmp_path: Path) -> None:
    project = kohya.build(tmp_path / "kohya")
    entry, image = sorted(pairs(project).items())[1]
    image.write_bytes(image.read_bytes()[:40])  # a PNG cut short
    report = verify(project)
    [dataset] = report.datasets
    [skipped] = [c for c in dataset.checked if c.verdict == "skipped"]
    assert skipped.entry == str(entry) and image.name in skipped.note
    assert len(dataset.compared) == 8 and not report.findings


def test_a_cache_of_mirrored_images_is_cd603_for_each_entry_not_another_vae(tmp_path: Path) -> None:
    project = kohya.build(tmp_path / "kohya")
    for entry, image in pairs(project).items():
        rewrite(entry, lambda _, image=image: encoded(image, flip=True))
    report = verify(project)
    assert sorted(codes_of(report)) == ["CD603"] and len(report.findings) == 9


def test_a_swap_with_an_unsampled_neighbour_is_cd605(tmp_path: Path) -> None:
    """Only one of the pair is in the sample: the images next to its own are tried."""
    project = kohya.build(tmp_path / "kohya")
    found = sorted(pairs(project).items(), key=lambda p: p[1].name)
    (a, image_a), (b, image_b) = found[0], found[1]
    latent_a, latent_b = encoded(image_a), encoded(image_b)
    rewrite(a, lambda _: latent_b)
    rewrite(b, lambda _: latent_a)
    seed = next(s for s in range(100) if (picked := {c.entry for c in verify(
        project, sample=SampleSize.parse("3"), seed=s).datasets[0].checked}) and str(a) in picked
        and str(b) not in picked)
    report = verify(project, sample=SampleSize.parse("3"), seed=seed)
    assert codes_of(report) == {"CD605": [str(a)]}
    assert report.findings[0].details["matches"] == str(image_b)


def test_a_simpletuner_latent_of_another_crop_is_cd604(tmp_path: Path) -> None:
    """SimpleTuner's bucket metadata says: resize to 160x128, crop 128x128 at left 16; the cached
    latent is of the crop at the left edge."""
    from cachedoctor.fixtures.images import encode_png

    project = BUILDERS["simpletuner"](tmp_path / "simpletuner")
    entry, image = next((e, i) for e, i in sorted(pairs(project).items()) if i.name == "img_000.png")
    wide = pixels(160, 128, 5)
    image.write_bytes(encode_png(wide))
    bucket_file = image.parent / "aspect_ratio_bucket_metadata_photos.json"
    metadata = json.loads(bucket_file.read_text())
    metadata[str(image)].update(original_size=[160, 128], intermediary_size=[160, 128],
                                crop_coordinates=[0, 16], target_size=[128, 128])
    bucket_file.write_text(json.dumps(metadata))
    left = torch.from_numpy(wide[:, :128]).permute(2, 0, 1)
    rewrite(entry, lambda _: ReferenceEncoder().encode(left, 4))
    report = verify(project, sample=SampleSize.parse("all"))
    assert codes_of(report) == {"CD604": [str(entry)]}
    assert report.findings[0].details["crop"] == (0, 0)


def test_a_onetrainer_latent_of_another_crop_is_cd604(tmp_path: Path) -> None:
    """OneTrainer scales an image to cover the sample's crop_resolution in aggregate.pt and crops
    the centre: a 160x128 image of a 128x128 sample is cropped at x=16. The cached latent is of
    the crop at the left edge (crop jitter, or a crop_resolution changed since)."""
    from cachedoctor.fixtures.images import encode_png

    project = BUILDERS["onetrainer"](tmp_path / "onetrainer")
    entry, image = next((e, i) for e, i in sorted(pairs(project).items()) if i.name == "img_000.png")
    wide = pixels(160, 128, 5)
    image.write_bytes(encode_png(wide))
    left = torch.from_numpy(wide[:, :128]).permute(2, 0, 1)
    rewrite(entry, lambda _: ReferenceEncoder().encode(left, 4))
    report = verify(project, sample=SampleSize.parse("all"))
    assert codes_of(report) == {"CD604": [str(entry)]}
    [finding] = report.findings
    assert finding.details["crop"] == (0, 0) and finding.details["expected_crop"] == (16, 0)


def test_an_aitoolkit_latent_of_another_crop_is_cd604(tmp_path: Path) -> None:
    """ai-toolkit's entry header says: scale to 160x128, crop 128x128 at x=16 (its centre crop);
    the latent stored is of the crop at the left edge."""
    from safetensors.torch import save_file

    from cachedoctor.fixtures.images import encode_png
    from cachedoctor.layouts.aitoolkit import latent_hash

    project = BUILDERS["ai-toolkit"](tmp_path / "ai-toolkit")
    old, image = next((e, i) for e, i in sorted(pairs(project).items()) if i.name == "img_000.png")
    wide = pixels(160, 128, 5)
    image.write_bytes(encode_png(wide))
    with safetensors_open(old) as f:
        metadata = f.metadata()
    info = {"filename": image.name, "scale_to_width": 160, "scale_to_height": 128, "crop_x": 16,
            "crop_y": 0, "crop_width": 128, "crop_height": 128,
            "latent_space_version": metadata["latent_space_version"],
            "latent_version": int(metadata["latent_version"])}
    old.unlink()
    entry = old.parent / f"{image.stem}_{latent_hash(info)}.safetensors"
    left = torch.from_numpy(wide[:, :128]).permute(2, 0, 1)
    latent = ReferenceEncoder().encode(left, 4).to(torch.bfloat16).contiguous()
    save_file({"latent": latent}, str(entry),
              metadata={**metadata, **{k: str(v) for k, v in info.items()}})
    report = verify(project, sample=SampleSize.parse("all"))
    assert codes_of(report) == {"CD604": [str(entry)]}
    [finding] = report.findings
    assert finding.details["crop"] == (0, 0) and finding.details["expected_crop"] == (16, 0)


def safetensors_open(path: Path):
    import safetensors

    return safetensors.safe_open(str(path), "pt")
