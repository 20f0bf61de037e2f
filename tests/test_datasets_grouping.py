"""Issue #12: a bare tree is grouped into datasets as the trainers group it, majority rules need
a clear majority, scan and fix share one decision, and baselines hold under healthy growth.

The trees come from cachedoctor.fixtures.corpus (real torch.save, gzip, np.savez, safetensors,
the trainers' own names): each scans clean as a bare dir, and a defect planted into one dataset
is reported in that dataset only."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest

from cachedoctor.findings import Severity
from cachedoctor.fixtures import corpus
from cachedoctor.fixtures.latents import save_latent
from cachedoctor.fixtures.projects import encode, images
from cachedoctor.layouts import resolve
from cachedoctor.majority import decide
from cachedoctor.repair import build_plan
from cachedoctor.repair.caches import cache_roots

from conftest import scan_paths

DATASET_RULES = ("CD301", "CD303", "CD304", "CD305")


def serious(report) -> list:
    return [f for f in report.findings if f.severity >= Severity.WARNING]


def _inside(path: str, folder: Path) -> bool:
    return path == str(folder) or path.startswith(str(folder) + "/")


def _there(finding, folder: Path) -> bool:
    """In the dataset at `folder`: on a file or folder in it, or (a finding over a trainer
    config's dataset that holds it, such as CD304 at OneTrainer's cache dir) on a folder above
    it naming only files in it."""
    if _inside(finding.path, folder):
        return True
    files = finding.details.get("files")
    return bool(files) and _inside(str(folder), Path(finding.path)) and all(
        _inside(p, folder) for p in files)


# one plant per tree and code: (tree, dataset, code)
PLANTS = [
    ("simpletuner", "vae/flux/photos", "CD303"),
    ("simpletuner", "vae/sdxl/closeups", "CD304"),
    ("simpletuner", "text/flux", "CD305"),
    ("onetrainer", "image/person", "CD301"),
    ("onetrainer", "image/style", "CD303"),
    ("onetrainer", "image/person", "CD304"),
    ("onetrainer", "text/style", "CD305"),
    ("kohya", "train", "CD303"),
    ("kohya", "train", "CD304"),
    ("kohya", "train", "CD305"),
    ("ai-toolkit", "person", "CD301"),
    ("ai-toolkit", "style", "CD303"),
    ("ai-toolkit", "person", "CD304"),
    ("bucketed", "latents", "CD301"),
    ("bucketed", "latents", "CD303"),
    ("bucketed", "latents", "CD304"),
    ("bucketed", "text", "CD305"),
]


@pytest.mark.parametrize("name", corpus.BUILDERS)
def test_multi_dataset_tree_scans_clean_as_a_bare_dir(name: str, tmp_path: Path) -> None:
    tree = corpus.build(name, tmp_path / name)
    report = scan_paths(tree.root)
    assert serious(report) == [], report.findings
    assert report.files >= 18
    # kohya trains a train_data_dir's subsets as one dataset; its two families stay apart
    assert len(tree.datasets) >= 2 or name == "kohya"


@pytest.mark.parametrize("name", corpus.BUILDERS)
def test_multi_dataset_tree_scans_clean_through_its_configs(name: str, tmp_path: Path) -> None:
    tree = corpus.build(name, tmp_path / name)
    if not tree.configs:
        pytest.skip("a bare cache: no trainer config")
    for targets in [*([c] for c in tree.configs), tree.configs]:
        report = scan_paths(*targets)
        assert serious(report) == [], (targets, report.findings)
        assert report.trainers == (tree.trainer,)


@pytest.mark.parametrize("through", ["bare", "configs"])
@pytest.mark.parametrize(("name", "dataset", "code"), PLANTS,
                         ids=[f"{n}-{d}-{c}" for n, d, c in PLANTS])
def test_a_defect_planted_in_one_dataset_is_reported_there_only(name: str, dataset: str,
                                                                 code: str, through: str,
                                                                 tmp_path: Path) -> None:
    tree = corpus.build(name, tmp_path / name, plant=(dataset, code))
    assert code in tree.plantable[dataset]
    if through == "configs" and not tree.configs:
        pytest.skip("a bare cache: no trainer config")
    report = scan_paths(*(tree.configs if through == "configs" else [tree.root]))
    planted_code, planted = tree.planted
    fired = {(f.code, f.path) for f in report.findings}
    if code == "CD304":  # one finding for the dataset, listing the odd file
        (finding,) = [f for f in report.findings if f.code == "CD304"]
        assert finding.details["files"] == [str(planted)]
        assert finding.severity == Severity.WARNING
    else:
        assert (planted_code, str(planted)) in fired
    folder = tree.datasets[dataset]
    outside = [f for f in serious(report) if not _there(f, folder)]
    assert outside == [], outside
    assert all(f.code in DATASET_RULES or f.code == "CD302" for f in serious(report)), report.findings


def test_issue_12_two_model_families_under_one_cache_root(tmp_path: Path) -> None:
    """The report of issue #12: 5 sdxl and 5 flux latents under cache/vae/<family>/photos."""
    written = images(tmp_path / "datasets" / "photos", n_per_bucket=5, buckets=((128, 128),))
    cache = tmp_path / "cache"
    for family, channels in (("sdxl", 4), ("flux", 16)):
        folder = cache / "vae" / family / "photos"
        folder.mkdir(parents=True)
        for path, width, height, seed in written:
            save_latent(folder / f"{path.stem}.pt", encode(path, width, height, seed, channels))
    assert serious(scan_paths(cache)) == []


