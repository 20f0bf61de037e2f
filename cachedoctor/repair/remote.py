"""`fix` and `undo` for caches in S3-compatible storage: quarantine by copy, verify, delete.

The plan is built as on disk (one action per object a finding's fix names) but S3 offers only
the quarantine: rewriting an object (compact, to-cpu) or encoding a new one (reencode) would
download it, change it and upload it again, which this version does not do; the plan lists such
findings as skipped before anything changes. Each action records the object's ETag and size at
planning time (a HEAD); applying it:

1. copies the object to `<root>/.cachedoctor/quarantine/<run>/<key under root>` in the same
   bucket, with `x-amz-copy-source-if-match: <planned ETag>`;
2. verifies the copy by a HEAD: its size, and its ETag where the planned one is a plain MD5
   (multipart ETags change on copy). A server that ignores the copy precondition (moto does)
   is caught here: a copy of another version is removed and the action skipped;
3. deletes the original with `If-Match: <planned ETag>`, after a HEAD that compares the ETag
   right before (for servers without conditional deletes). An object rewritten between that
   HEAD and the delete on a server that ignores If-Match is the residual race: its new
   version is deleted while the quarantine holds the old one (undo restores the old one).

An object that changed since the plan is skipped and reported, its copy removed. The journal is
the local one (journal.py's SQLite, under cachedoctor's state dir: `s3/<bucket>/<prefix>/`),
and a JSON mirror of the run is written to `<root>/.cachedoctor/journal/<run>.json` in the bucket
at the start and the end of the run and of its undo. `undo RUN --cache s3://bucket/prefix` copies
each quarantined object back (only where nothing has taken its key since), verifies the copy and
removes the quarantine copy. There is no lock across machines: two runs on one prefix at once
are kept apart only by the ETag preconditions.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TextIO

from cachedoctor import reclaim
from cachedoctor.findings import Report, printable
from cachedoctor.fix_kinds import QUARANTINE
from cachedoctor.inventory import STATE_DIR
from cachedoctor.remote import client as clients
from cachedoctor.remote import is_remote, join, split
from cachedoctor.repair.apply import new_run_id
from cachedoctor.repair.caches import KEPT_SUFFIX, QUARANTINE_DIR
from cachedoctor.repair.index import state_home
from cachedoctor.repair.journal import (
    CONFLICT,
    DONE,
    FAILED,
    PLANNED,
    SKIPPED,
    STARTED,
    UNDO_INCOMPLETE,
    UNDOING,
    UNDONE,
    Journal,
    Planned,
)
from cachedoctor.repair.plan import Note
from cachedoctor.units import human_bytes

COPY_LIMIT = 5 * 2**30  # one CopyObject request copies at most 5 GiB
KEY_LIMIT = 1024  # S3's longest key, in UTF-8 bytes
MIRROR_LIMIT = 64 * 2**20  # a journal mirror read from the bucket (~150 bytes an action)
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # what new_run_id makes, and a margin
NOT_ON_S3 = ("no automatic {fix} on S3 in this version (it would download, rewrite and upload "
             "the object): quarantine it by hand or rebuild it with the trainer")
CHANGED = "changed since the plan (ETag {now}, planned {planned}): left alone"


class RemoteFixError(Exception):
    """A run cannot start or be undone (no such run, an unreadable journal): exit 2."""


@dataclass(frozen=True)
class RemoteAction:
    url: str
    root: str  # the cache prefix whose .cachedoctor/ holds the quarantine and journal mirror
    codes: tuple[str, ...]
    size: int
    etag: str  # as planned: the run leaves the object alone if it differs

    @property
    def relkey(self) -> str:
        return self.url[len(self.root) + 1:]

    def quarantine(self, run_id: str, kept_suffix: str = KEPT_SUFFIX) -> str:
        """The key of the kept copy (KEPT_SUFFIX: SimpleTuner's S3 backend lists the whole
        bucket by extension; kept_suffix "" for a run made before it)."""
        return f"{self.root}/{STATE_DIR}/{QUARANTINE_DIR}/{run_id}/{self.relkey}{kept_suffix}"


@dataclass(frozen=True)
class RemotePlan:
    actions: tuple[RemoteAction, ...]
    notes: tuple[Note, ...] = ()
    left_out: tuple[Note, ...] = ()

    @property
    def quarantined_size(self) -> int:
        return sum(a.size for a in self.actions)


@dataclass
class RemoteRun:
    run_id: str
    outcomes: list[tuple[RemoteAction, str, str | None]] = field(default_factory=list)

    def count(self, state: str) -> int:
        return sum(1 for _, s, _ in self.outcomes if s == state)


def remote_roots(roots: Iterable[str]) -> bool:
    """Whether the fix is about S3 caches (all of them); a ValueError for a mix."""
    roots = tuple(roots)
    remote = [r for r in roots if is_remote(r)]
    if remote and len(remote) != len(roots):
        raise ValueError("fix s3:// caches apart from local ones (one run journals one kind)")
    return bool(remote)


def build_remote_plan(report: Report, roots: Iterable[str], *,
                      include_info: bool = False) -> RemotePlan:
    """One quarantine action per object a finding's fix names, with its ETag now (a HEAD)."""
    roots = tuple(r.rstrip("/") for r in roots)
    notes: list[Note] = []
    left_out: list[Note] = []
    wanted: dict[str, list[str]] = {}
    for finding in report.findings:
        if finding.fix is not None and not reclaim.acted_on(finding, include_info):
            left_out.append(Note(finding.code, finding.path, finding.message))
        elif finding.fix is None:
            notes.append(Note(finding.code, finding.path, finding.message,
                              finding.details.get("change")))
        elif finding.fix != QUARANTINE:
            notes.append(Note(finding.code, finding.path, NOT_ON_S3.format(fix=finding.fix), skipped=True))
        elif reclaim.young_temp(finding):
            notes.append(Note(finding.code, finding.path, "written in the last minutes: its writer may "
                              "still be running; stop it first", skipped=True))
        else:
            for path in finding.details.get("files") or [finding.path]:
                wanted.setdefault(str(path), []).append(finding.code)
    actions = []
    for url, codes in wanted.items():
        root = _root_of(url, roots)
        if root is None:
            notes.append(Note(codes[0], url, "outside the caches given", skipped=True))
            continue
        why = odd_key(url[len(root) + 1:])
        if why is not None:
            notes.append(Note(codes[0], url, why, skipped=True))
            continue
        try:
            head = _head(url)
        except OSError as exc:
            notes.append(Note(codes[0], url, str(exc), skipped=True))
            continue
        if head is None:
            notes.append(Note(codes[0], url, "gone since the scan", skipped=True))
            continue
        size, etag = head
        if size > COPY_LIMIT:
            notes.append(Note(codes[0], url, "larger than 5 GiB: S3 copies it only in parts, "
                              "which this version does not do", skipped=True))
            continue
        actions.append(RemoteAction(url, root, tuple(sorted(set(codes))), size, etag))
    actions.sort(key=lambda a: a.url)
    return RemotePlan(tuple(actions), tuple(notes), tuple(left_out))


