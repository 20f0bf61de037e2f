"""The walk: roles from names, and every way a directory tree can be hostile."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cachedoctor.inventory import IMAGE, LATENT, METADATA, OTHER, TEMP, TEXT, batches, classify, walk


@pytest.mark.parametrize(
    ("name", "parent", "role"),
    [
        ("3fa1e2" * 10 + "abcd.pt", "/c/vae", LATENT),
        ("10f34c853ae35b374b489315e55183a4-flux.pt", "/c/text", TEXT),
        ("img_0001_1024x0768_sdxl.npz", "/d/img", LATENT),
        ("img_0001_te_outputs.npz", "/d/img", TEXT),
        ("img_0001_flux_te.npz", "/d/img", TEXT),
        ("img_0001_Zm9v.safetensors", "/d/img/_t_e_cache", TEXT),
        ("img_0001_Zm9v.safetensors", "/d/img/_latent_cache", LATENT),
        ("3.pt", "/w/cache/text/ab12/variation-0", TEXT),
        ("aggregate.pt", "/w/cache/image/ab12/variation-0", METADATA),
        ("aspect_ratio_bucket_indices_photos.json", "/d", METADATA),
        ("tmpk2x9_a1b", "/c", TEMP),
        (".3fa1.pt.tmp", "/c", TEMP),
        ("3fa1.pt.tmp", "/c", TEMP),
        ("3fa1.pt.lock", "/c", TEMP),
        ("photo.JPG", "/c", IMAGE),
        ("photo.txt", "/c", OTHER),
    ],
)
def test_classify(name: str, parent: str, role: str) -> None:
    assert classify(name, parent) == role


def test_walk_finds_nested_files_and_skips_state_dir(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "x.pt").write_bytes(b"x")
    (tmp_path / "top.pt").write_bytes(b"")
    (tmp_path / ".cachedoctor" / "quarantine").mkdir(parents=True)
    (tmp_path / ".cachedoctor" / "quarantine" / "old.pt").write_bytes(b"x")
    entries = {Path(e.path).name: e for e in walk(str(tmp_path), dataset="d")}
    assert set(entries) == {"x.pt", "top.pt"}
    assert entries["x.pt"].bucket == os.path.join("a", "b")
    assert entries["top.pt"].bucket is None
    assert all(e.dataset == "d" and e.error is None for e in entries.values())


def test_symlink_loop_to_ancestor_is_reported_once(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "f.pt").write_bytes(b"x")
    os.symlink(tmp_path, tmp_path / "sub" / "up")
    entries = list(walk(str(tmp_path)))
    errors = [e for e in entries if e.error]
    assert [Path(e.path).name for e in errors] == ["up"]
    assert "symlink loop" in errors[0].error
    assert [Path(e.path).name for e in entries if not e.error] == ["f.pt"]


def test_a_link_to_the_root_of_the_disk_is_a_loop_not_a_walk(tmp_path: Path) -> None:
    """`cache/sub/slash -> /` or `cache/up -> ..` hold the scanned folder: followed, they would
    walk the whole disk (or the cache's neighbours) before meeting the cache again."""
    cache = tmp_path / "cache"
    (cache / "sub").mkdir(parents=True)
    (cache / "f.pt").write_bytes(b"x")
    (tmp_path / "neighbour.pt").write_bytes(b"x")
    os.symlink("/", cache / "sub" / "slash")
    os.symlink("..", cache / "up")
    entries = list(walk(str(cache)))
    assert sorted(Path(e.path).name for e in entries if e.error) == ["slash", "up"]
    assert all("holds the scanned one" in e.error for e in entries if e.error)
    assert [Path(e.path).name for e in entries if not e.error] == ["f.pt"]


def test_self_referencing_and_broken_symlinks(tmp_path: Path) -> None:
    os.symlink("self.pt", tmp_path / "self.pt")
    os.symlink("missing.pt", tmp_path / "dangling.pt")
    errors = {Path(e.path).name: e.error for e in walk(str(tmp_path))}
    assert errors == {"self.pt": "cannot read: symlink loop", "dangling.pt": "cannot read: broken symlink"}


def test_fifo_is_skipped_not_opened(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe.pt")  # opening it for reading would block forever
    (tmp_path / "ok.pt").write_bytes(b"x")
    assert [Path(e.path).name for e in walk(str(tmp_path))] == ["ok.pt"]


def test_non_utf8_file_name_survives(tmp_path: Path) -> None:
    raw = os.fsencode(str(tmp_path)) + b"/lat\xe9nt\xff.pt"
    with open(raw, "wb") as f:
        f.write(b"x")
    (entry,) = walk(str(tmp_path))
    assert os.fsencode(entry.path) == raw
    assert entry.error is None


def test_missing_root_is_an_error_entry(tmp_path: Path) -> None:
    (entry,) = walk(str(tmp_path / "nope"))
    assert entry.error == "cannot read: vanished while scanning"


def test_unlistable_directory_is_reported(fs) -> None:
    """Permission denied needs a non-root user: pyfakefs emulates one."""
    from pyfakefs.helpers import set_uid

    from conftest import scan_paths

    fs.create_file("/cache/ok.pt", contents=b"")
    fs.create_file("/cache/locked/hidden.pt", contents=b"x")
    os.chmod("/cache/locked", 0o000)
    set_uid(1000)
    found = {(f.code, f.path, f.message) for f in scan_paths("/cache").findings}
    assert found == {("CD001", "/cache/locked", "cannot read: permission denied"),
                     ("CD102", "/cache/ok.pt", "empty file: 0 bytes where a cache entry should be")}


class _CountingListing:
    """os.scandir's iterator, counting the entries taken from it."""

    taken = 0

    def __init__(self, path: str) -> None:
        self._it = _real_scandir(path)

    def __enter__(self) -> _CountingListing:
        return self

    def __exit__(self, *exc: object) -> None:
        self._it.close()

    def __iter__(self) -> _CountingListing:
        return self

    def __next__(self) -> os.DirEntry:
        entry = next(self._it)
        _CountingListing.taken += 1
        return entry


_real_scandir = os.scandir


def test_a_flat_directory_streams_in_batches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch leaves as soon as it is cut: a flat cache of a million files is never held.
    Cuts fall where the names say, after `size` names and by 4 x size at the latest."""
    for i in range(2500):
        (tmp_path / f"{i:04d}.pt").write_bytes(b"")
    monkeypatch.setattr(os, "scandir", _CountingListing)
    _CountingListing.taken = 0
    walk_ = batches(str(tmp_path), size=100)
    first = next(walk_)
    assert 100 <= len(first.names) <= 400 and _CountingListing.taken == len(first.names)
    rest = list(walk_)
    assert all(100 <= len(b.names) <= 400 for b in rest[:-1]) and len(rest[-1].names) <= 400
    assert [b.part for b in (first, *rest)] == [b.names[-1] for b in (first, *rest[:-1])] + [""]
    names = [n for b in (first, *rest) for n in b.names]
    assert len(names) == len(set(names)) == 2500
    assert 2500 / (len(rest) + 1) < 250  # about 1.5 x size a batch (cut at 4 x size seldom)


def test_adding_or_removing_a_file_changes_one_batch_of_a_big_directory() -> None:
    """What lets the index keep a record per batch: the batches of an unchanged listing order
    are the same but for the one that holds the change."""
    names = [f"img_{i:05d}.npz" for i in range(3000)]
    before = [list(b.names) for b in _cut(names)]
    assert len(before) > 10
    for changed in ([*names[:1700], "new.npz", *names[1700:]], names[:1699] + names[1700:]):
        after = [list(b.names) for b in _cut(changed)]
        assert len([b for b in after if b not in before]) <= 2  # (a new cut splits one in two)
        assert len([b for b in before if b not in after]) == 1


def _cut(names: list[str]) -> list:
    """The batches of a directory listed in the order of `names` (os.scandir faked)."""
    class Listing:
        def __init__(self, path: str) -> None:
            self.entries = iter([_Entry(os.path.join(path, n), n) for n in names])

        def __enter__(self) -> Listing:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def __iter__(self) -> Listing:
            return self

        def __next__(self) -> _Entry:
            return next(self.entries)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "scandir", Listing)
        return list(batches("/", size=100, recursive=False))


class _Entry:
    def __init__(self, path: str, name: str) -> None:
        self.path, self.name = path, name

    def is_file(self) -> bool:
        return True

    def is_dir(self) -> bool:
        return False


def test_shards_split_by_path_whatever_the_listing_order(tmp_path: Path) -> None:
    """Every file is one rank's, and which rank's depends on its path under the root only."""
    rel = [f"{i:03d}.pt" for i in range(60)] + [f"bucket/{i:03d}.pt" for i in range(40)]
    for root, order in ((tmp_path / "a", rel), (tmp_path / "b", rel[::-1])):
        for name in order:
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_bytes(b"")

    def shares(root: Path) -> list[set[str]]:
        return [{os.path.relpath(e.path, root) for e in
                 (e for b in batches(str(root), shard=(rank, 3)) for e in b.entries())}
                for rank in range(3)]

    split = shares(tmp_path / "a")
    assert split == shares(tmp_path / "b")
    assert set().union(*split) == set(rel) and sum(map(len, split)) == len(rel)
    assert all(len(share) > 15 for share in split)  # 100 files over 3 ranks, by a hash


def test_a_target_behind_a_folder_we_may_not_enter_says_so(fs) -> None:
    """Not 'no such file': the file is there, the folder holding it is locked."""
    from pyfakefs.helpers import set_uid

    from cachedoctor.layouts import TargetError, resolve

    fs.create_file("/cache/locked/a.pt", contents=b"x")
    os.chmod("/cache/locked", 0o000)
    set_uid(1000)
    with pytest.raises(TargetError, match=r"^/cache/locked/a.pt: permission denied$"):
        resolve(["/cache/locked/a.pt"])
    with pytest.raises(TargetError, match=r"^/cache/nope: no such file or directory$"):
        resolve(["/cache/nope"])
