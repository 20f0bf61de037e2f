"""OneTrainer after `fix`: the cache as mgds (Nerogar/mgds 3a6994ad, DiskCache.py) would load it.

mgds is not on PyPI, so `mgds_start` re-implements the two decisions that matter, line for line
in effect: `__is_caching_done` (the variation folder holds something and its aggregate.pt is a
file) and, for a folder taken as cached, `get_item`'s lookup of `<i>.pt` for each sample the
aggregate lists (torch.load with map_location=<train device>). A folder not taken as cached is
one mgds caches again from the images.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from cachedoctor.fixtures.projects import onetrainer

from conftest import by_code, codes, invoke, scan_paths


def mgds_start(cache: Path) -> list[Path]:
    """The variation folders mgds would cache again; raises FileNotFoundError where training
    would (a listed sample whose file is gone)."""
    recached = []
    for folder in sorted(cache.glob("*/*/variation-*")):
        aggregate = folder / "aggregate.pt"
        done = any(os.scandir(folder)) and aggregate.is_file()
        if not done:
            recached.append(folder)
            continue
        listed = torch.load(aggregate, weights_only=True, map_location="cpu")
        for index in range(len(listed)):
            torch.load(folder / f"{index}.pt", weights_only=True, map_location="cpu")
    return recached


def cut(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])  # a writer killed mid-archive: CD101


def test_a_removed_text_sample_makes_mgds_cache_its_folder_again(tmp_path: Path) -> None:
    """A broken text-encoder sample is quarantined; no encoder here can write it again, so its
    aggregate.pt goes too, and mgds caches that folder again instead of raising
    FileNotFoundError in training. Undo puts both back."""
    project = onetrainer.build(tmp_path / "ot")
    cache = project.root / "workspace-cache" / "run"
    [text] = (cache / "text").glob("*/variation-0")
    [image] = (cache / "image").glob("*/variation-0")
    cut(text / "1.pt")
    assert "CD101" in codes(scan_paths(project.config))

    result = invoke("fix", str(project.config), "--yes")

    assert result.exit_code == 0, result.output
    assert "mgds caches this variation folder again" in result.output
    assert not (text / "1.pt").exists() and not (text / "aggregate.pt").exists()
    assert (image / "aggregate.pt").exists()  # untouched: nothing of it was removed
    assert mgds_start(cache) == [text]
    assert not {f.code for f in scan_paths(project.config).findings if f.severity >= 2}

    assert invoke("undo").exit_code == 0
    assert (text / "aggregate.pt").exists() and (text / "1.pt").exists()


def test_the_aggregate_stays_where_the_fix_encodes_the_sample_again(tmp_path: Path) -> None:
    """--reencode writes the stale image sample again, as mgds would: its folder needs no
    rebuild. Without --reencode the folder is cached again by OneTrainer."""
    project = onetrainer.build(tmp_path / "ot", defects=["CD406"])
    cache = project.root / "workspace-cache" / "run"
    [image] = (cache / "image").glob("*/variation-0")

    result = invoke("fix", str(project.config), "--reencode", "--encoder", "reference", "--yes")

    assert result.exit_code == 0, result.output
    assert (image / "3.pt").exists() and (image / "aggregate.pt").exists()
    assert mgds_start(cache) == []

    again = onetrainer.build(tmp_path / "again", defects=["CD406"])
    cache = again.root / "workspace-cache" / "run"
    [image] = (cache / "image").glob("*/variation-0")
    result = invoke("fix", str(again.config), "--yes")
    assert result.exit_code == 0, result.output
    assert not (image / "aggregate.pt").exists()
    assert mgds_start(cache) == [image]


def test_an_unlisted_sample_goes_alone(tmp_path: Path) -> None:
    """A sample beyond what aggregate.pt lists (CD405) is never opened by mgds: quarantining
    it needs no rebuild."""
    project = onetrainer.build(tmp_path / "ot", defects=["CD405"])
    cache = project.root / "workspace-cache" / "run"

    result = invoke("fix", str(project.config), "--yes")

    assert result.exit_code == 0, result.output
    assert "mgds caches" not in result.output
    assert mgds_start(cache) == []


def test_a_listed_sample_whose_file_is_gone_is_cd404_and_is_encoded_again(tmp_path: Path) -> None:
    """aggregate.pt still lists the sample; its file is what is missing (mgds' get_item would
    raise FileNotFoundError). The message says so, and --reencode writes it under its number."""
    project = onetrainer.build(tmp_path / "ot")
    cache = project.root / "workspace-cache" / "run"
    [image] = (cache / "image").glob("*/variation-0")
    (image / "2.pt").unlink()
    (missing,) = [f for f in scan_paths(project.config).findings if f.code == "CD404"]
    listed = torch.load(image / "aggregate.pt", weights_only=True)[2]["image_path"]
    assert missing.path == str(project.root / listed)
    assert "lists it as sample 2, but 2.pt is missing" in missing.message, missing.message
    assert missing.details["expected_entry"] == str(image / "2.pt")

    result = invoke("fix", str(project.config), "--reencode", "--encoder", "reference", "--yes")

    assert result.exit_code == 0, result.output
    assert (image / "2.pt").exists() and mgds_start(cache) == []
    assert not codes(scan_paths(project.config))


def test_an_image_no_aggregate_lists_is_cd404_saying_so(tmp_path: Path) -> None:
    project = onetrainer.build(tmp_path / "ot", defects=["CD404"])
    (missing,) = [f for f in scan_paths(project.config).findings if f.code == "CD404"]
    assert "no aggregate.pt under" in missing.message and "lists it (added after" in missing.message


def test_an_sd15_style_sample_is_written_with_the_latent_alone(tmp_path: Path) -> None:
    """OneTrainer's SD 1.x/2.x, PixArt and Sana loaders cache {'latent_image'} only
    (image_split_names in modules/dataLoader/*BaseDataLoader.py): the new sample holds the
    keys its neighbours hold, nothing more."""
    project = onetrainer.build(tmp_path / "ot")
    [image] = (project.root / "workspace-cache" / "run" / "image").glob("*/variation-0")
    for sample in image.glob("[0-9]*.pt"):
        value = torch.load(sample, weights_only=True, map_location="cpu")
        torch.save({"latent_image": value["latent_image"]}, sample)
    (image / "2.pt").unlink()

    result = invoke("fix", str(project.config), "--reencode", "--encoder", "reference", "--yes")

    assert result.exit_code == 0, result.output
    written = torch.load(image / "2.pt", weights_only=True, map_location="cpu")
    assert sorted(written) == ["latent_image"]
    assert mgds_start(project.root / "workspace-cache" / "run") == []


def test_a_new_image_s_plan_note_names_the_aggregates_to_move_away(tmp_path: Path) -> None:
    """An image no aggregate.pt lists needs a new sample in the image and the text cache: the
    plan says which two aggregate.pt files to move away (mgds' group folders of its concept),
    and doing so makes mgds cache both folders again."""
    project = onetrainer.build(tmp_path / "ot", defects=["CD404"])
    cache = project.root / "workspace-cache" / "run"
    aggregates = sorted(cache.glob("*/*/variation-0/aggregate.pt"))

    result = invoke("fix", str(project.config), "--reencode", "--encoder", "reference", "--yes")

    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    for aggregate in aggregates:
        assert aggregate.name in text and aggregate.parent.parent.name[:12] in text, text
    for aggregate in aggregates:
        aggregate.rename(tmp_path / f"{aggregate.parent.parent.parent.name}.pt")
    assert mgds_start(cache) == [a.parent for a in aggregates]


def test_a_missing_text_sample_is_cd404_on_its_image(tmp_path: Path) -> None:
    """Text sample 1 deleted while text/.../aggregate.pt lists it: mgds' get_item would raise
    FileNotFoundError. The scan says so on image sample 1's image (both caches number a
    concept's samples alike); its latent is no orphan; the plan names the aggregate to move."""
    project = onetrainer.build(tmp_path / "ot")
    cache = project.root / "workspace-cache" / "run"
    [text] = (cache / "text").glob("*/variation-0")
    [image] = (cache / "image").glob("*/variation-0")
    (text / "1.pt").unlink()
    report = scan_paths(project.config)
    (missing,) = by_code(report, "CD404")
    listed = torch.load(image / "aggregate.pt", weights_only=True)[1]["image_path"]
    assert missing.path == str(project.root / listed)
    assert "text-encoder sample 1.pt is missing" in missing.message, missing.message
    assert "CD405" not in codes(report)

    result = invoke("fix", str(project.config), "--reencode", "--encoder", "reference", "--yes")

    assert result.exit_code == 0, result.output
    assert "aggregate.pt out of the cache" in " ".join(result.output.split())
    (text / "aggregate.pt").rename(tmp_path / "aggregate.pt")
    assert mgds_start(cache) == [text]


def _add_concept(project, name: str, **values: object) -> Path:
    """A concept whose images exist but which mgds has not cached yet (no group folder)."""
    from cachedoctor.fixtures.projects import images

    concepts_file = project.root / "training_concepts/concepts.json"
    concepts = json.loads(concepts_file.read_text())
    added = {**onetrainer.concept(f"datasets/{name}", name=name, seed=77), **values}
    concepts_file.write_text(json.dumps([*concepts, added], indent=4))
    images(project.root / "datasets" / name, n_per_bucket=1, seed=9, prefix=name)
    return project.root / "datasets" / name


def _set_config(project, **changes: object) -> None:
    config = json.loads(project.config.read_text())
    project.config.write_text(json.dumps({**config, **changes}, indent=4))


def test_a_concept_mgds_has_yet_to_cache_is_no_missing_entry(tmp_path: Path) -> None:
    """A concept added after the others were cached has no group folder: mgds
    (DiskCache.__is_caching_done) caches its group when its data loader starts, as it does a
    new cache. Before, each of its images was CD404 ('added after its concept was cached')."""
    project = onetrainer.build(tmp_path / "ot")
    _add_concept(project, "style")
    assert mgds_start(project.root / "workspace-cache/run") == []  # nothing half-cached
    assert not codes(scan_paths(project.config))


@pytest.mark.parametrize("validation", [False, True])
def test_a_validation_concept_is_cached_only_with_validation_on(tmp_path: Path,
                                                               validation: bool) -> None:
    """OneTrainer 23df3832 DataLoaderMgdsMixin._create_mgds gives the training loader the
    concepts of every type but VALIDATION and the validation loader those; GenericTrainer
    makes that loader only with `validation` on. Off, its images are never cached nor read;
    on, mgds caches them in the same cache_dir, and an image added to its cached group is
    CD404 as in any concept."""
    project = onetrainer.build(tmp_path / "ot", defects=["CD404"])
    concepts_file = project.root / "training_concepts/concepts.json"
    concepts = json.loads(concepts_file.read_text())
    concepts[0]["type"] = "VALIDATION"
    concepts_file.write_text(json.dumps(concepts, indent=4))
    _set_config(project, validation=validation)
    found = by_code(scan_paths(project.config), "CD404")
    assert [f.path for f in found] == ([project.expected["CD404"][0][0]] if validation else [])


def mgds_epoch(folder: Path, images: list[str]) -> list[str]:
    """The image_path of the sample mgds loads for each of the concept's images as it lists
    them now: DiskCache.__get_input_index gives group index i, get_item opens sample i of the
    cached folder's aggregate.pt, whatever image it was cached from."""
    listed = torch.load(folder / "aggregate.pt", weights_only=True, map_location="cpu")
    return [listed[i]["image_path"] for i in range(len(images))]


def test_an_image_deleted_from_a_cached_concept_is_cd406_on_its_folder(tmp_path: Path) -> None:
    """mgds 3a6994ad DiskCache: a variation folder with an aggregate.pt is cached; with an image
    gone, sample i is still loaded for the concept's i-th image, so the deleted picture keeps
    training and the folder's last sample is never loaded. Before, its sample was CD405 info
    ("never trained on"). The fix moves the concept's image and text aggregate.pt away (both:
    text sample i is paired with latent sample i), and mgds caches both folders again."""
    project = onetrainer.build(tmp_path / "ot")
    cache = project.root / "workspace-cache" / "run"
    [image] = (cache / "image").glob("*/variation-0")
    [text] = (cache / "text").glob("*/variation-0")
    person = project.root / "datasets" / "person"
    pictures = sorted(p for p in person.iterdir() if p.suffix == ".png")
    pictures[1].unlink()
    loaded = mgds_epoch(image, pictures[:1] + pictures[2:])
    assert loaded[1].endswith(pictures[1].name)  # the deleted picture still trains
    assert not any(p.endswith(pictures[-1].name) for p in loaded)  # the last never does

    report = scan_paths(project.config)
    (found,) = by_code(report, "CD406")
    assert found.path == str(image) and pictures[1].name in found.message
    assert not by_code(report, "CD405")

    result = invoke("fix", str(project.config), "--yes")
    assert result.exit_code == 0, result.output
    assert mgds_start(cache) == [image, text]
    assert not {f.code for f in scan_paths(project.config).findings if f.severity >= 2}


def test_an_image_added_to_a_cached_concept_says_mgds_stops_with_index_error(
        tmp_path: Path) -> None:
    """With one image more than aggregate.pt lists, mgds' group index for the concept's last
    image runs past the aggregate (DiskCache.get_item: IndexError, run from mgds 3a6994ad)."""
    project = onetrainer.build(tmp_path / "ot", defects=["CD404"])
    [image] = (project.root / "workspace-cache/run/image").glob("*/variation-0")
    person = project.root / "datasets" / "person"
    pictures = sorted(p for p in person.iterdir() if p.suffix == ".png")
    with pytest.raises(IndexError):
        mgds_epoch(image, pictures)
    (missing,) = by_code(scan_paths(project.config), "CD404")
    assert "IndexError" in missing.message


def _without_masks(project) -> list[Path]:
    """The project's samples as cached before masked_training was on: no latent_mask."""
    samples = sorted((project.root / "workspace-cache/run/image").glob("*/variation-0/[0-9]*.pt"))
    for path in samples:
        sample = torch.load(path, map_location="cpu", weights_only=True)
        sample.pop("latent_mask", None)
        torch.save(sample, path)
    return samples


def _with_masks(project) -> None:
    """As mgds caches them with masked_training: `latent_mask` [1, h, w] beside the latent
    (OneTrainer 23df3832 *BaseDataLoader.py: ScaleImage(in_name='mask', factor=0.125))."""
    for path in (project.root / "workspace-cache/run/image").glob("*/variation-0/[0-9]*.pt"):
        sample = torch.load(path, map_location="cpu", weights_only=True)
        sample["latent_mask"] = torch.ones(1, *sample["latent_image"].shape[-2:])
        torch.save(sample, path)


def test_a_sample_without_the_latent_mask_masked_training_reads_is_cd110(tmp_path: Path) -> None:
    """masked_training turned on over a cache made without it: mgds DiskCache.get_item copies
    `split_item['latent_mask']` and raises KeyError (run from mgds 3a6994ad). The fix moves the
    samples and their aggregate.pt away, and mgds caches the folder again."""
    project = onetrainer.build(tmp_path / "ot")
    samples = _without_masks(project)
    _set_config(project, masked_training=True)
    found = by_code(scan_paths(project.config), "CD110")
    assert sorted(f.path for f in found) == [str(p) for p in samples]
    assert "latent_mask" in found[0].message

    result = invoke("fix", str(project.config), "--yes")
    assert result.exit_code == 0, result.output
    assert mgds_start(project.root / "workspace-cache/run") == [samples[0].parent]
    assert not by_code(scan_paths(project.config), "CD110")


def test_samples_with_their_masks_or_a_cache_rebuilt_at_start_are_no_cd110(tmp_path: Path) -> None:
    project = onetrainer.build(tmp_path / "ot")
    _set_config(project, masked_training=True)
    _with_masks(project)
    assert not by_code(scan_paths(project.config), "CD110")
    _without_masks(project)
    _set_config(project, clear_cache_before_training=True)  # OneTrainer caches it all again
    assert not by_code(scan_paths(project.config), "CD110")
    _set_config(project, clear_cache_before_training=False, masked_training=False)
    assert not by_code(scan_paths(project.config), "CD110")