def _tie(folder: Path, n: int = 5, m: int = 5) -> tuple[list[Path], list[Path]]:
    """n 4-channel and m 16-channel latents in one folder: one dataset with no majority."""
    written = images(folder.parent / "images", n_per_bucket=n + m, buckets=((128, 128),))
    folder.mkdir(parents=True)
    four, sixteen = [], []
    for i, (path, width, height, seed) in enumerate(written):
        channels = 4 if i < n else 16
        target = folder / f"{path.stem}.pt"
        save_latent(target, encode(path, width, height, seed, channels))
        (four if channels == 4 else sixteen).append(target)
    shutil.rmtree(folder.parent / "images")
    return four, sixteen


def test_a_tie_is_a_warning_naming_both_sides_and_fix_changes_nothing(tmp_path: Path) -> None:
    four, sixteen = _tie(tmp_path / "cache" / "photos")
    for jobs in (1, 2):
        report = scan_paths(tmp_path / "cache", jobs=jobs)
        (finding,) = [f for f in report.findings if f.code == "CD303"]
        assert finding.severity == Severity.WARNING
        assert finding.fix is None
        assert finding.path == str(tmp_path / "cache" / "photos")
        assert finding.details["counts"] == {"4 channels": 5, "16 channels": 5}
        assert set(finding.details["values"]) == {"4 channels", "16 channels"}
        assert set(finding.details["examples"]["4 channels"]) <= {str(p) for p in four}
        assert set(finding.details["examples"]["16 channels"]) <= {str(p) for p in sixteen}
        assert "4 channels: 5 files" in finding.message and "16 channels: 5 files" in finding.message
        plan = build_plan(report, cache_roots(resolve([str(tmp_path / "cache")])))
        assert plan.actions == ()


def test_a_clear_majority_needs_two_thirds(tmp_path: Path) -> None:
    _tie(tmp_path / "a" / "photos", n=7, m=3)  # 70%: the three are foreign
    report = scan_paths(tmp_path / "a")
    errors = [f for f in report.findings if f.code == "CD303"]
    assert len(errors) == 3 and all(f.severity == Severity.ERROR for f in errors)
    assert all(f.details["channels"] == 16 for f in errors)
    _tie(tmp_path / "b" / "photos", n=6, m=4)  # 60%: a split
    (split,) = [f for f in scan_paths(tmp_path / "b").findings if f.code == "CD303"]
    assert split.severity == Severity.WARNING


@pytest.mark.parametrize(("counts", "major"), [
    ({4: 2, 16: 1}, 4), ({4: 5, 16: 5}, None), ({4: 6, 16: 4}, None), ({4: 7, 16: 3}, 4),
    ({4: 2, 16: 2, 8: 1}, None), ({4: 4, 16: 1, 8: 1}, 4), ({4: 1, 16: 1}, None),
])
def test_decide_holds_two_thirds_and_breaks_no_tie(counts: dict, major) -> None:
    verdict = decide(Counter(counts))
    assert verdict.major == major
    # the order the groups were counted in changes nothing
    assert decide(Counter(dict(reversed(list(counts.items()))))).major == major


