"""diffusion-pipe's sharded caches: blobs checked through metadata.db, a hostile database is a
finding, and fix quarantines a cache folder as the unit diffusion-pipe rebuilds."""

from __future__ import annotations

import hashlib
import io
import os
import sqlite3
import time
from pathlib import Path

import pytest

from cachedoctor.findings import Severity
from cachedoctor.fixtures.projects import diffusion_pipe as dp
from cachedoctor.formats import shard_blobs
from cachedoctor.layouts import resolve

from conftest import by_code, invoke, scan_paths


def serious(report) -> list:
    return [f for f in report.findings if f.severity >= Severity.WARNING]


def latents_of(project) -> Path:
    return dp.cache_of(project) / dp.bucket_dir(128, 128) / "latents"


def test_clean_cache_is_silent_and_every_blob_is_checked(tmp_path: Path) -> None:
    project = dp.build(tmp_path)
    report = scan_paths(project.config, keep_paths=True)
    assert report.findings == ()
    assert report.trainers == ("diffusion-pipe",)
    blobs = [p for p in report.checked if "@" in p]
    # 3 buckets x 4 images, one latent and one text embedding each; the empty caption's
    assert len(blobs) == 25
    first = latents_of(project)
    expected = [f"{first / 'shard_0.bin'}@{o}" for o, _ in dp.shard_rows(first, 0)]
    assert set(expected) <= set(blobs)
    assert all(p.endswith(".bin@0") for p in expected[:1])


@pytest.mark.parametrize("defect", ["truncated", "zeroed-blob", "overlap", "past-end",
                                    "missing-shard", "no-fingerprint", "killed-pass",
                                    "corrupt-db"])
def test_each_defect_is_found_on_its_path(tmp_path: Path, defect: str) -> None:
    project = dp.build(tmp_path, defects={defect})
    report = scan_paths(project.config)
    found = {(f.code, f.path, f.dataset) for f in serious(report)}
    expected = {(code, path, dataset) for code, hits in project.expected.items()
                for path, dataset in hits}
    assert found == expected
    # the cache dir alone (no config) finds the same
    bare = {(f.code, f.path) for f in serious(scan_paths(dp.cache_of(project)))}
    assert bare == {(code, path) for code, path, _ in expected}


def test_blobs_get_every_file_rule(tmp_path: Path) -> None:
    """A blob is judged as a single file would be: an unsafe pickle is CD105, a saved view of a
    batch CD201, each on its shard_<n>.bin@<offset>."""
    import torch

    folder = tmp_path / "cache_1.000000x64x64x1" / "latents"
    batch = torch.randn(8, 16, 1, 8, 8)
    dp.write_cache(folder, [{"latents": batch[0].clone()}, {"latents": batch[1]},
                            {"latents": batch[2].clone(), "extra": Hostile()}])
    rows = dp.shard_rows(folder, 0)
    report = scan_paths(tmp_path)
    shard = folder / "shard_0.bin"
    assert [f.path for f in by_code(report, "CD201")] == [f"{shard}@{rows[1][0]}"]
    assert [f.path for f in by_code(report, "CD105")] == [f"{shard}@{rows[2][0]}"]
    assert by_code(report, "CD101") == []


def test_each_text_encoder_s_cache_is_compared_with_its_own_kind(tmp_path: Path) -> None:
    """diffusion-pipe keeps text_embeddings_<i>/ per text encoder: their keys differ by design
    (no CD305), but a blob unlike the others of its own encoder is CD305."""
    import torch

    project = dp.build(tmp_path)
    clip = [{"clip_l": torch.randn(77, 32).to(torch.bfloat16)} for _ in range(4)]
    for bucket in sorted(dp.cache_of(project).glob("cache_*")):
        dp.write_cache(bucket / "text_embeddings_1", clip)
    llm = [{"llm_embed": torch.randn(20, 48), "mask": torch.ones(20, dtype=torch.bool)}] * 4
    for bucket in sorted(dp.cache_of(project).glob("cache_*")):
        dp.write_cache(bucket / "text_embeddings_2", llm)  # float32 beside bfloat16: by design
    assert serious(scan_paths(project.config)) == []
    odd = dp.cache_of(project) / dp.bucket_dir(128, 128) / "text_embeddings_1"
    dp.write_cache(odd, [{"clip_l": torch.randn(77, 48).to(torch.bfloat16)}])  # a later pass
    rows = dp.shard_rows(odd, 1)
    assert [(f.code, f.path) for f in serious(scan_paths(project.config))] == [
        ("CD305", f"{odd / 'shard_1.bin'}@{rows[0][0]}")]
    dp.write_cache(odd, [{"clip_l": torch.randn(77, 32)}])  # float32 among bfloat16
    (mixed,) = by_code(scan_paths(project.config), "CD304")
    assert "(text_embeddings_1)" in mixed.message
    assert mixed.details["files"] == [f"{odd / 'shard_2.bin'}@0"]


