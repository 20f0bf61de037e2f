"""Every file rule fires on its defect, built by the real mechanism, and on nothing clean."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from cachedoctor.fixtures import BUILDERS, clean

from conftest import by_code, codes, scan_paths

# (code, builder options, --deep, codes that rightly fire with it)
CASES = [
    *[("CD101", {"how": how}, False, set()) for how in
      ("mid_entry", "before_directory", "gzip", "legacy", "safetensors", "npz", "zeroed")],
    ("CD102", {}, False, set()),
    ("CD103", {}, True, set()),
    *[("CD104", {"how": how}, False, set()) for how in ("atomicwrites", "dot_tmp", "lock")],
    *[("CD105", {"how": how}, False, set()) for how in
      ("zip", "gzip", "legacy", "tensor_attribute", "pkl2", "pkl0")],
    # an npz's object array is also CD101: a trainer's np.load (allow_pickle=False) refuses it
    ("CD105", {"how": "npz"}, False, {"CD101"}),
    ("CD106", {}, True, set()),
    ("CD106", {"container": "gzip"}, True, set()),
    ("CD107", {}, False, set()),
    *[("CD201", {"container": c}, False, set()) for c in ("zip", "gzip", "legacy")],
    ("CD201", {"key": "latents", "batch_size": 8}, False, set()),
    # a GPU-tagged file among CPU ones also makes the directory mixed (CD502)
    ("CD501", {}, False, {"CD502"}),
    ("CD501", {"location": "cuda:3"}, False, {"CD502"}),
    ("CD502", {}, False, {"CD501"}),
]


@pytest.mark.parametrize(("code", "options", "deep", "companions"), CASES,
                         ids=[f"{c}-{'-'.join(map(str, o.values())) or 'default'}" for c, o, _, _ in CASES])
def test_rule_fires_on_its_defect_and_only_there(code, options, deep, companions, cache: Path,
                                                 tmp_path: Path) -> None:
    clean.build(cache, n=4)
    if code == "CD105":
        options = {**options, "marker": tmp_path / "PAYLOAD_RAN"}
    defects = BUILDERS[code](cache, **options)
    report = scan_paths(cache, deep=deep)
    fired = by_code(report, code)
    assert sorted(f.path for f in fired) == sorted(str(p) for p in defects), report.findings
    assert codes(report) <= {code, *companions}, report.findings
    assert all(f.dataset == "cache" for f in fired)
    if code == "CD105":
        assert not (tmp_path / "PAYLOAD_RAN").exists()


def test_deep_rules_stay_silent_without_deep(cache: Path) -> None:
    BUILDERS["CD103"](cache)
    BUILDERS["CD106"](cache)
    assert scan_paths(cache).findings == ()
    assert codes(scan_paths(cache, deep=True)) == {"CD103", "CD106"}


@pytest.mark.parametrize("container", clean.FORMATS)
def test_clean_caches_have_no_findings(container: str, cache: Path) -> None:
    clean.build(cache, n=6, container=container)
    report = scan_paths(cache, deep=True)
    assert report.findings == ()
    assert report.files == 6


def test_clean_text_embeds_and_shared_storage_have_no_findings(cache: Path) -> None:
    clean.text_embeds(cache, n=3)
    clean.shared_storage(cache)
    clean.safetensors_latents(cache / "aitk", n=2)
    assert scan_paths(cache, deep=True).findings == ()


def test_cd201_message_names_ratio_and_waste(cache: Path) -> None:
    (path, *_rest) = BUILDERS["CD201"](cache, batch_size=8)
    (finding, *_) = [f for f in by_code(scan_paths(cache), "CD201") if f.path == str(path)]
    assert finding.details["ratio"] == 8.0
    assert finding.details["wasted_bytes"] == finding.details["stored_bytes"] * 7 // 8
    assert "(x8.0)" in finding.message and f"{finding.details['wasted_bytes']:,} B wasted" in finding.message


def test_cd201_thresholds_come_from_settings(cache: Path) -> None:
    BUILDERS["CD201"](cache, batch_size=4)
    assert by_code(scan_paths(cache), "CD201")
    assert not by_code(scan_paths(cache, settings={"CD201": {"min-ratio": 5}}), "CD201")


def test_cd502_across_files_names_the_directory(cache: Path) -> None:
    (tagged,) = BUILDERS["CD502"](cache, across_files=True, n=5)
    report = scan_paths(cache)
    (finding,) = by_code(report, "CD502")
    assert finding.path == str(cache)
    assert finding.details["files"] == [str(tagged)]
    assert finding.details["locations"] == {"cpu": 4, "cuda:0": 1}
    assert [f.path for f in by_code(report, "CD501")] == [str(tagged)]


def test_cd501_message_names_the_location(cache: Path) -> None:
    BUILDERS["CD501"](cache, location="cuda:3")
    (finding,) = scan_paths(cache).findings
    assert "cuda:3" in finding.message


def test_cd101_says_what_is_broken(cache: Path) -> None:
    BUILDERS["CD101"](cache / "a", how="mid_entry")
    BUILDERS["CD101"](cache / "b", how="safetensors")
    BUILDERS["CD101"](cache / "c", how="zeroed")
    messages = {Path(f.path).parent.name: f.message for f in scan_paths(cache).findings}
    assert "no zip central directory" in messages["a"]
    assert "incomplete metadata" in messages["b"]
    assert "zero" in messages["c"]


def test_recent_lock_is_a_live_writer_not_a_finding(cache: Path) -> None:
    BUILDERS["CD104"](cache, how="lock", age=5)
    assert scan_paths(cache).findings == ()


def test_an_empty_old_lock_file_is_filelocks_and_no_finding(cache: Path) -> None:
    """filelock (🤗 datasets, hub) releases with flock and leaves the empty file behind: held or
    not, it blocks nobody once its holder is gone. A real filelock, acquired and released."""
    filelock = pytest.importorskip("filelock")
    lock = cache / "cache-5b8e2f.arrow.lock"
    with filelock.FileLock(str(lock)):
        pass
    assert lock.exists() and lock.stat().st_size == 0
    os.utime(lock, (time.time() - 86400, time.time() - 86400))
    assert scan_paths(cache).findings == ()


def test_garbage_and_odd_names(cache: Path) -> None:
    (cache / "garbage.pt").write_bytes(os.urandom(4096))
    (cache / "notes.md").write_bytes(os.urandom(512))
    raw = os.fsencode(str(cache)) + b"/\xff\xfe latent.pt"
    with open(raw, "wb") as f:
        f.write(b"")
    found = {os.fsencode(f.path): f.code for f in scan_paths(cache).findings}
    assert found == {
        os.fsencode(str(cache / "garbage.pt")): "CD101",
        os.fsencode(str(cache / "notes.md")): "CD107",
        raw: "CD102",
    }


def test_unreadable_file_is_cd001(fs) -> None:
    from pyfakefs.helpers import set_uid

    fs.create_file("/cache/locked.pt", contents=b"PK\x03\x04")
    os.chmod("/cache/locked.pt", 0)
    set_uid(1000)
    (finding,) = scan_paths("/cache").findings
    assert (finding.code, finding.path, finding.message) == ("CD001", "/cache/locked.pt",
                                                             "cannot read: permission denied")


def test_a_file_rule_that_reads_a_name_says_so() -> None:
    """The engine hands a twin the verdict of the file whose facts it shares, except for the
    rules that declare `names=True`: a file rule reading `meta.path` (or its entry's path or
    mtime) other than to name its finding must declare it. (CD104 judges temp and lock files,
    never a latent or text file, whose verdicts alone are shared.)"""
    import ast
    import importlib

    from cachedoctor.checks import RULES

    unshared = {"CD104"}  # interrupted_write: temp and lock files, never twins
    for code, rule in RULES.items():
        if rule.check_file is None or rule.names or code in unshared:
            continue
        module = importlib.import_module(rule.check_file.__module__)
        tree = ast.parse(Path(module.__file__).read_text())
        named = {id(call.args[0]) for call in ast.walk(tree) if isinstance(call, ast.Call)
                 and isinstance(call.func, ast.Attribute) and call.func.attr == "finding"
                 and call.args}
        reads = [node.lineno for node in ast.walk(tree)
                 if isinstance(node, ast.Attribute) and node.attr in ("path", "mtime")
                 and isinstance(node.value, ast.Name) and node.value.id in ("meta", "entry")
                 and id(node) not in named]
        assert not reads, f"{code} reads a name at lines {reads} without names=True"
