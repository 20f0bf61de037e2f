"""`cachedoctor fix <config> --reencode --encoder reference` on the project of each trainer: the
quarantined and missing entries come back in the trainer's own naming, container, layout and
dtype, at the trainer's bucket size, load with the trainer's own call, and leave a rescan clean;
`undo` puts the tree back byte for byte."""

from __future__ import annotations

import gzip
import io
import re
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import safetensors
import safetensors.torch
import torch
from repair_helpers import isolated_state, tree_digest  # noqa: F401

from cachedoctor.fixtures.clean import aitoolkit_metadata
from cachedoctor.fixtures.projects import BUCKETS, Project, aitoolkit, encode, kohya, onetrainer, simpletuner
from cachedoctor.formats import read_path
from cachedoctor.layouts import resolve
from cachedoctor.layouts.entries import Changes, Geometry
from cachedoctor.repair.reencode import pixels

from conftest import codes, invoke, run_cli, scan_paths

RUN_ID = re.compile(r"Applying run (\S+) ")
QUARANTINED = {"CD101", "CD102", "CD301", "CD302", "CD406"}
REPAIRED = QUARANTINED | {"CD404"}


@dataclass
class Trainer:
    """How a project fixture of one trainer names, writes and loads its latents."""

    build: Callable[..., Project]
    defects: set[str]
    entry: Callable[[Project, Path, int, int], Path]  # the entry of an image of this size
    load: Callable[[Path], dict]  # the trainer's loading call -> {"latent": tensor, ...}
    dtype: torch.dtype
    buckets: tuple[tuple[int, int], ...] = BUCKETS
    broken: tuple[str, ...] = ("img_101", "img_102")  # made CD101 (cut short) and CD102 (empty)


def gunzip_load(path: Path) -> dict:
    """SimpleTuner's reader: gzip.decompress where gzipped, then torch.load."""
    data = path.read_bytes()
    source = io.BytesIO(gzip.decompress(data)) if data[:2] == b"\x1f\x8b" else path
    return {"latent": torch.load(source, weights_only=True, map_location="cpu")}


def onetrainer_load(path: Path) -> dict:
    sample = torch.load(path, weights_only=True, map_location="cpu")
    return {"latent": sample.pop("latent_image"), **sample}