def test_agreeing_files_give_no_verdict() -> None:
    assert decide(Counter({4: 10})) is None


def _fixable(report) -> set[tuple[str, str]]:
    """(file, code) of every file a finding with a fix names: its path, or for a finding on a
    folder (CD502 over a cache) the files its details list."""
    out = set()
    for f in report.findings:
        if f.fix in ("quarantine", "compact", "to-cpu"):
            files = f.details.get("files") if Path(f.path).is_dir() else None
            out |= {(str(p), f.code) for p in files or [f.path]}
    return out


def _planned(plan) -> set[tuple[str, str]]:
    return {(a.path, code) for a in plan.actions for code in a.codes}


@pytest.mark.parametrize(("name", "dataset", "code"), PLANTS,
                         ids=[f"{n}-{d}-{c}" for n, d, c in PLANTS])
def test_scan_and_fix_decide_alike(name: str, dataset: str, code: str, tmp_path: Path) -> None:
    """Every finding with a fix maps to the plan's action on its file, and no action is
    without a finding: the plan takes the scan's decision, it does not decide again."""
    tree = corpus.build(name, tmp_path / name, plant=(dataset, code))
    report = scan_paths(tree.root, jobs=2)
    plan = build_plan(report, cache_roots(resolve([str(tree.root)])))
    skipped = {(n.path, n.code) for n in plan.notes if n.skipped}
    assert _planned(plan) == _fixable(report) - skipped
    assert not skipped
    assert {a.path for a in plan.actions} <= {f.path for f in report.findings}


def test_scan_and_fix_decide_alike_on_the_tie_of_issue_12(tmp_path: Path) -> None:
    _tie(tmp_path / "cache" / "vae" / "photos")
    report = scan_paths(tmp_path / "cache", jobs=2)
    assert _fixable(report) == set()
    assert build_plan(report, cache_roots(resolve([str(tmp_path / "cache")]))).actions == ()


def test_only_a_floating_latent_counts_for_dtypes(tmp_path: Path) -> None:
    """A kohya npz with two resolutions' latents (no one primary latent) holds int64
    original_size and crop_ltrb: not a latent dtype among the float32 ones."""
    import numpy as np

    from cachedoctor.fixtures.clean import kohya_arrays

    folder = tmp_path / "train" / "10_person"
    written = images(folder, n_per_bucket=2, buckets=((256, 256),))
    for n, (path, width, height, seed) in enumerate(written):
        arrays = kohya_arrays(encode(path, width, height, seed, 4, "float32"))
        if n == 0:  # sd-scripts PR #2269's multi-resolution keys
            latents = arrays.pop("latents")
            arrays = {"latents_32x32": latents, "latents_16x16": latents[:, :16, :16].copy(),
                      **arrays}
        np.savez(folder / f"{path.stem}_{width:04d}x{height:04d}_sdxl.npz", **arrays)
    assert [f for f in scan_paths(tmp_path / "train").findings if f.code == "CD304"] == []


def test_baseline_holds_when_healthy_files_are_added(tmp_path: Path) -> None:
    from cachedoctor.baseline import Baseline, write

    tree = corpus.build("simpletuner", tmp_path / "st", plant=("vae/sdxl/closeups", "CD304"))
    _tie(tree.root / "vae" / "mixed")
    before = scan_paths(tree.root)
    assert {f.code for f in before.findings} >= {"CD303", "CD304"}
    baseline = tmp_path / "baseline.json"
    write(before, str(baseline))
    # healthy growth: new latents in the dataset with the CD304 finding and in the split one
    closeups = tree.datasets["vae/sdxl/closeups"]
    written = images(tmp_path / "more", n_per_bucket=2, seed=9, buckets=((128, 128),))
    for path, width, height, seed in written:
        save_latent(closeups / f"{path.stem}.pt", encode(path, width * 2, height * 2, seed, 4,
                                                         "bfloat16"), "gzip")
        save_latent(tree.root / "vae" / "mixed" / f"{path.stem}.pt",
                    encode(path, width, height, seed, 4))
    after = scan_paths(tree.root)
    assert [f.message for f in after.findings] != [f.message for f in before.findings]
    result = Baseline.load(str(baseline)).apply(after)
    assert result.report.findings == ()
    # a new broken file is still new
    path, width, height, seed = written[0]
    bad = tree.datasets["vae/flux/photos"] / "new.pt"
    save_latent(bad, encode(path, width, height, seed, 4, "bfloat16"), "gzip")
    new = Baseline.load(str(baseline)).apply(scan_paths(tree.root)).report.findings
    assert [(f.code, f.path) for f in new] == [("CD303", str(bad))]
    assert json.loads(baseline.read_text())["findings"]


