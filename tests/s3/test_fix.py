"""`fix` and `undo` on S3: quarantine by copy, verify, delete; journal local and in the bucket;
an object changed since the plan is skipped; undo puts every object back byte for byte."""

from __future__ import annotations

import json
import re
from pathlib import Path

from s3_helpers import Bucket, s3_bucket, s3_server  # noqa: F401 (fixtures)

from cachedoctor.engine import scan
from cachedoctor.fixtures import BUILDERS
from cachedoctor.fixtures.clean import build as clean
from cachedoctor.options import ScanOptions
from cachedoctor.repair import remote
from cachedoctor.repair.caches import KEPT_SUFFIX
from cachedoctor.repair.journal import DONE, SKIPPED, Journal

from conftest import invoke

PREFIX = "cache/vae"


def _cache(s3: Bucket, tmp_path: Path) -> dict[str, bytes]:
    tree = tmp_path / "tree"
    clean(tree / "ok", n=3)
    BUILDERS["CD101"](tree / "torn")
    BUILDERS["CD105"](tree / "hostile", marker=tmp_path / "PAYLOAD_RAN")
    BUILDERS["CD201"](tree / "batch", batch_size=4)  # compact: not on S3, the plan says so
    s3.upload(tree, PREFIX)
    return {k: s3.get(k) for k in s3.keys(PREFIX)}


def _plan(s3: Bucket) -> remote.RemotePlan:
    url = s3.url(PREFIX)
    return remote.build_remote_plan(scan([url], ScanOptions(jobs=1)), (url,))


def test_fix_quarantines_by_copy_and_undo_restores(s3: Bucket, tmp_path: Path) -> None:
    before = _cache(s3, tmp_path)
    dry = invoke("fix", s3.url(PREFIX), "--dry-run")
    assert dry.exit_code == 0 and "Dry run: nothing changed." in dry.output, (  # why, if not
        dry.output, [(f.code, f.message) for f in scan([s3.url(PREFIX)], ScanOptions(jobs=1)).findings])
    assert "no automatic compact on S3" in dry.output  # said before anything changes
    assert {k: s3.get(k) for k in s3.keys(PREFIX)} == before
    done = invoke("fix", s3.url(PREFIX), "--yes")
    assert done.exit_code == 0, done.output
    run_id = re.search(r"Run (\S+): 2 object\(s\) quarantined, 0 skipped, 0 failed", done.output)[1]
    gone = {k for k in before if "/torn/" in k or "/hostile/" in k}
    assert len(gone) == 2 and not gone & set(s3.keys(PREFIX))
    quarantine = f"{PREFIX}/.cachedoctor/quarantine/{run_id}/"
    for key in gone:  # the originals, byte for byte, in the same bucket
        assert s3.get(quarantine + key[len(PREFIX) + 1:] + KEPT_SUFFIX) == before[key]
    mirror = json.loads(s3.get(f"{PREFIX}/.cachedoctor/journal/{run_id}.json"))
    assert mirror["state"] == DONE and {a["state"] for a in mirror["actions"]} == {DONE}
    with Journal.open(remote.local_root(s3.url(PREFIX))) as journal:  # the local journal
        assert [a.state for a in journal.actions(run_id)] == [DONE, DONE]
    rescanned = scan([s3.url(PREFIX)], ScanOptions(jobs=1))
    assert not {"CD101", "CD105"} & {f.code for f in rescanned.findings}
    undone = invoke("undo", run_id, "--cache", s3.url(PREFIX))
    assert undone.exit_code == 0, undone.output
    assert "2 object(s) restored, 0 left alone" in undone.output
    assert {k: s3.get(k) for k in s3.keys(PREFIX) if "/.cachedoctor/" not in k} == before
    assert not s3.keys(f"{PREFIX}/.cachedoctor/quarantine/")  # its copies removed once back
    assert json.loads(s3.get(f"{PREFIX}/.cachedoctor/journal/{run_id}.json"))["state"] == "undone"


def test_an_object_changed_since_the_plan_is_skipped(s3: Bucket, tmp_path: Path) -> None:
    _cache(s3, tmp_path)
    plan = _plan(s3)
    torn = next(a for a in plan.actions if "/torn/" in a.url)
    key = torn.url.split("/", 3)[3]
    s3.client.put_object(Bucket=s3.name, Key=key, Body=b"rewritten by the trainer meanwhile")
    result = remote.apply(plan)
    states = {a.url: (state, error) for a, state, error in result.outcomes}
    assert states[torn.url][0] == SKIPPED and "changed since the plan" in states[torn.url][1]
    assert s3.get(key) == b"rewritten by the trainer meanwhile"  # left alone
    assert not s3.keys(f"{PREFIX}/.cachedoctor/quarantine/{result.run_id}/torn")  # no stray copy
    assert [s for u, (s, _) in states.items() if u != torn.url] == [DONE]