def test_the_empty_caption_s_embeddings_are_text_embeddings(tmp_path: Path) -> None:
    """`uncond_text_embeddings_<i>/` (beside the size buckets) holds text encoder i's embedding
    of the caption "" (utils/dataset.py DirectoryDataset.cache_text_embeddings, 8f83dbf2): a
    text embedding, never a latent, whatever its keys say; a cut one is still CD101."""
    import torch

    from cachedoctor.inventory import TEXT, Entry
    from cachedoctor.sharded import expand

    folder = dp.cache_of(dp.build(tmp_path)) / "uncond_text_embeddings_1"
    # an LLM encoder's output: keys no text rule knows by name, a [1, seq, dim] hidden state
    dp.write_cache(folder, [{"llm_hidden": torch.randn(1, 7, 48).to(torch.bfloat16),
                             "llm_lengths": torch.tensor([7])}])
    shard = folder / "shard_0.bin"
    parts = list(expand([Entry(str(shard), "latent")], False, str(folder)))
    assert [(entry.role, meta.errors) for entry, meta in parts] == [(TEXT, ())]
    report = scan_paths(tmp_path / "dataset")
    assert serious(report) == []
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    assert [(f.code, f.path) for f in serious(scan_paths(tmp_path / "dataset"))] == [
        ("CD101", f"{shard}@0")]


