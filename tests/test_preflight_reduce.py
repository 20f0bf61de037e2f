"""Sharded preflight as a reduce: 2 and 4 gloo ranks find exactly what one process finds, and
what the ranks exchange does not grow with the healthy files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cachedoctor.baseline import fingerprint
from cachedoctor.fixtures import BUILDERS, clean

from conftest import scan_paths

pytest.importorskip("torch.distributed")
RANK_SCRIPT = Path(__file__).with_name("preflight_rank.py")


def _bare(root: Path) -> Path:
    """A bare cache with a clear majority in a bucket folder (one odd shape), a split (3 against
    3), a dtype minority, files saved from two devices, retained storage and an empty file."""
    cache = root / "bare"
    clean.build(cache / "majority" / "64x64", n=5)
    odd = clean.build(root / "tmp_odd", n=1, shape=(4, 12, 8))
    shutil.move(odd[0], cache / "majority" / "64x64" / "odd.pt")
    clean.build(cache / "split" / "64x64", n=3)
    for i, path in enumerate(clean.build(root / "tmp_split", n=3, shape=(4, 8, 12))):
        shutil.move(path, cache / "split" / "64x64" / f"other_{i}.pt")
    clean.build(cache / "dtypes", n=4, dtype="float16")
    for i, path in enumerate(clean.build(root / "tmp_dtype", n=1, dtype="float32")):
        shutil.move(path, cache / "dtypes" / f"wide_{i}.pt")
    BUILDERS["CD502"](cache / "devices", across_files=True, n=5)
    BUILDERS["CD201"](cache / "retained")
    BUILDERS["CD102"](cache)
    return cache


def _healthy(root: Path, n: int) -> Path:
    """`n` copies of one clean latent, and a bucket folder where one latent has another
    shape."""
    cache = root / f"healthy_{n}"
    [first] = clean.build(cache / "bulk", n=1)
    for i in range(1, n):
        shutil.copyfile(first, cache / "bulk" / f"copy_{i:05d}.pt")
    clean.build(cache / "odd" / "64x64", n=3)
    [odd] = clean.build(root / f"tmp_healthy_{n}", n=1, shape=(4, 16, 8))
    shutil.move(odd, cache / "odd" / "64x64" / "odd.pt")
    return cache


@pytest.fixture(scope="module")
def trees(tmp_path_factory) -> dict[str, str]:
    from cachedoctor.fixtures.projects import kohya, musubi, simpletuner

    root = tmp_path_factory.mktemp("reduce")
    built = {
        "bare": str(_bare(root)),
        "simpletuner": str(simpletuner.build(root / "st", ["CD301", "CD404", "CD405",
                                                           "CD405-bucket", "CD406",
                                                           "CD407"]).config),
        "kohya": str(kohya.build(root / "kohya", ["CD303", "CD404", "CD405", "CD406"]).config),
        "musubi": str(musubi.build(root / "musubi", ["CD309", "CD411", "CD404"]).config),
        "healthy_1000": str(_healthy(root, 1000)),
        "healthy_4000": str(_healthy(root, 4000)),
    }
    return built


def _local(target: str) -> list[list]:
    base = target if os.path.isdir(target) else os.path.dirname(target)
    report = scan_paths(target, jobs=1)
    return sorted([f.code, f.path, f.message, fingerprint(f, base)] for f in report.findings)


def _ranks(world: int, targets: list[str], where: Path) -> list[list[dict]]:
    """Every rank's results for `targets`, from one gloo group of `world` ranks."""
    where.mkdir()
    procs = [subprocess.Popen([sys.executable, str(RANK_SCRIPT), "trees", str(rank), str(world),
                               str(where / "store"), str(where / f"rank{rank}.json"), *targets],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(world)]
    try:
        outputs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, output in zip(procs, outputs, strict=True):
        assert p.returncode == 0, output
    return [json.loads((where / f"rank{rank}.json").read_text()) for rank in range(world)]


@pytest.fixture(scope="module")
def local(trees) -> dict[str, list[list]]:
    return {name: _local(target) for name, target in trees.items()}


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_find_what_one_process_finds(trees, local, world, tmp_path) -> None:
    names = list(trees)
    ranks = _ranks(world, [trees[n] for n in names], tmp_path / "ranks")
    expected = {"bare": {"CD102", "CD201", "CD301", "CD304", "CD502"},
                "simpletuner": {"CD301", "CD404", "CD405", "CD406", "CD407"},
                "kohya": {"CD303", "CD404", "CD405", "CD406"},
                "musubi": {"CD309", "CD411", "CD404"}}
    for name, codes in expected.items():  # the trees hold what they were built to
        assert codes <= {code for code, *_ in local[name]}, (name, local[name])
    # the bucket file lists an image no rank found (the listed-images bitset)
    assert any(code == "CD405" and path.endswith(".json") for code, path, *_ in local["simpletuner"])
    for rank in ranks:
        for name, seen in zip(names, rank, strict=True):
            assert seen["findings"] == local[name], name
    # the healthy trees: only the odd latent, whatever the number of healthy ones
    for n in (1000, 4000):
        assert [(code, Path(path).name) for code, path, *_ in local[f"healthy_{n}"]] == \
            [("CD301", "odd.pt")]
        assert ranks[0][names.index(f"healthy_{n}")]["files"] == n + 4
    small, large = (ranks[0][names.index(f"healthy_{n}")]["exchanged"] for n in (1000, 4000))
    # what travels is the aggregates and the odd file: not a byte more for 3,000 more files
    # (compressed, so within a few bytes of each other)
    assert abs(large - small) <= 64 * world, (small, large)
    assert large < 8_000 * world, large


def _aggregates(trees, name: str, world: int) -> list:
    """The aggregates of each of `world` shards of a tree, as the ranks make them."""
    from cachedoctor import engine, reduce
    from cachedoctor.options import ScanOptions

    parts = []
    for rank in range(world):
        scope = engine.begin([trees[name]], ScanOptions(jobs=1, shard=(rank, world)))
        phase = engine.read_files(scope)
        try:
            parts.append(reduce.aggregate(phase.store, engine.datasets_of(scope.layouts)))
        finally:
            phase.store.close()
    return parts


@pytest.mark.parametrize("name", ["bare", "simpletuner"])
def test_merge_is_associative_and_commutative(trees, name) -> None:
    from cachedoctor import reduce

    a, b, c = _aggregates(trees, name, 3)
    whole = reduce.merge_all([_aggregates(trees, name, 1)[0]])
    assert reduce.merge_all([a, reduce.merge_all([b, c])]) == whole
    assert reduce.merge_all([reduce.merge_all([c, a]), b]) == whole
    assert reduce.merge_all([b, a, c]) == whole


def test_the_coverage_sketch_is_clean_only_where_images_and_entries_pair() -> None:
    from cachedoctor import reduce
    from cachedoctor.summary import CACHE_SIDE, IMAGE_SIDE, CoverageRow

    def image(key, mtime=1.0, flag=1):
        return CoverageRow("d", IMAGE_SIDE, key, f"/i/{key}.png", mtime, flag, None)

    def entry(key, mtime=2.0):
        return CoverageRow("d", CACHE_SIDE, key, f"/c/{key}.pt", mtime, 0, None)

    def dirty(*rows):
        one, two = reduce.DatasetAggregate(), reduce.DatasetAggregate()
        for i, row in enumerate(rows):  # spread over two "ranks"
            (one if i % 2 else two).add_row(row)
        return reduce.merge(one, two).dirty(2.0)

    bucket = {k: reduce._hashes(k)[0] for k in ("a", "b", "c")}
    pairs = [image("a"), entry("a"), image("b"), entry("b")]
    assert dirty(*pairs) == frozenset()
    assert dirty(*pairs, image("c")) == {bucket["c"]}  # a missing entry
    assert dirty(*pairs, entry("c")) == {bucket["c"]}  # an orphan
    assert dirty(*pairs, image("c", flag=0)) == {bucket["c"]}  # the trainer expects none
    assert dirty(image("a", mtime=9.0), entry("a")) == {bucket["a"]}  # a newer image: stale?
    assert dirty(image("a"), CoverageRow("d", IMAGE_SIDE, "a", "/i/a.jpg", 1.0, 1, None),
                 entry("a")) == {bucket["a"]}  # two images, one entry: a collision


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_one_rank_group_exchanges_on_its_backend_device(trees, local, backend, tmp_path) -> None:
    """The reduce's path in one process: NCCL moves only CUDA tensors (on this rank's device),
    gloo CPU ones; `exchanged` counts every rank's length and padded bytes."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    if backend == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        pytest.skip("needs CUDA and NCCL")
    from cachedoctor import api, reduce

    dist.init_process_group(backend, init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        exchange = reduce.Exchange(dist)
        assert exchange.all_gather(b"\x00ab\xff") == [b"\x00ab\xff"]
        assert exchange.all_gather(b"") == [b""]
        assert exchange.exchanged == (8 + 4) + (8 + 1)
        assert exchange.objects({"x": [1, 2]}) == [{"x": [1, 2]}]
        report, _ = api._sharded(dist, None, (trees["bare"],), "never",
                                 {"jobs": 1, "isolated": True})
    finally:
        dist.destroy_process_group()
    base = trees["bare"]
    assert sorted([f.code, f.path, f.message, fingerprint(f, base)]
                  for f in report.findings) == local["bare"]


def test_the_common_folder_of_merged_spans_is_every_folders() -> None:
    import random

    from cachedoctor.summary import common_folder, widen

    rng = random.Random(7)
    names = ["a", "a-b", "a b", "b", "ab"]
    for _ in range(200):
        folders = ["/r/" + "/".join(rng.choice(names) for _ in range(rng.randint(0, 3)))
                   for _ in range(rng.randint(1, 6))]
        folders = [f.rstrip("/") for f in folders]
        parts: list[dict] = [{}, {}]
        for folder in folders:
            widen(parts[rng.randint(0, 1)], "g", folder)
        merged: dict = {}
        for part in parts:
            for low, high in part.values():
                widen(merged, "g", low)
                widen(merged, "g", high)
        assert common_folder(merged.values()) == os.path.commonpath(folders), folders
