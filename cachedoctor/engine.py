"""Run a scan: walk the layouts, read files in a process pool, run the rules, build a Report.

Files stream through the pool in chunks; a worker returns only findings, counts, compact
summaries and coverage rows, so memory does not grow with the number of clean files
(summaries and coverage spill to disk, see summary.py). Every dataset's cache dirs are walked
as area "cache" and its image dirs as area "images" (images are only stat'ed, for coverage);
a dataset's Naming (from its layout) gives each file its coverage key, bucket and expected
latent size in the worker. Layout rules run once over the configs, dataset rules once the
files are read.

No input aborts a run: a reader or a rule that raises gives its file (dataset, config) a CD002
finding and the others go on, and a worker that dies costs only the file it died on (_pooled).
A read that never returns (a dead network mount, a FUSE filesystem that stopped answering)
costs only its file too: each worker marks in shared memory the file it is on and since when
(_Watch), and a file still unfinished after STALL_SECONDS gets a CD002 finding and its worker
is killed; it is never read again (_pooled, _isolated).
The workers are forked from a single-threaded caller (the command line), and by a helper
process from a threaded one (a training script): pool_start.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import os
import pickle
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from cachedoctor import index, sharded
from cachedoctor.checks import RULES
from cachedoctor.checks import checker_error as crash
from cachedoctor.findings import Finding, Report
from cachedoctor.formats import UNREADABLE, describe_os_error, read_path
from cachedoctor.formats.meta import EMPTY, IMAGE, UNKNOWN, FileMeta
from cachedoctor.formats.zip_templates import Templates
from cachedoctor.inventory import IMAGE as IMAGE_ROLE
from cachedoctor.inventory import LATENT, OTHER, TEXT, Batch, Entry, batches
from cachedoctor.layouts import Dataset, Layout, resolve
from cachedoctor.layouts.base import ANY_DEVICE, FOLDERS, DirectoryNaming
from cachedoctor.options import ScanOptions
from cachedoctor.remote import SCHEME as REMOTE
from cachedoctor.remote import is_remote
from cachedoctor.rule import Rule, RuleContext
from cachedoctor.summary import (
    CACHE_SIDE,
    IMAGE_SIDE,
    LISTED_SIDE,
    Content,
    CoverageRow,
    FileSummary,
    SummaryStore,
    content,
    encode,
    summarize,
)

BATCH = 1024  # files per task sent to a worker (256: 15% slower on two cores, more hand-offs)
IN_PROCESS_BATCHES = 3  # fewer batches than this are read without starting a pool
STALL_SECONDS = 300.0  # a file whose read has not finished by then is reported, not waited for


@dataclass(frozen=True)
class ChunkResult:
    """What a worker sends back for one batch of files."""

    files: int
    bytes: int
    findings: list[Finding]
    summaries: list[tuple[str, bytes]]  # (dataset, blob) rows of a SummaryStore
    paths: list[str]  # every file checked, when ScanOptions.keep_paths
    coverage: list[CoverageRow]
    records: index.Records | None = None  # each file's verdict, for the index (options.index)


def selected_rules(options: ScanOptions) -> list[Rule]:
    return [r for code, r in RULES.items() if options.enabled(code) and (options.deep or not r.deep)]


def read_entry(entry: Entry, deep: bool, templates: Templates | None = None) -> FileMeta:
    """The FileMeta of one entry (with the scan's zip `templates`). Raises only when a reader
    has a bug (which the caller makes a CD002 finding of): what is wrong with the file itself
    is in the FileMeta."""
    if entry.error:
        return FileMeta(entry.path, 0, UNREADABLE, errors=(entry.error,))
    if entry.path.startswith(REMOTE):  # an S3 object: its windows came with its batch (prefetch)
        from cachedoctor.remote import reader

        return reader.read_entry(entry, deep)
    # Images are never cache files, and in an image dir only cache files are worth reading
    # (captions, bucket JSONs and the like are the trainer's): their stat is all we need.
    if entry.role == IMAGE_ROLE or (entry.area == "images" and entry.role not in (LATENT, TEXT)):
        try:
            st = os.stat(entry.path)
        except OSError as exc:
            return FileMeta(entry.path, 0, UNREADABLE, errors=(describe_os_error(exc),))
        fmt = IMAGE if entry.role == IMAGE_ROLE else (EMPTY if st.st_size == 0 else UNKNOWN)
        return FileMeta(entry.path, st.st_size, fmt, mtime=st.st_mtime,
                        stat=(st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev, st.st_ctime_ns))
    return read_path(entry.path, deep=deep, templates=templates)


# What the file rules and summarize() made of a file whose facts later files share (FileMeta
# .same_as), per role, area and dataset: those files get the same verdict, re-addressed,
# instead of running every rule again. Rules may look at a latent's or text file's facts and
# its entry, never its path or mtime (rule.py); other roles (temp files, images) always run.
class _Verdict(NamedTuple):
    same: FileMeta  # the file whose facts these are (held, so its id stays its own)
    findings: list[Finding]
    content: Content | None
    own: list  # the checks that read a file's name and may fire on these facts (Rule.applies)


MAX_VERDICTS = 1024
SHARED_ROLES = (LATENT, TEXT)


@dataclass
class ScanState:
    """One scan's settings and what it learns while it reads: the zip templates and the
    verdicts of files whose facts later files share. check_files makes one per scan, and each
    worker process its own at start-up from the same settings (_init_worker), so two scans in
    one process, in threads or one after another, never see each other's."""

    options: ScanOptions
    rules: list[Rule]
    datasets: Mapping[str, Dataset]
    templates: Templates = dataclasses.field(default_factory=Templates)
    verdicts: dict[tuple, _Verdict] = dataclasses.field(default_factory=dict)
    scopes: Callable[[Batch], str] | None = None  # the index's scope stamps, made on first use
    recorder: index.Recorder = dataclasses.field(default_factory=index.Recorder)

    def scope(self, batch: Batch) -> str:
        if self.scopes is None:
            self.scopes = index.scope_stamps(self.options, self.rules, self.datasets)
        return self.scopes(batch)


def check_batch(batch: Batch, state: ScanState) -> ChunkResult:
    """Read and check the files of one batch (in a worker process, or in-process)."""
    options = state.options
    # The cyclic GC would run dozens of times per batch over objects that form no cycles
    # (about 10% of the scan); it runs again after the batch, so cycles a hostile pickle
    # builds are still freed, one batch at a time.
    collecting = gc.isenabled()
    gc.disable()
    remote = is_remote(batch.directory)
    try:
        if remote:  # every object's bytes fetched at once, many requests in flight
            from cachedoctor.remote import reader

            reader.prefetch(batch, batch.entries(options.exclude))
        return _check_batch(batch, state)
    except Exception as exc:  # outside any one file (the batch's naming): every file is unjudged
        entries = list(batch.entries(options.exclude))
        return ChunkResult(len(entries), 0, [crash.failed(e.path, "preparing its directory", exc,
                                                          e.dataset) for e in entries],
                           [], [e.path for e in entries] if options.keep_paths else [], [])
    finally:
        if _progress is not None:
            _progress(None)
        if remote:
            reader.forget()
        if collecting:
            gc.enable()


def _check_batch(batch: Batch, state: ScanState) -> ChunkResult:
    findings: list[Finding] = []
    summaries = []
    paths: list[str] = []
    coverage: list[CoverageRow] = []
    nbytes = files = 0
    options, datasets, verdicts, templates = (state.options, state.datasets, state.verdicts,
                                              state.templates)
    scope = state.scope(batch) if options.index else ""
    folder = os.fsencode(batch.directory) if scope else b""
    # a twin takes the verdict of the `shared` checks; the checks that read a file's name
    # (Rule.names) judge every file themselves
    shared = [(r.code, r.check_file) for r in state.rules if r.check_file and not r.names]
    named = [r for r in state.rules if r.check_file and r.names]
    own = [(r.code, r.check_file) for r in named]
    checks = shared + own
    deep, settings = options.deep, options.settings
    dataset = datasets.get(batch.dataset) if datasets and batch.dataset is not None else None
    naming = (dataset.naming if dataset else FOLDERS).directory(batch.directory, batch.bucket,
                                                                batch.area)
    if dataset is not None and naming.expected_device not in (None, dataset.expected_device):
        dataset = dataclasses.replace(dataset, expected_device=naming.expected_device)
    key = batch.dataset or ""
    cut = len(batch.directory) + 1
    beside: bool | None = None  # whether images belong in this cache folder: asked once
    recorded = state.recorder.files.append  # (index.Recorder.files says what each holds)
    roles = index.recorded_roles(batch.area) if scope else ()
    # (asked per latent only of a naming whose facts may come from another file)
    own_facts = type(naming).facts_of_its_own is DirectoryNaming.facts_of_its_own
    progress = _progress
    for entry, given in sharded.expand(batch.entries(options.exclude), deep, batch.directory):
        if progress is not None:
            progress(entry.path)
        files += 1
        found_before = len(findings)
        # recorded with the stat its reader took before reading: a later change shows next scan
        record = entry.role in roles and given is None and (
            own_facts or entry.role != LATENT or naming.facts_of_its_own(entry.path[cut:]))
        if entry.area == "cache" and entry.role not in (LATENT, TEXT):
            if beside is None:
                beside = naming.images_belong()
            if beside:
                entry = entry._replace(area="images")
        if options.keep_paths:
            paths.append(entry.path)
        # A reader or rule that raises costs that file a CD002 finding, never the scan.
        try:
            meta = given if given is not None else read_entry(entry, deep, templates)
        except Exception as exc:
            findings.append(crash.failed(entry.path, "reading it", exc, entry.dataset))
            meta = FileMeta(entry.path, 0, UNREADABLE, errors=("not read",))
            crashed = True
        else:
            crashed = False
        nbytes += meta.size
        same = meta.same_as
        verdict = None
        if crashed:
            pass  # its CD002 is its verdict: the rules would only judge the stand-in FileMeta
        elif same is not None and entry.role in SHARED_ROLES:
            # (the device the folder's trainer loads to may differ between the dataset's folders)
            seen = (id(same), meta.compression, entry.role, entry.area, entry.dataset, entry.bucket,
                    dataset.expected_device if dataset is not None else None)
            verdict = verdicts.get(seen)
            if verdict is None or verdict.same is not same:
                verdict = _Verdict(same, _run(shared, meta, entry, deep, settings, dataset),
                                   _content(entry.role, meta),
                                   _applying(named, meta, entry, deep, settings, dataset))
                if len(verdicts) >= MAX_VERDICTS:
                    verdicts.clear()
                verdicts[seen] = verdict
            for found in verdict.findings:
                findings.append(found if found.path == meta.path
                                else dataclasses.replace(found, path=meta.path))
            if verdict.own:
                findings.extend(_run(verdict.own, meta, entry, deep, settings, dataset))
        else:
            findings.extend(_run(checks, meta, entry, deep, settings, dataset))
        if len(findings) > found_before and meta.stat is not None and not crashed:
            # the stat the reader took: what a repair of this file checks it against
            findings[found_before:] = [dataclasses.replace(f, stat=meta.stat) if f.path == entry.path
                                       else f for f in findings[found_before:]]
        try:
            row, summary = _place(entry, meta, naming, cut, key, verdict)
        except Exception as exc:
            findings.append(crash.failed(entry.path, "summarizing it", exc, entry.dataset))
            continue
        if row is not None:
            coverage.append(row)
        if summary is not None:
            summaries.append(summary)
        if record and meta.stat is not None and not crashed and meta.format != UNREADABLE:
            # (an I/O error may pass: not recorded)
            recorded((entry.path[cut:], meta.stat, meta.size, summary, row, found_before,
                      len(findings), entry.path))
    return ChunkResult(files, nbytes, findings, _encode(batch.dataset, summaries, findings),
                       paths, coverage,
                       state.recorder.take(folder, batch.names, files, scope, findings,
                                           None if batch.part is None else
                                           index.chunk_key(folder, batch.part, options.shard))
                       if scope else None)


def _place(entry: Entry, meta: FileMeta, naming, cut: int, key: str,
           verdict: _Verdict | None) -> tuple[CoverageRow | None, FileSummary | None]:
    """A file's coverage row (the image or cache entry it is) and its summary for the dataset
    rules."""
    facts = row = None
    if entry.error is None:
        if entry.role == IMAGE_ROLE or (naming.source_suffixes and entry.role == OTHER and
                                        entry.path.lower().endswith(naming.source_suffixes)):
            image = naming.image(entry.path[cut:])
            if image is not None:
                row = CoverageRow(key, IMAGE_SIDE, image[0], entry.path, meta.mtime, int(image[1]), None)
        elif entry.role == LATENT:
            facts = naming.cache(entry.path[cut:], meta)
            if facts.key is not None:
                row = CoverageRow(key, CACHE_SIDE, facts.key, entry.path, meta.mtime, 0, facts.naming)
    summary = summarize(entry, meta, facts, verdict.content if verdict else None, naming.group)
    if summary is not None and naming.expected_device == ANY_DEVICE and summary.locations:
        # a loader that maps every tensor to its device makes where one was saved irrelevant
        summary = summary._replace(locations=())
    return row, summary


def _encode(dataset: str | None, summaries: list[FileSummary],
            findings: list[Finding]) -> list[tuple[str, bytes]]:
    """The batch's summaries as one blob; if that fails, the summary that fails it is left out
    (with a CD002 finding for its file) and the others still go."""
    if not summaries:
        return []
    try:
        return [encode(dataset, summaries)]
    except Exception:
        kept = []
        for summary in summaries:
            try:
                encode(dataset, [summary])
            except Exception as exc:
                findings.append(crash.failed(summary[0], "summarizing it", exc, dataset))
            else:
                kept.append(summary)
        return [encode(dataset, kept)] if kept else []


def _content(role: str, meta: FileMeta) -> Content | None:
    try:
        return content(role, meta)
    except Exception:  # summarize() meets the same failure, and reports it
        return None


def _applying(named: list[Rule], meta: FileMeta, entry: Entry, deep: bool, settings: Mapping,
              dataset: Dataset | None) -> list:
    """The (code, check) of the rules in `named` (names=True) that may fire on a file with
    `meta`'s facts: all but those whose `applies` says none can. One that raises is kept (its
    check_file then reports the bug, file by file)."""
    ctx = RuleContext(deep, entry.dataset, settings, entry, dataset)
    kept = []
    for rule in named:
        try:
            skip = rule.applies is not None and not rule.applies(meta, ctx)
        except Exception:
            skip = False
        if not skip:
            kept.append((rule.code, rule.check_file))
    return kept


def _run(checks: list, meta: FileMeta, entry: Entry, deep: bool, settings: Mapping,
         dataset: Dataset | None) -> list[Finding]:
    ctx = RuleContext(deep, entry.dataset, settings, entry, dataset)
    found = []
    for code, check in checks:
        try:
            finding = check(meta, ctx)
        except Exception as exc:  # one rule's bug: the other rules still judge the file
            finding = crash.failed(meta.path, f"running {code}", exc, entry.dataset)
        if finding is not None:
            found.append(finding)
    return found


# The pool's workers get the options and datasets once, at start-up, not with every batch
# (forked, they inherit them; started afresh, they unpickle them), and make the worker's
# ScanState of them.
# A worker process serves one scan's pool only: this is that scan's state, not the module's.
_worker_state: ScanState | None = None
# A pool worker's mark of the file it starts (None: the batch is done); None in-process.
_progress: Callable[[str | None], None] | None = None
_PATH_BYTES = 4096  # a longer path is cut: matching no file, its file is read again in
# _isolated, whose own watch then reports it


class _Watch:
    """What a pool's workers are reading, in shared memory: per worker slot its pid, the file
    it is on and since when (time.monotonic, 0 between batches). A plain store per file, no
    message: the parent looks only when no batch has come back for a while."""

    def __init__(self, context, slots: int) -> None:
        self.taken = context.Value("i", 0)
        self.pids = context.RawArray("i", slots)
        self.since = context.RawArray("d", slots)
        self.paths = [context.RawArray("c", _PATH_BYTES) for _ in range(slots)]

    def claim(self) -> Callable[[str | None], None] | None:
        """A worker's slot (at its start), as the callable that marks its progress."""
        with self.taken.get_lock():
            slot = self.taken.value
            self.taken.value += 1
        if slot >= len(self.pids):  # (a replaced worker: never, without max_tasks_per_child)
            return None
        self.pids[slot] = os.getpid()
        since, path = self.since, self.paths[slot]

        def progress(file: str | None) -> None:
            if file is None:
                since[slot] = 0.0
            else:  # the path first: the parent reads it only once its time is old
                path.value = os.fsencode(file)[:_PATH_BYTES - 1]
                since[slot] = time.monotonic()

        return progress

    def stalled(self, limit: float) -> list[tuple[int, str]]:
        """(pid, path) of each worker on the same file for more than `limit` seconds."""
        now = time.monotonic()
        found = []
        for slot, pid in enumerate(self.pids):
            began = self.since[slot]
            if pid and began and now - began > limit:
                path = os.fsdecode(self.paths[slot].value)
                if self.since[slot] == began:  # (not moved on while the path was read)
                    found.append((pid, path))
        return found


def _init_worker(options: ScanOptions, datasets: Mapping[str, Dataset],
                 inherited: tuple | None = None, watch: _Watch | None = None) -> None:
    global _worker_state, _progress
    _quiet_on_interrupt()
    _adopt(inherited)
    _worker_state = ScanState(options, selected_rules(options), datasets)
    _progress = watch.claim() if watch is not None else None


def _inherited() -> tuple | None:
    """What a forked worker inherits from this process and a fresh one (a helper's, a spawned
    one) must be given: where S3 buckets live (--endpoint-url, a SimpleTuner config's backends)."""
    client = sys.modules.get("cachedoctor.remote.client")
    return None if client is None else (client._default, dict(client._buckets))


def _adopt(inherited: tuple | None) -> None:
    if inherited is not None:
        from cachedoctor.remote import client

        client._default, buckets = inherited
        client._buckets.update(buckets)


def _quiet_on_interrupt() -> None:
    """Ctrl-C reaches every process of the terminal's group: the main process stops the scan;
    a worker left to raise KeyboardInterrupt would print its traceback."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _check_in_worker(batch: Batch) -> ChunkResult:
    assert _worker_state is not None
    return check_batch(batch, _worker_state)


@dataclass
class Root:
    """A directory (or file) to walk, for one dataset."""

    path: str
    dataset: str
    area: str  # "cache" or "images"
    recursive: bool


def walk_roots(layouts: Iterable[Layout]) -> list[Root]:
    """Each distinct directory to walk. One directory named twice (a kohya image dir that is
    also its cache, an image dir that is a cache dir) is walked once, for the first dataset,
    as a cache dir if either names it so; except an image dir (of images only) that two
    datasets name, walked for each. A trainer's dir that does not exist is CD408's."""
    roots: dict[str | tuple[str, str], Root] = {}
    beside: set[str] = set()  # dirs a dataset keeps its caches in, beside its images
    for layout in layouts:
        for dataset in layout.datasets:
            named = [(d, "cache", True) for d in dataset.cache_dirs]
            named += [(d, "images", d not in dataset.shallow_image_dirs)
                      for d in dataset.image_dirs]
            for path, area, recursive in named:
                remote = is_remote(path)  # a bucket prefix: listed, never stat'ed
                if layout.trainer != "bare" and not remote and not os.path.exists(path):
                    continue
                real = path if remote else os.path.realpath(path)
                key: str | tuple[str, str] = real
                found = roots.get(real)
                if (found is not None and area == found.area == "images"
                        and found.dataset != dataset.id and real not in beside
                        and not dataset.caches_beside_images):
                    # one image dir of two datasets (two model families trained on the same
                    # images): each needs its images for coverage; only images there, stat'ed
                    key = (real, dataset.id)
                    found = roots.get(key)
                if dataset.caches_beside_images and area == "images":
                    beside.add(real)
                if found is None:
                    roots[key] = Root(path, dataset.id, area, recursive)
                else:
                    found.recursive |= recursive
                    if area == "cache":
                        found.area = "cache"
    return list(roots.values())


def plan(layouts: Iterable[Layout], options: ScanOptions) -> Iterator[Batch]:
    """Every file of every dataset, in batches. A root nested in another is walked on its own
    (with its own dataset and area) and skipped by the outer walk."""
    roots = walk_roots(layouts)
    keys = {}
    for root in roots:
        if is_remote(root.path):
            continue
        try:
            st = os.stat(root.path)
        except OSError:
            continue
        keys[root.path] = (st.st_dev, st.st_ino)
    everything = frozenset(keys.values())
    remote = tuple(r.path for r in roots if is_remote(r.path))
    for root in roots:
        if is_remote(root.path):
            from cachedoctor.remote import listing

            yield from listing.batches(root.path, dataset=root.dataset, area=root.area, size=BATCH,
                                       shard=options.shard, recursive=root.recursive, prune=remote)
            continue
        prune = everything - {keys.get(root.path)}
        yield from batches(root.path, dataset=root.dataset, area=root.area, size=BATCH,
                           shard=options.shard, recursive=root.recursive, prune=prune)


def check_files(batches_: Iterable[Batch], options: ScanOptions, rules: list[Rule],
                datasets: Mapping[str, Dataset] | None = None) -> Iterator[ChunkResult]:
    """Results per batch, from a process pool when there is enough work to pay for one."""
    datasets = datasets or {}
    batches_ = iter(batches_)
    first = list(itertools.islice(batches_, IN_PROCESS_BATCHES))
    if options.jobs <= 1 or len(first) < IN_PROCESS_BATCHES:
        yield from _in_process(itertools.chain(first, batches_), options, rules, datasets)
        return
    # (asked before _preload_deep, whose numpy starts OpenBLAS's threads in this process)
    start = pool_start()
    batches_ = itertools.chain(first, batches_)
    if start == "fork":
        yield from _forked(batches_, options, datasets)
        return
    try:
        if start == "helper":
            yield from _in_helper(batches_, options, datasets)
        else:
            import multiprocessing

            yield from _pooled(batches_, options, datasets, multiprocessing.get_context("spawn"))
    except WorkersDidNotStart as exc:  # (no batch was taken yet)
        import warnings

        warnings.warn(f"cachedoctor: {exc}; the files are read in this process instead",
                      RuntimeWarning, stacklevel=3)
        yield from _in_process(batches_, options, rules, datasets)


def _in_process(batches_: Iterable[Batch], options: ScanOptions, rules: list[Rule],
                datasets: Mapping[str, Dataset]) -> Iterator[ChunkResult]:
    state = ScanState(options, rules, datasets)
    for batch in batches_:
        yield check_batch(batch, state)


def _forked(batches_: Iterator[Batch], options: ScanOptions,
            datasets: Mapping[str, Dataset]) -> Iterator[ChunkResult]:
    import multiprocessing  # only a scan big enough for a pool pays for importing it

    # Objects the workers inherit stay out of the collector's way: a collection in a worker
    # would otherwise touch (and so copy) every page of them (~7% of a 2-core scan).
    if options.deep:
        _preload_deep()
    gc.freeze()
    try:
        yield from _pooled(batches_, options, datasets, multiprocessing.get_context("fork"))
    finally:
        gc.unfreeze()


def pool_start() -> str:
    """How a scan's worker pool starts. "fork" (the fastest: a worker inherits everything
    imported here) unless this process runs other threads: fork would copy a lock one of them
    held at that instant (a logging, malloc or library lock; torch's, OpenMP's, gloo's, wandb's
    threads) into every worker, held for good, and the worker would wait for it forever. Then
    "helper": a fresh, single-threaded process (started by fork+exec, which copies no lock)
    forks the workers itself (_in_helper). "spawn" where there is no fork (Windows)."""
    import multiprocessing

    if "fork" not in multiprocessing.get_all_start_methods():
        return "spawn"
    return "helper" if _threaded() else "fork"


def _threaded() -> bool:
    """Whether a thread other than this one may hold a lock at fork time. Native threads
    (torch's, OpenMP's, a C library's) are invisible to `threading`: /proc counts them all.
    torch starts its own at import (and more once a group or CUDA is up): where /proc is not,
    a process that imported it is taken as threaded."""
    import threading

    if threading.active_count() > 1:
        return True
    try:
        return len(os.listdir("/proc/self/task")) > 1
    except OSError:  # no procfs (macOS)
        return "torch" in sys.modules


class WorkersDidNotStart(Exception):
    """The workers of a scan never ran a task, and no batch was taken from the scan yet."""


def _in_helper(batches_: Iterator[Batch], options: ScanOptions,
               datasets: Mapping[str, Dataset]) -> Iterator[ChunkResult]:
    """The batches through a pool that a helper process forks: a fresh interpreter, run by
    fork+exec, that imports cachedoctor alone (~0.2 s) and is single-threaded, as the command
    line is. Unlike forkserver's or spawn's workers it never imports the caller's main script
    again (a training script's top level: its imports, once per worker; its training, where it
    has no `if __name__ == "__main__":`). It asks for each batch as its pool has room (_serve)."""
    import socket
    import subprocess
    from multiprocessing.connection import Connection

    ours, theirs = socket.socketpair()
    path = [entry for entry in sys.path if isinstance(entry, str)]
    code = (f"import sys; sys.path[:] = {path!r}; "
            f"from cachedoctor.engine import _serve; _serve({theirs.fileno()})")
    try:
        helper = subprocess.Popen([sys.executable, "-c", code], pass_fds=(theirs.fileno(),),
                                  stdin=subprocess.DEVNULL)
    except Exception as exc:  # (no sys.executable, say, in an embedded interpreter)
        ours.close()
        raise WorkersDidNotStart(f"the scan's helper process did not start: {exc}") from exc
    finally:
        theirs.close()
    conn = Connection(ours.detach())
    taken = 0
    done = False
    try:
        try:
            conn.send((options, datasets, _inherited()))
        except Exception as exc:  # what it is given does not pickle, or it died at once
            raise WorkersDidNotStart(f"the scan's helper process could not be given the "
                                     f"scan: {type(exc).__name__}: {exc}") from exc
        while True:
            try:
                kind, value = conn.recv()
            except (EOFError, OSError):
                code_ = helper.wait()
                if taken == 0:
                    raise WorkersDidNotStart(f"the scan's helper process exited with status "
                                             f"{code_} before it read a file") from None
                raise RuntimeError(f"cachedoctor: the process running the scan's workers "
                                   f"exited with status {code_} (killed for memory?) before "
                                   f"the scan was done") from None
            if kind == "more":
                batch = next(batches_, None)
                taken += batch is not None
                conn.send(batch)
            elif kind == "result":
                yield value
            else:
                done = True
                return
    finally:
        conn.close()  # a helper still at work notices, and shuts its pool down
        try:
            helper.wait(timeout=None if done else 10)
        except subprocess.TimeoutExpired:  # (a batch it waits for may never end: a hung read)
            helper.kill()
            helper.wait()


def _serve(fd: int) -> None:
    """The helper process of _in_helper: the options and datasets, then the batches one at a
    time as its pool asks for them, each result sent back as it comes."""
    from multiprocessing.connection import Connection

    _quiet_on_interrupt()  # (the caller stops the scan: it closes the connection)
    conn = Connection(fd)

    def pulled() -> Iterator[Batch]:
        while True:
            conn.send(("more", None))
            batch = conn.recv()
            if batch is None:
                return
            yield batch

    try:
        options, datasets, inherited = conn.recv()
        _adopt(inherited)
        batches_ = iter(pulled())
        first = list(itertools.islice(batches_, IN_PROCESS_BATCHES))
        results = (_in_process(itertools.chain(first, batches_), options,
                               selected_rules(options), datasets)
                   if len(first) < IN_PROCESS_BATCHES else
                   _forked(itertools.chain(first, batches_), options, datasets))
        for result in results:
            conn.send(("result", result))
        conn.send(("end", None))
    except (EOFError, OSError):  # the caller stopped the scan, or is gone
        pass


def _preload_deep() -> None:
    """What every --deep worker would import on its first file (numpy, zlib-ng's CRC32),
    imported once here: forked workers inherit it. Each worker importing numpy itself costs
    about 0.1 s of CPU apiece, a quarter of a 2-core deep scan of 8,000 latents."""
    from cachedoctor.formats import crc, nonfinite

    crc.fast()
    nonfinite.preload()


def _ready() -> None:
    """A worker's first task: it started, imported cachedoctor and ran _init_worker."""


def _pooled(batches_: Iterator[Batch], options: ScanOptions, datasets: Mapping[str, Dataset],
            context) -> Iterator[ChunkResult]:
    """The batches through a pool of `options.jobs` workers, a few in flight per worker. A
    worker that dies (killed for memory, a native crash) breaks the pool: the batches in flight
    then are read again one file at a time (_isolated), which finds the file that kills, and a
    fresh pool takes the rest. (multiprocessing.Pool would wait forever for a dead worker's batch.)
    A worker on one file for more than STALL_SECONDS (a hung read) is killed the same way, and
    that file is reported instead of read again.

    Spawned workers (Windows) run the main script's top level again: one that is not guarded by
    `if __name__ == "__main__":` kills them as they start, which is no file's fault. So the first
    pool of those runs one empty task before any batch, or raises WorkersDidNotStart."""
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
    from concurrent.futures.process import BrokenProcessPool

    probe = context.get_start_method() != "fork"
    stalled: set[str] = set()  # the files whose read did not finish: never read again
    while True:
        suspects: list[Batch] = []
        broken = False
        watch = _Watch(context, options.jobs)
        with ProcessPoolExecutor(options.jobs, mp_context=context, initializer=_init_worker,
                                 initargs=(options, datasets, _inherited(), watch)) as pool:
            if probe:
                try:
                    pool.submit(_ready).result()
                except Exception as exc:
                    raise WorkersDidNotStart(
                        f"the scan's worker processes did not start ({context.get_start_method()}"
                        f": {type(exc).__name__}: {exc}); a worker started afresh imports the "
                        f"main script again, whose top level must be guarded by "
                        f"`if __name__ == '__main__':`") from exc
                probe = False
            running = {pool.submit(_check_in_worker, b): b
                       for b in itertools.islice(batches_, 2 * options.jobs)}
            while running:
                done, _ = wait(running, timeout=_poll(), return_when=FIRST_COMPLETED)
                if not done and _stop_stalled(watch, stalled):
                    # (not waiting for the pool to notice: a process in uninterruptible sleep
                    # may outlive SIGKILL; nor for its manager thread, which joins it)
                    pool.shutdown(wait=False, cancel_futures=True)
                    broken = True
                    break
                for future in done:
                    batch = running.pop(future)
                    try:
                        yield future.result()
                    except BrokenProcessPool:
                        broken = True
                        suspects.append(batch)
                    except Exception:  # its result would not pickle, say: the pool goes on
                        suspects.append(batch)
                if broken:
                    break
                for batch in itertools.islice(batches_, len(done)):
                    running[pool.submit(_check_in_worker, batch)] = batch
            suspects.extend(running.values())
        for batch in suspects:
            yield from _isolated(batch, options, datasets, context, stalled)
        if not broken:
            return


def _poll() -> float:
    """How long _pooled waits for a batch before it looks for a stalled worker."""
    return max(0.05, min(STALL_SECONDS / 4, 10.0))


def _stop_stalled(watch: _Watch, stalled: set[str]) -> bool:
    """Kill each worker stuck on one file past STALL_SECONDS, adding its file to `stalled`."""
    import signal

    hung = watch.stalled(STALL_SECONDS)
    for pid, path in hung:
        stalled.add(path)
        with contextlib.suppress(OSError):  # (it ended on its own)
            os.kill(pid, getattr(signal, "SIGKILL", signal.SIGTERM))
    return bool(hung)


def _stall_result(single: Batch, options: ScanOptions) -> ChunkResult:
    entries = list(single.entries(options.exclude))
    return ChunkResult(len(entries), 0,
                       [crash.stalled(e.path, STALL_SECONDS, e.dataset) for e in entries],
                       [], [e.path for e in entries] if options.keep_paths else [], [])


def _singles(batch: Batch) -> list[Batch]:
    """`batch` as batches of one file each (its listing errors first, together)."""
    errors = [batch._replace(names=(), part=None)] if batch.errors else []
    return errors + [batch._replace(names=(name,), errors=(), part=None) for name in batch.names]


def _isolated(batch: Batch, options: ScanOptions, datasets: Mapping[str, Dataset],
              context, stalled: set[str] = frozenset()) -> Iterator[ChunkResult]:
    """`batch` read one file at a time in a child process that reports each file as it is done;
    when the child dies, the file it was on gets a CD002 finding and a new child goes on with
    the next. A file in `stalled`, or one the child has not finished after STALL_SECONDS
    (the child is then killed), gets a CD002 finding instead of being read (again)."""
    singles = []
    for single in _singles(batch):
        if stalled and any(e.path in stalled for e in single.entries(options.exclude)):
            yield _stall_result(single, options)
        else:
            singles.append(single)
    start = 0
    while start < len(singles):
        receive, send = context.Pipe(duplex=False)
        child = context.Process(target=_one_by_one, daemon=True,
                                args=(send, singles, start, options, datasets, _inherited()))
        child.start()
        send.close()
        killed = False
        try:
            while start < len(singles):
                if not receive.poll(STALL_SECONDS):  # (a dead child's EOF ends the poll too)
                    killed = True
                    child.kill()
                    yield _stall_result(singles[start], options)
                    start += 1
                    break
                yield receive.recv()
                start += 1
        except (EOFError, OSError, pickle.UnpicklingError):  # the child died on singles[start]
            child.join()
            entries = list(singles[start].entries(options.exclude))
            yield ChunkResult(len(entries), 0,
                              [crash.died(e.path, child.exitcode, e.dataset) for e in entries],
                              [], [e.path for e in entries] if options.keep_paths else [], [])
            start += 1
        finally:
            receive.close()
            if killed:
                _abandon(child)
            else:
                child.join()


def _abandon(child) -> None:
    """A killed child given a moment to go; one in uninterruptible sleep (a hung NFS read)
    may not, and is left behind, even by multiprocessing's exit, which would join it."""
    child.join(timeout=1)
    if child.is_alive():
        import multiprocessing.process

        multiprocessing.process._children.discard(child)


def _one_by_one(send, singles: list[Batch], start: int, options: ScanOptions,
                datasets: Mapping[str, Dataset], inherited: tuple | None = None) -> None:
    _quiet_on_interrupt()
    _adopt(inherited)
    state = ScanState(options, selected_rules(options), datasets)
    for single in singles[start:]:
        send.send(check_batch(single, state))
    send.close()


def _counted(batches_: Iterable[Batch], on_listed: Callable[[int], None]) -> Iterator[Batch]:
    """`batches_`, telling `on_listed` how many files the walk has listed so far as it goes:
    a progress bar's total, from the one walk that feeds the readers."""
    listed = 0
    for batch in batches_:
        listed += len(batch.names) + len(batch.errors)
        on_listed(listed)
        yield batch


@dataclass
class FilePhase:
    """What reading every file gave: file findings, counts, and the summaries for the
    dataset rules (in a SummaryStore the caller closes)."""

    findings: list[Finding]
    files: int
    bytes: int
    store: SummaryStore
    paths: list[str] = dataclasses.field(default_factory=list)  # when options.keep_paths
    index: dict = dataclasses.field(default_factory=dict)  # what the index did (Report.index)


def datasets_of(layouts: Iterable[Layout]) -> dict[str, Dataset]:
    return {d.id: d for layout in layouts for d in layout.datasets}


def check_all_files(layouts: list[Layout], options: ScanOptions, rules: list[Rule],
                    on_progress: Callable[[int], None] | None = None,
                    on_listed: Callable[[int], None] | None = None) -> FilePhase:
    """Every file of the layouts read and checked, in one walk. `on_listed(n)`: the walk has
    listed n files so far (it runs a few batches ahead of the readers); `on_progress(n)`: n
    more files were checked."""
    phase = FilePhase([], 0, 0, SummaryStore())
    datasets = datasets_of(layouts)
    listing = options.shard is None or options.shard[0] == 0  # sharded: rank 0 lists, once
    for dataset in datasets.values() if listing else ():  # the trainer's metadata, for CD405
        phase.store.add_coverage([CoverageRow(dataset.id, LISTED_SIDE, None, path, 0.0, 0, None)
                                  for path in dataset.listed_images])
    batches_ = plan(layouts, options)
    if on_listed is not None:
        batches_ = _counted(batches_, on_listed)
    notices: list[str] = []
    session = index.open_session(index_roots(layouts), options, rules, datasets, notices)
    if options.index and (session is None or session.db is None):
        options = dataclasses.replace(options, index=False)  # the workers record nothing

    def add(result: ChunkResult | index.Reused) -> None:
        phase.files += result.files
        phase.bytes += result.bytes
        phase.findings.extend(result.findings)
        phase.paths.extend(result.paths)
        phase.store.add_blobs(result.summaries)
        phase.store.add_coverage(result.coverage)
        if on_progress is not None:
            on_progress(result.files)

    if session is None:
        for result in check_files(batches_, options, rules, datasets):
            add(result)
        return phase
    # The index's lookups and writes are this process's: the workers only read files.
    try:
        for result in check_files(session.split(batches_, add), options, rules, datasets):
            # judged first: store forgets which of the batch's files were unchanged
            findings = session.judged(result.findings)
            session.store(result.records)
            add(dataclasses.replace(result, findings=findings))
    finally:
        # (a rank of a sharded preflight sees a share of the files: it prunes nothing)
        phase.index = session.close(phase.files,
                                    full=options.changed_since is None and options.shard is None)
    if notices:
        phase.index["notices"] = notices
    return phase


def index_roots(layouts: Iterable[Layout]) -> list[str]:
    """The directories a scan walks, cache dirs first: the index lives in the first one's
    `.cachedoctor/` (a scan of single files keeps none)."""
    roots = sorted(walk_roots(layouts), key=lambda root: root.area != "cache")
    return [root.path for root in roots if os.path.isdir(root.path)]


def check_layouts(layouts: list[Layout], options: ScanOptions, rules: list[Rule]) -> list[Finding]:
    """The layout rules, once over every trainer config of the scan (main process)."""
    ctx = RuleContext(options.deep, None, options.settings)
    findings: list[Finding] = []
    for rule in rules:
        if rule.check_layouts is not None:
            where = next((lay.source for lay in layouts if lay.source), None) or \
                next((d for lay in layouts for ds in lay.datasets for d in ds.cache_dirs), ".")
            _gather(findings, rule.check_layouts, (layouts, ctx), rule.code, where, None, "configs")
    return findings


def _gather(findings: list[Finding], check: Callable[..., Iterable[Finding]], args: tuple,
            code: str, where: str, dataset: str | None, what: str) -> None:
    """The findings of one rule over a dataset or the configs; if the rule raises, those it
    made before and a CD002 finding for `where` (the other rules still run)."""
    try:
        for finding in check(*args):
            findings.append(finding)
    except Exception as exc:
        findings.append(crash.failed(where, f"running {code} over the {what}", exc, dataset,
                                     what="dataset" if what == "dataset" else "config"))


def check_datasets(store: SummaryStore, options: ScanOptions, rules: list[Rule],
                   datasets: Mapping[str, Dataset] | None = None) -> list[Finding]:
    """The dataset rules, over every summary and coverage row in `store` (all ranks' when
    sharded), with each dataset's layout facts."""
    datasets = datasets or {}
    findings: list[Finding] = []
    for dataset in store.datasets():
        view = store.view(dataset)
        ctx = RuleContext(options.deep, dataset or None, options.settings, None,
                          datasets.get(dataset))
        facts = datasets.get(dataset)
        where = (facts.cache_dirs[0] if facts is not None and facts.cache_dirs else None) or \
            os.path.abspath(dataset or ".")
        for rule in rules:
            if rule.check_dataset is not None:
                _gather(findings, rule.check_dataset, (view, ctx), rule.code, where,
                        dataset or None, "dataset")
    return findings


def build_report(targets: tuple[str, ...], layouts: list[Layout], findings: list[Finding],
                 files: int, nbytes: int, options: ScanOptions,
                 paths: Iterable[str] = (), index_use: Mapping | None = None) -> Report:
    crashes = options.enabled(crash.RULE.code)  # CD002 is made here, not by a rule: it obeys too
    return Report.build(
        targets,
        [_with_severity(f, options) for f in findings if crashes or f.code != crash.RULE.code],
        files,
        nbytes,
        datasets=[d.id for lay in layouts for d in lay.datasets],
        trainers=sorted({lay.trainer for lay in layouts}),
        checked=paths,
        index=index_use,
    )


def conclude(targets: tuple[str, ...], layouts: list[Layout], options: ScanOptions,
             rules: list[Rule], phase: FilePhase) -> Report:
    """The layout and dataset rules over a finished file phase (closing its store): the
    report. A sharded preflight calls it with every rank's phase merged."""
    try:
        findings = [*check_layouts(layouts, options, rules), *phase.findings,
                    *check_datasets(phase.store, options, rules, datasets_of(layouts))]
    finally:
        phase.store.close()
    return build_report(targets, layouts, findings, phase.files, phase.bytes, options, phase.paths,
                        phase.index)


class Scope(NamedTuple):
    """What a scan reads and how: its targets, their layouts, its options and rules."""

    targets: tuple[str, ...]
    layouts: list[Layout]
    options: ScanOptions
    rules: list[Rule]


# A scan's three steps. scan() runs them in turn; a sharded preflight (api._sharded) runs the
# first two on every rank and the last over every rank's phase merged.
def begin(targets: Iterable[str], options: ScanOptions, layouts: list[Layout] | None = None) -> Scope:
    """The layouts of `targets` and the rules `options` select. Raises TargetError.

    `layouts`: the targets' layouts, already resolved (fix resolves them once, for its locks).
    """
    targets = tuple(targets)
    return Scope(targets, resolve(targets) if layouts is None else layouts, options,
                 selected_rules(options))


def read_files(scope: Scope, on_progress: Callable[[int], None] | None = None,
               on_listed: Callable[[int], None] | None = None) -> FilePhase:
    """Every file of the scope read and checked (only this rank's share, when sharded)."""
    return check_all_files(scope.layouts, scope.options, scope.rules, on_progress, on_listed)


def finish(scope: Scope, phase: FilePhase) -> Report:
    """The layout and dataset rules over a finished file phase (closing its store): the
    report."""
    return conclude(scope.targets, scope.layouts, scope.options, scope.rules, phase)


def scan(targets: Iterable[str], options: ScanOptions | None = None, *,
         on_start: Callable[[int | None], None] | None = None,
         on_progress: Callable[[int], None] | None = None,
         layouts: list[Layout] | None = None) -> Report:
    """Scan `targets` (dirs, files or trainer configs). Raises TargetError for a bad target.

    The tree is walked once: `on_start(n)` is called as the walk lists files, with the number
    listed so far (a progress bar's total, which grows until the walk is done), and
    `on_progress(n)` as each n more files are checked. `layouts`: the targets' layouts when the
    caller has resolved them already (they are not resolved again)."""
    scope = begin(targets, options or ScanOptions(), layouts)
    return finish(scope, read_files(scope, on_progress, on_start))


def _with_severity(finding: Finding, options: ScanOptions) -> Finding:
    override = options.severity.get(finding.code)
    return finding if override is None else dataclasses.replace(finding, severity=override)