def test_deep_finds_a_flipped_byte_inside_a_blob(tmp_path: Path) -> None:
    project = dp.build(tmp_path)
    folder = latents_of(project)
    offset, size = dp.shard_rows(folder, 0)[1]
    with open(folder / "shard_0.bin", "r+b") as f:  # inside the tensor bytes of the second blob
        f.seek(offset + size // 2)
        byte = f.read(1)[0]
        f.seek(offset + size // 2)
        f.write(bytes([byte ^ 0xFF]))
    assert serious(scan_paths(project.config)) == []  # metadata only: the flip is in the data
    assert [(f.code, f.path) for f in serious(scan_paths(project.config, deep=True))] == [
        ("CD103", f"{folder / 'shard_0.bin'}@{offset}")]


class Hostile:
    """Any class outside torch's allow-list: torch.save pickles a GLOBAL naming it."""


def _db(folder: Path, *statements: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "metadata.db"
    con = sqlite3.connect(path)
    for statement in statements:
        con.execute(statement)
    con.commit()
    con.close()
    (folder / "shard_0.bin").write_bytes(b"")
    return path


HOSTILE = {
    "garbage": None,
    "empty": None,
    "no items table": ("CREATE TABLE fingerprint(value)",),
    # a view named like a shard table that counts forever: only tables are read
    "endless view": ("CREATE TABLE items(shard, shard_index)",
                     "INSERT INTO items VALUES (0, 0)",
                     "CREATE VIEW shard_0 AS WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL "
                     "SELECT i + 1 FROM n) SELECT i AS offset, 1 AS size FROM n"),
    "text offsets": ("CREATE TABLE items(shard, shard_index)", "INSERT INTO items VALUES (0, 0)",
                     "CREATE TABLE shard_0(offset, size)", "INSERT INTO shard_0 VALUES ('a', 'b')"),
    "no shard number": ("CREATE TABLE items(shard, shard_index)", "CREATE TABLE shard_x(offset, size)"),
    "dangling item": ("CREATE TABLE items(shard, shard_index)", "INSERT INTO items VALUES (0, 5)",
                      "CREATE TABLE shard_0(offset, size)"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_metadata_db_is_cd101_and_the_rest_is_judged(tmp_path: Path, case: str) -> None:
    bad = tmp_path / "a" / "latents"
    statements = HOSTILE[case]
    if statements is None:
        bad.mkdir(parents=True)
        (bad / "metadata.db").write_bytes(b"" if case == "empty" else os.urandom(4096))
        (bad / "shard_0.bin").write_bytes(b"")
    else:
        _db(bad, *statements)
    good = dp.write_cache(tmp_path / "b" / "latents", [dp.latent(64, 64, 1)])
    (good / "shard_0.bin").write_bytes((good / "shard_0.bin").read_bytes()[:100])  # cut short
    started = time.monotonic()
    report = scan_paths(tmp_path)
    assert time.monotonic() - started < 5
    assert [f.path for f in by_code(report, "CD101")] == sorted(
        [str(bad / "metadata.db"), f"{good / 'shard_0.bin'}@0"])
    assert by_code(report, "CD002") == []


def test_another_program_s_metadata_db_is_no_index(tmp_path: Path) -> None:
    """A SQLite metadata.db with no shards beside it and no items table is not diffusion-pipe's:
    a foreign file (CD107), as before, not a broken index."""
    con = sqlite3.connect(tmp_path / "metadata.db")
    con.execute("CREATE TABLE photos(name)")
    con.commit()
    con.close()
    report = scan_paths(tmp_path)
    assert [(f.code, Path(f.path).name) for f in report.findings] == [("CD107", "metadata.db")]


def test_a_fifo_named_metadata_db_does_not_hang(tmp_path: Path) -> None:
    folder = dp.write_cache(tmp_path / "latents", [dp.latent(64, 64, 0)])
    (folder / "metadata.db").unlink()
    os.mkfifo(folder / "metadata.db")
    index = shard_blobs.read_index(str(folder / "metadata.db"))
    assert index.error == "not a regular file"


def test_a_folder_name_that_is_no_utf8(tmp_path: Path) -> None:
    odd = Path(os.fsdecode(bytes(tmp_path) + b"/caf\xe9 %41?x#"))
    folder = dp.write_cache(odd / "latents", [dp.latent(64, 64, 0)])
    index = shard_blobs.read_index(str(folder / "metadata.db"))
    assert index.error is None and index.items == 1


def test_rows_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shard_blobs, "MAX_ROWS", 10)
    shard_blobs._indexes.clear()
    folder = dp.write_cache(tmp_path / "latents", [dp.latent(64, 64, i) for i in range(11)])
    index = shard_blobs.read_index(str(folder / "metadata.db"))
    assert index.error == "more than 10 rows: not read"


def test_misplaced_blobs_are_bounded(tmp_path: Path) -> None:
    """A table of a million rows that all overlap gives a bounded number of findings."""
    folder = tmp_path / "latents"
    _db(folder, "CREATE TABLE fingerprint(value)", "INSERT INTO fingerprint VALUES ('x')",
        "CREATE TABLE items(shard, shard_index)", "CREATE TABLE shard_0(offset, size)",
        "WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < 999999) "
        "INSERT INTO shard_0 SELECT 0, 10 FROM n")
    (folder / "shard_0.bin").write_bytes(bytes(10))
    started = time.monotonic()
    found = by_code(scan_paths(tmp_path), "CD101")
    assert time.monotonic() - started < 30
    assert len(found) == shard_blobs.MAX_BAD_BLOBS + 2  # the blob at 0, 100 overlaps, the rest
    assert "999,898 blobs after it are not checked" in found[-1].message


def test_vm_work_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A query that would run long (a huge table scanned) is interrupted, not waited for."""
    monkeypatch.setattr(shard_blobs, "MAX_VM_STEPS", 200_000)
    folder = tmp_path / "latents"
    path = _db(folder, "CREATE TABLE items(shard, shard_index)",
               "WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < 200000) "
               "INSERT INTO items SELECT 0, i FROM n")
    index = shard_blobs.read_index(str(path))
    assert index.error is not None and "work allowed" in index.error


def test_scan_opens_metadata_db_read_only(tmp_path: Path) -> None:
    project = dp.build(tmp_path)
    folder = latents_of(project)
    db = folder / "metadata.db"
    before = hashlib.sha256(db.read_bytes()).hexdigest(), db.stat().st_mtime_ns
    os.chmod(db, 0o444)
    os.chmod(folder, 0o555)  # not even a journal could be created beside it
    try:
        report = scan_paths(project.config)
    finally:
        os.chmod(folder, 0o755)
        os.chmod(db, 0o644)
    assert serious(report) == []
    assert (hashlib.sha256(db.read_bytes()).hexdigest(), db.stat().st_mtime_ns) == before
    assert sorted(p.name for p in folder.iterdir()) == ["metadata.db", "shard_0.bin", "shard_1.bin"]


@pytest.mark.parametrize("defect", ["zeroed-blob", "missing-shard", "corrupt-db"])
def test_fix_quarantines_the_cache_folder_and_undo_restores_it(tmp_path: Path, defect: str) -> None:
    project = dp.build(tmp_path, defects={defect})
    folder = latents_of(project)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    others = {p: p.read_bytes() for p in dp.cache_of(project).rglob("*")
              if p.is_file() and p.parent != folder}
    result = invoke("fix", str(project.config), "-y")
    assert result.exit_code == 0, result.output
    assert list(folder.iterdir()) == []  # metadata.db and every shard: diffusion-pipe rebuilds it
    assert all(p.read_bytes() == data for p, data in others.items())  # other folders untouched
    assert serious(scan_paths(project.config)) == []
    result = invoke("undo", "--cache", str(dp.cache_of(project)))
    assert result.exit_code == 0, result.output
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_killed_pass_quarantines_only_its_shard(tmp_path: Path) -> None:
    project = dp.build(tmp_path, defects={"killed-pass"})
    folder = latents_of(project)
    old = time.time() - 3600  # not a writer still running
    os.utime(folder / "shard_2.bin", (old, old))
    result = invoke("fix", str(project.config), "-y")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in folder.iterdir()) == ["metadata.db", "shard_0.bin", "shard_1.bin"]
    assert serious(scan_paths(project.config)) == []


def test_a_blob_is_never_rewritten_in_place(tmp_path: Path) -> None:
    import torch

    folder = tmp_path / "latents"
    batch = torch.randn(4, 16, 1, 8, 8)
    dp.write_cache(folder, [{"latents": batch[1]}])
    data = (folder / "shard_0.bin").read_bytes()
    result = invoke("fix", str(tmp_path), "-y")
    assert result.exit_code == 0, result.output
    assert "never rewritten in place" in result.output
    assert (folder / "shard_0.bin").read_bytes() == data


def test_blob_source_reads_only_its_window(tmp_path: Path) -> None:
    import torch

    buffers = []
    for i in range(2):
        b = io.BytesIO()
        torch.save({"latents": torch.full((16, 64, 64), float(i))}, b)  # > 64 KiB: windows
        buffers.append(b.getvalue())
    folder = tmp_path / "latents"
    dp.write_cache(folder, [{"latents": torch.full((16, 64, 64), float(i))} for i in range(2)])
    index = shard_blobs.read_index(str(folder / "metadata.db"))
    metas = list(shard_blobs.blobs(str(folder / "shard_0.bin"), index, 0))
    assert [m.size for m in metas] == [len(b) for b in buffers]
    assert all(m.ok and m.tensors[0].shape == (16, 64, 64) for m in metas)


# -- the config layout --------------------------------------------------------------------------


def test_layout_from_the_training_config(tmp_path: Path) -> None:
    project = dp.build(tmp_path)
    (layout,) = resolve([str(project.config)])
    (dataset,) = layout.datasets
    assert layout.trainer == "diffusion-pipe"
    assert layout.files == (str(project.config), str(tmp_path / "dataset.toml"))
    assert dataset.id == "dataset"
    assert dataset.image_dirs == dataset.shallow_image_dirs == (str(tmp_path / "dataset"),)
    assert dataset.cache_dirs == (str(dp.cache_of(project)),)
    assert dataset.caches_beside_images  # <path>/cache is diffusion-pipe's own place: no CD401


def test_dataset_toml_and_project_folder_give_the_config_s_layout(tmp_path: Path) -> None:
    project = dp.build(tmp_path, defects={"zeroed-blob"})
    by_config = scan_paths(project.config).findings
    assert by_config and scan_paths(tmp_path / "dataset.toml").findings == by_config
    assert scan_paths(tmp_path).findings == by_config


def test_configs_in_a_sub_folder_resolve_against_the_working_dir(tmp_path: Path) -> None:
    """diffusion-pipe's examples: `dataset = 'examples/dataset.toml'`, run from the repo root."""
    project = dp.build(tmp_path)
    examples = tmp_path / "examples"
    examples.mkdir()
    config = examples / "main.toml"
    config.write_text(project.config.read_text().replace("'dataset.toml'", "'examples/dataset.toml'"))
    (tmp_path / "dataset.toml").rename(examples / "dataset.toml")
    (layout,) = resolve([str(config)])
    assert layout.problems == ()
    assert layout.datasets[0].cache_dirs == (str(dp.cache_of(project)),)


def test_an_unknown_model_name_checks_the_whole_cache_folder(tmp_path: Path) -> None:
    project = dp.build(tmp_path)
    project.config.write_text(project.config.read_text().replace("type = 'flux'", "type = 'wan'"))
    (layout,) = resolve([str(project.config)])
    assert layout.datasets[0].cache_dirs == (str(tmp_path / "dataset" / "cache"),)


def test_config_problems_are_findings(tmp_path: Path) -> None:
    project = dp.build(tmp_path)
    text = project.config.read_text()
    project.config.write_text(text.replace("'dataset.toml'", "'nowhere.toml'"))
    (f,) = by_code(scan_paths(project.config), "CD408")
    assert f.path == str(project.config) and "nowhere.toml" in f.message
    project.config.write_text(text)
    (tmp_path / "dataset.toml").write_text(dp.DATASET.replace("path = 'dataset'", "path = 'gone'")
                                           + "\n[[directory]]\npath = 7\n")
    report = scan_paths(project.config)
    assert [f.details["key"] for f in by_code(report, "CD409")] == ["path"]
    assert "gone" in by_code(report, "CD408")[0].message


def _second_model_cache(project, name: str, channels: int) -> Path:
    """Another model's cache beside the fixture's, as a Wan checkpoint names it (models/wan/
    wan.py: `wan_i2v`, `wan2.2_5b`, ... never the configured type 'wan')."""
    import torch

    cache = dp.cache_of(project).parent / name
    items = [{"latents": torch.randn(channels, 1, 8, 8, generator=torch.Generator().manual_seed(s))
              .to(torch.bfloat16)} for s in range(3)]
    dp.write_cache(cache / dp.bucket_dir(64, 64) / "latents", items)
    return cache


def test_a_wan_type_with_two_checkpoint_named_caches_compares_neither_with_the_other(
        tmp_path: Path) -> None:
    """type 'wan' caches in a folder named by the checkpoint: with no `cache/wan/` and two
    model folders, each is a dataset of its own (it was one: CD303 across the models)."""
    project = dp.build(tmp_path)
    project.config.write_text(project.config.read_text().replace("type = 'flux'", "type = 'wan'"))
    other = _second_model_cache(project, "wan2.2_5b", 48)
    (layout,) = resolve([str(project.config)])
    assert [d.cache_dirs for d in layout.datasets] == [
        (str(dp.cache_of(project)),), (str(other),)]
    assert [d.id for d in layout.datasets] == ["dataset (flux)", "dataset (wan2.2_5b)"]
    assert scan_paths(project.config).findings == ()
    # a real defect in one of them is still found, on its path
    project = dp.build(tmp_path / "defect", defects={"zeroed-blob"})
    project.config.write_text(project.config.read_text().replace("type = 'flux'", "type = 'wan'"))
    _second_model_cache(project, "wan2.2_5b", 48)
    expected = {path for hits in project.expected.values() for path, _ in hits}
    assert {(f.code, f.path) for f in serious(scan_paths(project.config))} == {
        ("CD101", path) for path in expected}


def test_our_index_in_the_cache_folder_is_no_model_cache(tmp_path: Path) -> None:
    """A config scan that falls back to all of `cache/` keeps its index in
    `cache/.cachedoctor/`; a later bare scan of the `[[directory]]` folder took that for a
    model cache and reported CD107 on index.sqlite."""
    project = dp.build(tmp_path)
    project.config.write_text(project.config.read_text().replace("type = 'flux'", "type = 'wan'"))
    assert scan_paths(project.config).findings == ()
    assert (dp.cache_of(project).parent / ".cachedoctor").is_dir()
    dataset = tmp_path / "dataset"
    assert scan_paths(dataset).findings == ()
    (layout,) = resolve([str(dataset)])
    assert [d.cache_dirs for d in layout.datasets] == [(str(dp.cache_of(project)),)]
    shard = latents_of(project) / "shard_0.bin"  # a real defect still fires, bare
    offset, size = dp.shard_rows(latents_of(project), 0)[0]
    with open(shard, "r+b") as f:
        f.seek(offset)
        f.write(bytes(size))
    assert {(f.code, f.path) for f in serious(scan_paths(dataset))} == {
        ("CD101", f"{shard}@{offset}")}


def test_a_metadata_db_replaced_at_its_size_and_mtime_is_read_again(tmp_path):
    """shard_blobs keeps the indexes it read by path and stat: a metadata.db replaced (a new
    file renamed over it) at the same size and mtime is another index, not the one held."""
    from cachedoctor.formats import shard_blobs

    def write(path, items):
        con = sqlite3.connect(path)
        con.execute("CREATE TABLE items (shard INTEGER, shard_index INTEGER)")
        con.executemany("INSERT INTO items VALUES (?, ?)", [(0, i) for i in range(items)])
        con.commit()
        con.close()

    db = tmp_path / "metadata.db"
    write(db, 3)
    assert shard_blobs.index_of(str(tmp_path)).items == 3
    st = db.stat()
    new = tmp_path / "new.db"
    write(new, 5)
    assert new.stat().st_size == st.st_size  # (SQLite pages: one size for both)
    os.utime(new, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(new, db)
    assert (db.stat().st_size, db.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    assert shard_blobs.index_of(str(tmp_path)).items == 5


# diffusion-pipe's Cache (utils/cache.py) as it picks a blob's bytes, then torch.load
DP_LOAD = """
import io, sqlite3, sys, torch
from collections import defaultdict
path = sys.argv[1]
con = sqlite3.connect(path + "/metadata.db")
items = con.execute("SELECT shard, shard_index FROM items").fetchall()
shard_metadata = defaultdict(list)
for table_name, in con.execute("SELECT name FROM sqlite_master").fetchall():
    if table_name.startswith("shard_"):
        shard_id = int(table_name.split("_")[-1])
        shard_metadata[shard_id].extend(con.execute(f"SELECT offset, size FROM {table_name}"))
for shard, index in items:
    offset, size = shard_metadata[shard][index]
    with open(f"{path}/shard_{shard}.bin", "rb") as f:
        f.seek(offset)
        torch.load(io.BytesIO(f.read(size)), map_location="cpu", weights_only=False)
"""


class Opens:
    """Creates `marker` when unpickled for real."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("hostile_table", ["shard_01", "shard_x_1"])
def test_a_second_table_of_one_shard_number(tmp_path: Path, hostile_table: str) -> None:
    """diffusion-pipe reads a table's shard number as int(name.split('_')[-1]) and appends the
    rows of every table of one number in sqlite_master's order. The scan kept one table per
    number (shard_1 sorted after shard_01 and replaced its rows): a hostile blob that only
    shard_01 lists, loaded for item 0, was never read."""
    import subprocess
    import sys

    import torch

    folder, marker = tmp_path / "cache_1.000000x64x64x1" / "latents", tmp_path / "marker"
    folder.mkdir(parents=True)

    def blob(obj: object) -> bytes:
        out = io.BytesIO()
        torch.save(obj, out)
        return out.getvalue()

    clean = [blob({"latents": torch.full((16, 1, 8, 8), float(i))}) for i in range(3)]
    hostile = blob({"latents": torch.zeros(16, 1, 8, 8), "x": Opens(marker)})
    rows, at = [], 0
    for b in clean:
        rows.append((at, len(b)))
        at += len(b)
    (folder / "shard_1.bin").write_bytes(b"".join(clean) + hostile)
    con = sqlite3.connect(folder / "metadata.db")
    con.execute("CREATE TABLE fingerprint(value)")
    con.execute("INSERT INTO fingerprint VALUES ('f')")
    con.execute("CREATE TABLE items(shard, shard_index)")
    con.executemany("INSERT INTO items VALUES (1, ?)", [(i,) for i in range(3)])
    con.execute(f"CREATE TABLE {hostile_table}(offset, size)")  # first in sqlite_master
    con.execute(f"INSERT INTO {hostile_table} VALUES (?, ?)", (at, len(hostile)))
    con.execute("CREATE TABLE shard_1(offset, size)")
    con.executemany("INSERT INTO shard_1 VALUES (?, ?)", rows)
    con.commit()
    con.close()
    subprocess.run([sys.executable, "-c", DP_LOAD, str(folder)], capture_output=True, timeout=120)
    assert marker.exists()
    marker.unlink()
    report = scan_paths(tmp_path)
    assert [f.path for f in by_code(report, "CD105")] == [f"{folder / 'shard_1.bin'}@{at}"]
    assert [f.path for f in by_code(report, "CD101")] == [str(folder / "metadata.db")]


# Leaves metadata.db (argv[1]) with a hot journal: a transaction pointing the one row of
# shard_0 at (0, argv[2]) spilled to the file, then the process dies before COMMIT.
KILLED_MID_COMMIT = """
import os, sqlite3, sys
con = sqlite3.connect(sys.argv[1], isolation_level=None)
con.execute("PRAGMA cache_size=1")
con.execute("BEGIN EXCLUSIVE")
con.execute("UPDATE shard_0 SET offset = 0, size = ?", (int(sys.argv[2]),))
con.execute("UPDATE pad SET x = zeroblob(1000)")
os._exit(0)
"""


@pytest.mark.parametrize("log", ["wal", "hot journal"])
def test_a_log_beside_metadata_db_is_read_as_sqlite_reads_it(tmp_path: Path, log: str) -> None:
    """The scan opened metadata.db immutable, which ignores a -wal file and a hot -journal;
    diffusion-pipe's SQLite reads the WAL's commits and rolls a hot journal back. Shipped with
    one, a clean-looking database pointed diffusion-pipe at a hostile blob the scan never read."""
    import shutil
    import subprocess
    import sys

    import torch

    folder, marker = tmp_path / "cache" / "latents", tmp_path / "marker"
    folder.mkdir(parents=True)
    out = io.BytesIO()
    torch.save({"latents": torch.zeros(16, 1, 8, 8)}, out)
    clean = out.getvalue()
    out = io.BytesIO()
    torch.save({"latents": torch.zeros(16, 1, 8, 8), "x": Opens(marker)}, out)
    hostile = out.getvalue()
    (folder / "shard_0.bin").write_bytes(clean + hostile)
    work = tmp_path / "work"
    work.mkdir()
    con = sqlite3.connect(work / "metadata.db", isolation_level=None)
    if log == "wal":
        con.execute("PRAGMA journal_mode=WAL")
        con.execute("PRAGMA wal_autocheckpoint=0")
    for statement in ("CREATE TABLE fingerprint(value)", "INSERT INTO fingerprint VALUES ('f')",
                      "CREATE TABLE items(shard, shard_index)", "INSERT INTO items VALUES (0, 0)",
                      "CREATE TABLE shard_0(offset, size)", "CREATE TABLE pad(x)"):
        con.execute(statement)
    first, then = ((0, len(clean)), (len(clean), len(hostile))) if log == "wal" else (
        (len(clean), len(hostile)), None)
    con.execute("INSERT INTO shard_0 VALUES (?, ?)", first)
    con.executemany("INSERT INTO pad VALUES (?)", [(b"x" * 1000,)] * 200)
    if log == "wal":
        con.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # the clean row in the file
        con.execute("UPDATE shard_0 SET offset = ?, size = ?", then)  # the hostile one in the WAL
        for name in ("metadata.db", "metadata.db-wal"):
            shutil.copy(work / name, folder / name)
        con.close()
    else:
        con.close()
        shutil.copy(work / "metadata.db", folder / "metadata.db")
        subprocess.run([sys.executable, "-c", KILLED_MID_COMMIT, str(folder / "metadata.db"),
                        str(len(clean))], check=True, timeout=60)
        assert (folder / "metadata.db-journal").exists()
    listed = sorted(os.listdir(folder))
    immutable = sqlite3.connect(f"file:{folder / 'metadata.db'}?mode=ro&immutable=1", uri=True)
    assert immutable.execute("SELECT offset FROM shard_0").fetchall() == [(0,)]
    immutable.close()

    report = scan_paths(tmp_path)

    assert sorted(os.listdir(folder)) == listed  # the scan changed nothing there
    assert [f.path for f in by_code(report, "CD105")] == [f"{folder / 'shard_0.bin'}@{len(clean)}"]
    shutil.copytree(folder, tmp_path / "copy")  # (SQLite may roll the journal back in place)
    subprocess.run([sys.executable, "-c", DP_LOAD, str(tmp_path / "copy")], capture_output=True,
                   timeout=120)
    assert marker.exists()
    marker.unlink()
    # fix quarantines the folder, the log with it (beside a rebuilt database SQLite applies it)
    result = invoke("fix", str(folder.parent), "-y")
    assert result.exit_code == 0, result.output
    assert list(folder.iterdir()) == [] and not marker.exists()