def _agree(report, targets: list[str]) -> None:
    plan = build_plan(report, cache_roots(resolve(targets)), include_info=True)
    skipped = {(n.path, n.code) for n in plan.notes if n.skipped}
    assert _fixable(report), "the comparison is of something"
    assert _planned(plan) | {p for p in skipped if p in _fixable(report)} == _fixable(report)
    assert _planned(plan) <= _fixable(report)


@pytest.mark.parametrize("trainer", ["simpletuner", "onetrainer", "kohya", "aitoolkit"])
def test_scan_and_fix_decide_alike_on_the_trainer_projects(trainer: str, tmp_path: Path) -> None:
    import importlib

    module = importlib.import_module(f"cachedoctor.fixtures.projects.{trainer}")
    project = module.build(tmp_path / "project", defects=module.DEFECTS[:6])
    _agree(scan_paths(project.config, jobs=2), [str(project.config)])


def test_scan_and_fix_decide_alike_on_the_demo_cache(tmp_path: Path) -> None:
    from cachedoctor.fixtures import write_demo

    write_demo(tmp_path / "demo")
    _agree(scan_paths(tmp_path / "demo", deep=True), [str(tmp_path / "demo")])


def test_shape_and_embedding_splits_are_warnings_without_a_fix(tmp_path: Path) -> None:
    from cachedoctor.fixtures.projects import simpletuner

    written = images(tmp_path / "images", n_per_bucket=4, buckets=((128, 128),), caption=False)
    bucket = tmp_path / "cache" / "latents" / "128x128"
    bucket.mkdir(parents=True)
    for i, (path, width, height, seed) in enumerate(written):  # 2 of each size in one bucket
        save_latent(bucket / f"{path.stem}.pt", encode(path, width + 64 * (i % 2), height, seed))
    text = tmp_path / "cache" / "text"
    text.mkdir()
    for n in range(4):  # 2 sdxl-sized and 2 flux-sized embeddings under one name scheme
        save_latent(text / f"{n:032x}-sd3.pt", simpletuner.text_embeds(n, "flux" if n % 2 else "sdxl"))
    report = scan_paths(tmp_path / "cache", jobs=2)
    by_code = {f.code: f for f in report.findings}
    assert set(by_code) == {"CD301", "CD305"}, report.findings
    assert by_code["CD301"].path == str(tmp_path / "cache" / "latents")
    assert by_code["CD301"].details["values"] == ["[4, 16, 16]", "[4, 16, 24]"]
    assert by_code["CD305"].path == str(text)
    assert all(f.severity == Severity.WARNING and f.fix is None for f in report.findings)
    assert build_plan(report, cache_roots(resolve([str(tmp_path / "cache")]))).actions == ()


def test_a_non_latent_tensor_is_no_latent_for_shape_channel_and_dtype(tmp_path: Path) -> None:
    """A bare int64 tensor (a saved `original_size`) among latents of a bucket folder is not
    judged as a latent: no CD301, CD303 or CD304 for it."""
    import torch

    written = images(tmp_path / "images", n_per_bucket=3, buckets=((128, 128),), caption=False)
    bucket = tmp_path / "cache" / "128x128"
    bucket.mkdir(parents=True)
    for path, width, height, seed in written:
        save_latent(bucket / f"{path.stem}.pt", encode(path, width, height, seed))
    torch.save(torch.tensor([128, 128]), bucket / "original_size.pt")
    torch.save(torch.zeros(4, 16, 16, dtype=torch.int64), bucket / "ids.pt")
    found = [f for f in scan_paths(tmp_path / "cache").findings if f.code in DATASET_RULES]
    assert found == []