def odd_key(relkey: str) -> str | None:
    """Why an object's key under its cache prefix is not acted on, or None. A `.` or `..` part
    names one object to S3 and another to a server or proxy that resolves them (the copy or
    delete could land outside the prefix); a part named `.cachedoctor` is our own state."""
    parts = relkey.split("/")
    if any(p in (".", "..") for p in parts):
        return "its key has '.' or '..' parts, which some servers resolve to another object: left alone"
    if STATE_DIR in parts:
        return f"its key is inside a {STATE_DIR}/ folder, cachedoctor's own state: left alone"
    if len(relkey.encode("utf-8", "surrogatepass")) > KEY_LIMIT:
        return f"its key is longer than S3's {KEY_LIMIT} bytes: left alone"
    return None


def _root_of(url: str, roots: tuple[str, ...]) -> str | None:
    best = None
    for root in roots:
        if url.startswith(root + "/") and (best is None or len(root) > len(best)):
            best = root
        elif url == root:  # a single object given as the target: its "folder" holds the state
            parent = url.rpartition("/")[0]
            if parent.count("/") >= 2 and (best is None or len(parent) > len(best)):
                best = parent
    return best


def _head(url: str) -> tuple[int, str] | None:
    """(size, ETag) of the object now, None when there is none; OSError when it cannot be read."""
    bucket, key = split(url)
    try:
        reply = clients.client(bucket).head_object(Bucket=bucket, Key=key)
    except clients.MissingClient:
        raise
    except Exception as exc:
        if _code(exc) in ("404", "NoSuchKey", "NotFound"):
            return None
        raise OSError(clients.describe(exc)) from None
    return int(reply.get("ContentLength", 0)), str(reply.get("ETag", ""))