def test_undo_leaves_a_key_taken_since_the_run(s3: Bucket, tmp_path: Path) -> None:
    before = _cache(s3, tmp_path)
    result = remote.apply(_plan(s3))
    taken = next(a.url for a, state, _ in result.outcomes if state == DONE and "/torn/" in a.url)
    key = taken.split("/", 3)[3]
    s3.client.put_object(Bucket=s3.name, Key=key, Body=b"a fresh entry the trainer wrote")
    undone = invoke("undo", result.run_id, "--cache", s3.url(PREFIX))
    assert undone.exit_code == 1 and "left alone" in undone.output
    assert s3.get(key) == b"a fresh entry the trainer wrote"
    hostile = next(k for k in before if "/hostile/" in k)
    assert s3.get(hostile) == before[hostile]  # the other object came back


def test_undo_from_the_bucket_mirror_alone(s3: Bucket, tmp_path: Path, monkeypatch) -> None:
    before = _cache(s3, tmp_path)
    result = remote.apply(_plan(s3))
    monkeypatch.setenv("CACHEDOCTOR_STATE_DIR", str(tmp_path / "another-machine"))
    monkeypatch.delenv("AWS_ENDPOINT_URL")  # the flag names the server instead
    undone = invoke("undo", result.run_id, "--cache", s3.url(PREFIX), "--endpoint-url", s3.endpoint)
    assert undone.exit_code == 0, undone.output
    assert {k: s3.get(k) for k in s3.keys(PREFIX) if "/.cachedoctor/" not in k} == before


def test_undo_leaves_a_quarantine_copy_changed_since_the_run(s3: Bucket, tmp_path: Path) -> None:
    """A quarantine copy that is no longer the object the run moved (rewritten in the bucket
    since, at the same size) is not copied back: the cache key stays empty, the copy stays."""
    before = _cache(s3, tmp_path)
    result = remote.apply(_plan(s3))
    torn = next(a.url for a, state, _ in result.outcomes if state == DONE and "/torn/" in a.url)
    key = torn.split("/", 3)[3]
    copy = f"{PREFIX}/.cachedoctor/quarantine/{result.run_id}/{key[len(PREFIX) + 1:]}{KEPT_SUFFIX}"
    forged = bytes(len(s3.get(copy)))
    s3.client.put_object(Bucket=s3.name, Key=copy, Body=forged)
    undone = invoke("undo", result.run_id, "--cache", s3.url(PREFIX))
    assert undone.exit_code == 1 and "not the object the run moved" in undone.output
    assert key not in s3.keys(PREFIX) and s3.get(copy) == forged
    hostile = next(k for k in before if "/hostile/" in k)
    assert s3.get(hostile) == before[hostile]  # the other object came back


def test_no_quarantine_copy_is_listed_by_extension_and_old_runs_are_undone(
        s3: Bucket, tmp_path: Path) -> None:
    """SimpleTuner's S3 backend lists the whole bucket and keeps every key by its extension
    (simpletuner/helpers/data_backend/aws.py list_files, bghira/SimpleTuner@bc8e6ab7): no copy
    the quarantine keeps ends with a cache extension. A run made before that naming (its journal
    names the bare key) is still put back."""
    before = _cache(s3, tmp_path)
    result = remote.apply(_plan(s3))
    kept = s3.keys(f"{PREFIX}/.cachedoctor/quarantine/")
    assert len(kept) == 2 and all(k.endswith(KEPT_SUFFIX) for k in kept)
    for k in kept:  # as a run made before KEPT_SUFFIX left them
        s3.client.copy_object(Bucket=s3.name, Key=k.removesuffix(KEPT_SUFFIX),
                              CopySource={"Bucket": s3.name, "Key": k})
        s3.client.delete_object(Bucket=s3.name, Key=k)
    with Journal.open(remote.local_root(s3.url(PREFIX))) as journal, journal.conn as db:
        for seq, relpath in db.execute("SELECT seq, relpath FROM actions WHERE run_id = ?",
                                       (result.run_id,)).fetchall():
            bare = f".cachedoctor/quarantine/{result.run_id}/".encode() + relpath
            db.execute("UPDATE actions SET quarantine = ? WHERE run_id = ? AND seq = ?",
                       (bare, result.run_id, seq))

    undone = invoke("undo", result.run_id, "--cache", s3.url(PREFIX))

    assert undone.exit_code == 0, undone.output
    assert {k: s3.get(k) for k in s3.keys(PREFIX) if "/.cachedoctor/" not in k} == before