def kohya_load(path: Path) -> dict:
    with np.load(path, allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    return {"latent": torch.from_numpy(arrays.pop("latents")), **arrays}


def aitoolkit_load(path: Path) -> dict:
    tensors = safetensors.torch.load_file(path)
    with safetensors.safe_open(path, "pt") as f:
        metadata = f.metadata()
    return {"latent": tensors.pop("latent"), "metadata": metadata, **tensors}


def onetrainer_entry(project: Project, image: Path, width: int, height: int) -> Path:
    [folder] = (project.root / "workspace-cache" / "run" / "image").glob("*/variation-0")
    index = sorted(p.name for p in image.parent.glob("img_*.png")).index(image.name)
    return folder / f"{index}.pt"


TRAINERS = {
    "simpletuner": Trainer(
        simpletuner.build, {"CD301", "CD302", "CD404", "CD406"},
        lambda p, image, w, h: p.root / "output/models/cache/vae/sdxl/photos" / simpletuner.vae_name(image),
        gunzip_load, torch.bfloat16, broken=("img_100", "img_102")),
    "onetrainer": Trainer(
        onetrainer.build, {"CD301", "CD302", "CD404", "CD406"}, onetrainer_entry, onetrainer_load,
        torch.float32),
    "kohya": Trainer(
        kohya.build, {"CD301", "CD302", "CD404", "CD406"},
        lambda p, image, w, h: image.parent / kohya.npz_name(image, w, h), kohya_load, torch.float32,
        kohya.BUCKETS),
    # The entry cut short keeps its header; the empty one's bucket comes from an entry of an
    # image of its size (img_100, quarantined for its age: its header is still ai-toolkit's).
    "ai-toolkit": Trainer(
        aitoolkit.build, {"CD301", "CD302", "CD404", "CD406"},
        lambda p, image, w, h: aitoolkit.latent_path(image.parent, image, (w, h)), aitoolkit_load,
        torch.bfloat16),
}


def images_of(project: Project, trainer: Trainer) -> dict[str, tuple[Path, int, int, int]]:
    """stem -> (path, width, height, seed), as fixtures.projects.images wrote them."""
    folder = {"simpletuner": "datasets/photos", "onetrainer": "datasets/person",
              "kohya": "train/10_person", "ai-toolkit": "datasets/person"}[project.trainer]
    out = {}
    for b, (width, height) in enumerate(trainer.buckets):
        for i in range(3):
            path = project.root / folder / f"img_{b}{i:02d}.png"
            out[path.stem] = (path, width, height, b * 100 + i)
    return out


def break_entries(project: Project, trainer: Trainer, images: dict) -> list[Path]:
    """CD101 (cut short after its header) and CD102 (empty) on two healthy entries."""
    cut, empty = (trainer.entry(project, *_size(images[stem])) for stem in trainer.broken)
    data = cut.read_bytes()
    cut.write_bytes(data[:len(data) - 200])
    empty.write_bytes(b"")
    return [cut, empty]


def _size(image: tuple[Path, int, int, int]) -> tuple[Path, int, int]:
    return image[0], image[1], image[2]


def container(path: Path) -> str:
    head = path.read_bytes()[:2]
    return {b"\x1f\x8b": "gzip", b"PK": "zip"}.get(head, "other")


@pytest.mark.parametrize("name", list(TRAINERS))
def test_reencode_regenerates_what_the_trainer_would_have_written(name: str, tmp_path: Path) -> None:
    trainer = TRAINERS[name]
    project = trainer.build(tmp_path / name, trainer.defects)
    images = images_of(project, trainer)
    broken = break_entries(project, trainer, images)
    entries = {stem: trainer.entry(project, *_size(image)) for stem, image in images.items()}
    healthy = {stem: trainer.load(path) for stem, path in entries.items()
               if path.exists() and path not in broken and str(path) not in _flagged(project)}
    # the container most readable entries have (those quarantined for size or age count too)
    containers = Counter(container(p) for p in entries.values() if p.exists() and p not in broken)
    before = tree_digest(project.root)
    found = codes(scan_paths(project.config))
    assert found == REPAIRED, found

    result = invoke("fix", str(project.config), "--reencode", "--encoder", "reference", "--yes")

    assert result.exit_code == 0, result.output
    left = codes(scan_paths(project.config))
    if name == "onetrainer":  # a new sample needs a text-cache entry too: a plan note
        assert left == {"CD404"} and "a new sample needs a text-encoder entry too" in result.output
    else:
        assert not left, left
    regenerated = [stem for stem in images if stem not in healthy and entries[stem].exists()]
    # every entry but the healthy ones (and OneTrainer's missing sample)
    assert len(regenerated) == (6 if name == "onetrainer" else 8), regenerated
    for stem in regenerated:
        image, width, height, seed = images[stem]
        path = entries[stem]
        value = trainer.load(path)
        latent = value.pop("latent")
        expected = encode(image, width, height, seed, dtype=str(trainer.dtype).removeprefix("torch."))
        assert latent.dtype == trainer.dtype and latent.shape == (4, height // 8, width // 8), path
        assert torch.equal(latent, expected), f"{path}: not what the trainer would have written"
        reference = next(iter(healthy.values()))
        assert sorted(value) == sorted(k for k in reference if k != "latent"), path
        if name == "simpletuner":
            assert container(path) == containers.most_common(1)[0][0]
        if name == "onetrainer":
            assert value == {"original_resolution": (height, width), "crop_offset": (0, 0)}
        if name == "kohya":
            assert value["original_size"].tolist() == [width, height]
            assert value["crop_ltrb"].tolist() == [0, 0, width, height]
            assert value["crop_ltrb"].dtype == reference["crop_ltrb"].dtype
        if name == "ai-toolkit":
            assert value["metadata"] == aitoolkit_metadata(image.name, tuple(latent.shape))[1]

    undone = invoke("undo")
    assert undone.exit_code == 0, undone.output
    assert tree_digest(project.root) == before


def _flagged(project: Project) -> set[str]:
    return {path for found in project.expected.values() for path, _ in found}


def test_onetrainer_samples_keep_the_device_they_were_saved_from(tmp_path: Path) -> None:
    project = onetrainer.build(tmp_path, {"CD302"})
    [stale, *_] = [Path(p) for p, _ in project.expected["CD302"]]

    result = invoke("fix", str(project.config), "--reencode", "--encoder", "reference", "--yes")

    assert result.exit_code == 0, result.output
    from cachedoctor.formats import read_path

    assert read_path(str(stale)).locations == ("cuda:0",)  # as mgds saves from train_device
    assert not codes(scan_paths(project.config))


def test_the_real_command_on_a_kohya_project(tmp_path: Path) -> None:
    project = kohya.build(tmp_path, {"CD302", "CD404"})
    before = tree_digest(project.root)

    result = run_cli("fix", str(project.config), "--reencode", "--encoder", "reference", "--yes")

    assert result.returncode == 0, result.stderr
    assert "reencode 4/4" in result.stdout
    assert not codes(scan_paths(project.config))
    run_id = RUN_ID.search(result.stdout)[1]
    assert run_cli("undo", run_id).returncode == 0
    assert tree_digest(project.root) == before


def test_reencode_without_an_encoder_is_a_usage_error(tmp_path: Path) -> None:
    project = simpletuner.build(tmp_path, {"CD404"})
    before = tree_digest(project.root)

    result = invoke("fix", str(project.config), "--reencode", "--yes")

    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        "cachedoctor: error: --reencode needs --encoder: diffusers:PATH (a local diffusers VAE), "
        "module:callable (your encoder), or reference (the test harness's stand-in: never on a real cache)"]
    assert tree_digest(project.root) == before


def test_a_jpeg_without_pillow_is_a_plan_note(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "PIL", None)  # import PIL raises ImportError
    project = kohya.build(tmp_path, {"CD404"})
    jpeg = project.root / "train" / kohya.DATASET / "img_300.jpg"
    jpeg.write_bytes(b"\xff\xd8\xff\xe0\x00\x10JFIF\x00" + bytes(64))

    result = invoke("fix", str(project.config), "--reencode", "--encoder", "reference", "--yes")

    assert result.exit_code == 0, result.output
    assert "no re-encode: img_300.jpg is a JPEG image: reading it needs Pillow (pip install " \
           "pillow)" in result.output
    assert "reencode 1/1" in result.output  # the PNG whose entry was missing
    assert {f.path for f in scan_paths(project.config).findings} == {str(jpeg)}


def test_the_pixels_are_resized_and_cropped_to_the_bucket(tmp_path: Path) -> None:
    from cachedoctor.fixtures.images import write_png

    image = write_png(tmp_path / "wide.png", 200, 100, seed=3)
    out = pixels(str(image), Geometry((200, 100), (256, 128), (64, 0, 128, 128), "bicubic"))
    assert out.shape == (3, 128, 128) and out.dtype == torch.uint8
    same = pixels(str(image), Geometry((200, 100), (200, 100), (4, 2, 192, 96), "area"))
    assert torch.equal(same, pixels(str(image), None)[:, 2:98, 4:196])


def test_kohya_buckets_resize_to_cover_then_crop_in_the_centre(tmp_path: Path) -> None:
    from cachedoctor.fixtures.images import write_png
    from cachedoctor.layouts import kohya as kohya_layout

    project = kohya.build(tmp_path)
    folder = project.root / "train" / kohya.DATASET
    odd = write_png(folder / "odd.png", 300, 200, seed=4)  # no bucket of its size: 320x192 covers it
    [dataset] = resolve([str(project.config)])[0].datasets

    spec = dataset.naming.entries(dataset, Changes()).spec(str(odd))

    assert spec.path == str(folder / "odd_0300x0200_sdxl.npz")
    assert isinstance(dataset.naming, kohya_layout.KohyaNaming)
    assert spec.geometry == Geometry((300, 200), (320, 213), (0, 10, 320, 192), "area")
    assert spec.latent_size == (24, 40)
    # get_crop_ltrb places the image as if fitted into the bucket (Stability AI's convention)
    assert spec.format.extras["crop_ltrb"].tolist() == [16, 0, 304, 192]
    assert spec.format.extras["crop_ltrb"].dtype == np.int64  # as its neighbours store it


def test_text_encoder_outputs_are_quarantined_not_re_encoded(tmp_path: Path) -> None:
    project = kohya.build(tmp_path)
    te = project.root / "train" / kohya.DATASET / "img_000_te_outputs.npz"
    te.write_bytes(b"")  # CD102

    result = invoke("fix", str(project.config), "--reencode", "--encoder", "reference", "--yes")

    assert result.exit_code == 0, result.output
    assert "no re-encode: not a latent (text-encoder outputs need the text encoder" in result.output
    assert not te.exists() and "reencode" not in result.output.split("Run ")[-1]


def test_a_new_entry_is_never_given_a_folder_of_its_own(tmp_path: Path) -> None:
    from cachedoctor.fixtures.images import write_png
    from cachedoctor.repair import build_plan
    from cachedoctor.repair.encoders import ReferenceEncoder
    from cachedoctor.repair.plan import Reencode
    from cachedoctor.repair.reencode import EntryFormat, ReencodeTarget

    cache = tmp_path / "cache"
    cache.mkdir()
    image = write_png(tmp_path / "a.png", 64, 64)
    target = ReencodeTarget(str(image), str(cache / "sub" / "a.pt"), EntryFormat("zip", None, "float16", 4))

    plan = build_plan(scan_paths(cache), [str(cache)], Reencode(ReferenceEncoder(), targets=(target,)))

    assert not plan.actions
    [note] = plan.notes
    assert note.skipped and "its folder does not exist yet" in note.message


def test_the_format_is_the_cache_s_even_when_most_entries_are_taken_away(tmp_path: Path) -> None:
    """The demo project: of 12 entries, 11 are quarantined (sizes, ages, orphans, another VAE
    family) and a fp32 zip file of another run (CD304) is one of the two left. The new entries
    take the format of the cache, bf16 gzip, not the minority's."""
    project = simpletuner.build(tmp_path, [d for d in simpletuner.DEFECTS if d != "CD502"])

    result = invoke("fix", str(project.config), "--reencode", "--encoder", "reference", "--yes")

    assert result.exit_code == 0, result.output
    assert "(gzip, bfloat16 [4, 16, 16])" in result.output and "float32 [" not in result.output
    [mixed] = [f for f in scan_paths(project.config).findings if f.code == "CD304"]
    assert "float32 (1 file)" in mixed.message, mixed.message  # the one it was before, no more


def test_a_onetrainer_sample_goes_on_the_device_most_of_its_neighbours_were_saved_from(
        tmp_path: Path) -> None:
    """One sample cached from the CPU among cuda:0 ones is no defect (mgds loads with
    map_location=train_device), so nothing moves to the CPU and the new samples are saved as
    most were."""
    project = onetrainer.build(tmp_path, {"CD302"}, cpu_sample=True)

    result = invoke("fix", str(project.config), "--reencode", "--encoder", "reference", "--yes")

    assert result.exit_code == 0, result.output
    assert "to-cpu" not in result.output and "reencode 3/3" in result.output
    assert not codes(scan_paths(project.config))
    variation = next((project.root / "workspace-cache" / "run" / "image").glob("*/variation-0"))
    written = [read_path(str(p)) for p in sorted(variation.glob("[0-9]*.pt"))]
    assert sum(m.locations == ("cuda:0",) for m in written) == len(written) - 1




def test_a_neighbour_whose_metadata_nests_past_json_is_no_template(tmp_path: Path) -> None:
    """An ai-toolkit entry's header metadata is the cache's text: a value of 100,000 nested
    brackets in a healthy neighbour is no template (the JSON decoder's RecursionError stopped
    the plan), and the broken entry is still encoded again from another neighbour."""
    project = aitoolkit.build(tmp_path / "a")
    poisoned, broken, *_ = sorted((project.root / "datasets" / "person").glob(
        "_latent_cache/*.safetensors"))
    tensors = safetensors.torch.load_file(poisoned)
    with safetensors.safe_open(poisoned, "pt") as f:
        metadata = f.metadata()
    safetensors.torch.save_file(tensors, poisoned,
                                metadata={**metadata, "extra": "[" * 100_000 + "]" * 100_000})
    broken.write_bytes(b"")

    result = invoke("fix", str(project.config), "--reencode", "--encoder", "reference",
                    "--dry-run", "-j", "1")

    assert result.exit_code == 0, result.stderr
    assert "reencode    1 file" in result.stdout and broken.name in result.stdout