def _code(exc: BaseException) -> str:
    response = getattr(exc, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


# -- the journal: local SQLite, mirrored as JSON in the bucket ------------------------------------


def local_root(root: str) -> str:
    """Where the local journal of the S3 cache `root` lives (cachedoctor's state dir)."""
    bucket, prefix = split(root)
    folder = os.path.join(str(state_home()), "s3", bucket, *[p for p in prefix.split("/") if p not in ("", ".", "..")])
    os.makedirs(folder, exist_ok=True)
    return folder


def _mirror(journal: Journal, root: str, run_id: str, actions: list[RemoteAction]) -> str | None:
    """The run as JSON at `<root>/.cachedoctor/journal/<run>.json`; a warning when it fails."""
    record = journal.run(run_id)
    states = {a.seq: a for a in journal.actions(run_id)}
    body = {"run_id": run_id, "state": record.state if record else None,
            "started": record.started if record else None,
            "finished": record.finished if record else None, "root": root,
            "local_journal": journal.path,
            "actions": [{"seq": n, "action": QUARANTINE, "object": a.url,
                         "quarantine": a.quarantine(run_id), "codes": list(a.codes), "size": a.size,
                         "etag": a.etag, "state": states[n].state if n in states else PLANNED,
                         "error": states[n].error if n in states else None}
                        for n, a in enumerate(actions)]}
    bucket, prefix = split(root)
    key = f"{prefix}/{STATE_DIR}/journal/{run_id}.json".lstrip("/")
    try:
        clients.client(bucket).put_object(Bucket=bucket, Key=key, Body=json.dumps(body, indent=1).encode(),
                                          ContentType="application/json")
    except Exception as exc:
        return f"cannot write the journal mirror s3://{bucket}/{key}: {clients.describe(exc)}"
    return None


def _read_mirror(root: str, run_id: str) -> dict | None:
    """The bucket's mirror of run `run_id`, None when there is none; a RemoteFixError when it
    cannot be read or is no JSON object. Anyone who may write to the bucket may have written
    it: its rows are checked one by one (_mirror_rows) before undo acts on any."""
    bucket, prefix = split(root)
    url = join(bucket, f"{prefix}/{STATE_DIR}/journal/{run_id}.json")
    try:
        raw = clients.read_object(url, MIRROR_LIMIT)
    except OSError as exc:
        raise RemoteFixError(f"cannot read the journal mirror {url}: {printable(str(exc))}") from None
    if raw is None:
        return None
    try:
        mirror = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: JSON nested thousands deep
        mirror = None
    if not isinstance(mirror, dict) or not isinstance(mirror.get("actions"), list):
        raise RemoteFixError(f"{url} is no journal mirror cachedoctor writes: nothing undone")
    return mirror


Row = tuple[int, str, str, int, str]  # (seq, object, quarantine, size, etag)


def _mirror_rows(mirror: dict, root: str, run_id: str) -> tuple[list[Row], list[tuple[str, str]]]:
    """The done actions of a mirror as undo rows, and (where, why) for each row refused: the
    object must be a key under `root` that the fix could have planned, and its quarantine copy
    the one that run made of it (the mirror's `quarantine` field is never used as written)."""
    rows: list[Row] = []
    refused: list[tuple[str, str]] = []
    mirror_url = f"{root}/{STATE_DIR}/journal/{run_id}.json"
    for n, item in enumerate(mirror["actions"]):
        if not isinstance(item, dict) or item.get("state") != DONE:
            continue
        url, seq, size, etag = item.get("object"), item.get("seq"), item.get("size"), item.get("etag")
        where = f"{mirror_url} (action {n})"
        if not (isinstance(url, str) and isinstance(seq, int) and isinstance(size, int)
                and isinstance(etag, str)) or isinstance(seq, bool) or isinstance(size, bool) \
                or size < 0:
            refused.append((where, "not an action cachedoctor writes (its fields have the wrong "
                                   "types): left alone"))
            continue
        if not url.startswith(root + "/"):
            refused.append((where, "names an object outside the cache prefix: left alone"))
            continue
        why = odd_key(url[len(root) + 1:])
        if why is not None:
            refused.append((where, why.replace("its key", "the object's key")))
            continue
        action = RemoteAction(url, root, (), size, etag)
        # today's name, or the bare one of a run made before KEPT_SUFFIX: nothing else
        quarantine = next((q for q in (action.quarantine(run_id), action.quarantine(run_id, ""))
                           if item.get("quarantine") == q), None)
        if quarantine is None:
            refused.append((where, f"names a quarantine copy other than {STATE_DIR}/{QUARANTINE_DIR}/"
                                   f"{run_id}/ under the prefix: left alone"))
            continue
        rows.append((seq, url, quarantine, size, etag))
    return rows, refused


# -- apply ----------------------------------------------------------------------------------------


def apply(plan: RemotePlan, *, command: str = "", run_id: str | None = None,
          warn=lambda line: None) -> RemoteRun:
    """Run the plan: each action journaled before it changes anything (see the module doc)."""
    run_id = run_id or new_run_id()
    result = RemoteRun(run_id)
    by_root: dict[str, list[RemoteAction]] = {}
    for action in plan.actions:
        by_root.setdefault(action.root, []).append(action)
    for root, actions in by_root.items():
        with Journal.open(local_root(root)) as journal:
            journal.begin_run(run_id, [Planned(n, QUARANTINE, a.relkey, a.codes) for n, a in enumerate(actions)],
                              command)
            for problem in (_mirror(journal, root, run_id, actions),):
                if problem:
                    warn(problem)
            failed = False
            for n, action in enumerate(actions):
                journal.update(run_id, n, STARTED, size_before=action.size, sha_before=action.etag)
                state, error = _quarantine(action, run_id)
                failed |= state == FAILED
                journal.update(run_id, n, state, **({"error": error} if error else {}))
                result.outcomes.append((action, state, error))
            journal.set_run_state(run_id, FAILED if failed else DONE)
            problem = _mirror(journal, root, run_id, actions)
            if problem:
                warn(problem)
    return result


def _quarantine(action: RemoteAction, run_id: str) -> tuple[str, str | None]:
    bucket, key = split(action.url)
    qbucket, qkey = split(action.quarantine(run_id))
    s3 = clients.client(bucket)
    try:
        try:
            s3.copy_object(Bucket=qbucket, Key=qkey, CopySource={"Bucket": bucket, "Key": key},
                           CopySourceIfMatch=action.etag, MetadataDirective="COPY")
        except Exception as exc:
            if _code(exc) in ("PreconditionFailed", "412"):
                now = _head(action.url)
                return SKIPPED, CHANGED.format(now=now[1] if now else "none", planned=action.etag)
            if _code(exc) in ("NoSuchKey", "404"):
                return SKIPPED, "gone since the plan: left alone"
            raise
        copy = _head(action.quarantine(run_id))
        if copy is None or copy[0] != action.size or (_plain(action.etag) and copy[1] != action.etag):
            # the source changed before the copy (a server that ignores the copy precondition)
            _delete(s3, qbucket, qkey, copy[1] if copy else None)
            now = _head(action.url)
            return SKIPPED, CHANGED.format(now=now[1] if now else "none", planned=action.etag)
        now = _head(action.url)  # for servers without conditional deletes: compare right before
        if now is None or now[1] != action.etag:
            _delete(s3, qbucket, qkey, copy[1])
            return SKIPPED, CHANGED.format(now=now[1] if now else "none", planned=action.etag)
        try:
            s3.delete_object(Bucket=bucket, Key=key, IfMatch=action.etag)
        except Exception as exc:
            if _code(exc) in ("PreconditionFailed", "412"):
                _delete(s3, qbucket, qkey, copy[1])
                return SKIPPED, CHANGED.format(now="changed", planned=action.etag)
            if _code(exc) not in ("NotImplemented", "501", "InvalidArgument"):
                raise
            s3.delete_object(Bucket=bucket, Key=key)  # no conditional deletes: the HEAD above decided
    except clients.MissingClient:
        raise
    except Exception as exc:
        return FAILED, clients.describe(exc).removeprefix("cannot read: ")
    return DONE, None


def _plain(etag: str) -> bool:
    """A single-part object's ETag (its MD5), which a copy keeps; a multipart one's does not."""
    return "-" not in etag


def _delete(s3, bucket: str, key: str, etag: str | None) -> None:
    # a copy of ours that failed to go stays in our own quarantine prefix, never in the cache
    with contextlib.suppress(Exception):
        s3.delete_object(Bucket=bucket, Key=key, **({"IfMatch": etag} if etag else {}))


# -- undo -----------------------------------------------------------------------------------------


def undo(run_id: str | None, root: str, *, warn=lambda line: None) -> RemoteRun:
    """Put back every object run `run_id` (default: the latest not undone) quarantined in the
    S3 cache `root`, from the local journal, else the bucket's mirror of it."""
    root = root.rstrip("/")
    if run_id is not None and not RUN_ID.fullmatch(run_id):
        raise RemoteFixError(f"{printable(run_id)!r} is no run id cachedoctor writes "
                             "(like 20250101T120000Z-1a2b)")
    folder = local_root(root)
    journal = Journal.existing(folder)
    rows: list[Row] = []
    refused: list[tuple[str, str]] = []
    if journal is not None:
        with journal:
            runs = [r for r in journal.runs() if r.state not in (UNDONE,)]
            chosen = run_id or (runs[-1].run_id if runs else None)
            if chosen is None or journal.run(chosen) is None:
                journal = None
            else:
                run_id = chosen
                for a in journal.actions(chosen):
                    if a.state == DONE:
                        url = f"{root}/{a.relpath}"
                        action = RemoteAction(url, root, a.codes, a.size_before or 0, a.sha_before or "")
                        rows.append((a.seq, url, action.quarantine(chosen, a.kept_suffix), action.size,
                                     action.etag))
    if journal is None:
        if run_id is None:
            raise RemoteFixError(f"no run to undo in {root} (give RUN_ID: its journal mirror is "
                                 f"{root}/{STATE_DIR}/journal/RUN_ID.json)")
        mirror = _read_mirror(root, run_id)
        if mirror is None:
            raise RemoteFixError(f"no run {run_id} in {root}: no local journal, nor "
                                 f"{root}/{STATE_DIR}/journal/{run_id}.json")
        rows, refused = _mirror_rows(mirror, root, run_id)
    result = RemoteRun(run_id)
    for where, why in refused:
        result.outcomes.append((RemoteAction(where, root, (), 0, ""), CONFLICT, why))
    with Journal.open(folder) as journal:
        known = journal.run(run_id) is not None
        if known:
            journal.set_run_state(run_id, UNDOING)
        conflicts = 0
        for seq, url, quarantine, size, etag in reversed(rows):
            state, error = _restore(url, quarantine, size, etag)
            conflicts += state != UNDONE
            if known:
                journal.update(run_id, seq, state, **({"error": error} if error else {}))
            result.outcomes.append((RemoteAction(url, root, (), size, etag), state, error))
        if known:
            journal.set_run_state(run_id, UNDO_INCOMPLETE if conflicts else UNDONE)
            actions = [RemoteAction(f"{root}/{a.relpath}", root, a.codes, a.size_before or 0,
                                    a.sha_before or "") for a in journal.actions(run_id)]
            problem = _mirror(journal, root, run_id, actions)
            if problem:
                warn(problem)
    return result


def _restore(url: str, quarantine: str, size: int, etag: str) -> tuple[str, str | None]:
    bucket, key = split(url)
    qbucket, qkey = split(quarantine)
    s3 = clients.client(bucket)
    try:
        if _head(url) is not None:
            return CONFLICT, "an object has taken its key since the run: left alone"
        held = _head(quarantine)
        if held is None:
            return CONFLICT, "its quarantine copy is gone (purged?)"
        # checked before the copy: a copy back that fails the check after it would leave
        # another object at the cache key (a single-part object's copy keeps its MD5 ETag)
        if held[0] != size or (_plain(etag) and held[1] != etag):
            return CONFLICT, ("its quarantine copy is not the object the run moved (changed "
                              "since): left alone")
        s3.copy_object(Bucket=bucket, Key=key, CopySource={"Bucket": qbucket, "Key": qkey},
                       CopySourceIfMatch=held[1], IfNoneMatch="*", MetadataDirective="COPY")
        back = _head(url)
        if back is None or back[0] != size or (_plain(etag) and back[1] != etag):
            return CONFLICT, "the copy back does not match the original: quarantine copy kept"
        _delete(s3, qbucket, qkey, held[1])
    except clients.MissingClient:
        raise
    except Exception as exc:
        if _code(exc) in ("PreconditionFailed", "412"):
            return CONFLICT, "an object has taken its key since the run: left alone"
        return CONFLICT, clients.describe(exc).removeprefix("cannot read: ")
    return UNDONE, None


# -- text -----------------------------------------------------------------------------------------


def render_plan(plan: RemotePlan, out: TextIO, *, verbose: bool = False) -> None:
    if plan.actions:
        out.write(f"Plan: {len(plan.actions)} action{'s' * (len(plan.actions) != 1)} on S3: copies "
                  f"{human_bytes(plan.quarantined_size)} of objects to the quarantine, then deletes "
                  "the originals\n")
        for action in plan.actions if verbose else plan.actions[:10]:
            out.write(f"      {','.join(action.codes):<12} {printable(action.url)}\n")
        if not verbose and len(plan.actions) > 10:
            out.write(f"      ... and {len(plan.actions) - 10} more (--verbose lists them)\n")
    skipped = [n for n in plan.notes if n.skipped]
    if skipped:
        out.write(f"Skipped: {len(skipped)} finding{'s' * (len(skipped) != 1)}, nothing changes for them\n")
        for note in skipped if verbose else skipped[:10]:
            out.write(f"      {note.code:<12} {printable(note.path)}: {printable(note.message)}\n")
    manual = [n for n in plan.notes if not n.skipped]
    if manual:
        out.write(f"Manual: {len(manual)} finding{'s' * (len(manual) != 1)} without an automatic fix\n")
    if plan.left_out:
        out.write(f"Left out: {len(plan.left_out)} info finding(s) (--include-info acts on them)\n")


def render_run(run: RemoteRun, out: TextIO, undoing: bool = False) -> None:
    if undoing:
        out.write(f"Undo of run {run.run_id}: {run.count(UNDONE)} object(s) restored, "
                  f"{run.count(CONFLICT)} left alone\n")
    else:
        out.write(f"Run {run.run_id}: {run.count(DONE)} object(s) quarantined, {run.count(SKIPPED)} "
                  f"skipped, {run.count(FAILED)} failed (undo: cachedoctor undo {run.run_id} "
                  f"--cache {run.outcomes[0][0].root if run.outcomes else 's3://…'})\n")
    for action, state, error in run.outcomes:
        if error:
            out.write(f"  {state:<10} {printable(action.url)}: {printable(error)}\n")

