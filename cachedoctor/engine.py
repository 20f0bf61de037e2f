"""Run a scan: walk the layouts, read files in a process pool, run the rules, build a Report.

Files stream through the pool in chunks; a worker returns only findings, counts and compact
summaries, so memory does not grow with the number of clean files (summaries spill to disk,
see summary.py). Dataset rules run once the files are read.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import multiprocessing
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from cachedoctor.checks import RULES
from cachedoctor.findings import Finding, Report
from cachedoctor.formats import UNREADABLE, describe_os_error, read_path
from cachedoctor.formats.meta import IMAGE, FileMeta
from cachedoctor.inventory import IMAGE as IMAGE_ROLE
from cachedoctor.inventory import Batch, Entry, batches
from cachedoctor.layouts import Layout, resolve
from cachedoctor.options import ScanOptions
from cachedoctor.rule import Rule, RuleContext
from cachedoctor.summary import SummaryStore, encode, summarize

BATCH = 256  # files per task sent to a worker
IN_PROCESS_BATCHES = 3  # fewer batches than this are read without starting a pool


@dataclass(frozen=True)
class ChunkResult:
    files: int
    bytes: int
    findings: list[Finding]
    summaries: list[tuple[str, bytes]]
    paths: list[str]  # every file checked, when ScanOptions.keep_paths


def selected_rules(options: ScanOptions) -> list[Rule]:
    return [r for code, r in RULES.items() if options.enabled(code) and (options.deep or not r.deep)]


def read_entry(entry: Entry, deep: bool) -> FileMeta:
    """The FileMeta of one entry; never raises."""
    if entry.error:
        return FileMeta(entry.path, 0, UNREADABLE, errors=(entry.error,))
    if entry.role == IMAGE_ROLE:  # images are never cache files: their stat is all we need
        try:
            st = os.stat(entry.path)
        except OSError as exc:
            return FileMeta(entry.path, 0, UNREADABLE, errors=(describe_os_error(exc),))
        return FileMeta(entry.path, st.st_size, IMAGE, mtime=st.st_mtime)
    try:
        return read_path(entry.path, deep=deep)
    except Exception as exc:  # a reader bug must cost one file, not the scan
        return FileMeta(entry.path, 0, UNREADABLE,
                        errors=(f"internal error while reading: {type(exc).__name__}: {exc}",))


def check_batch(batch: Batch, options: ScanOptions, rules: list[Rule]) -> ChunkResult:
    """Read and check the files of one batch (in a worker process, or in-process)."""
    # The cyclic GC would run dozens of times per batch over objects that form no cycles
    # (about 10% of the scan); it runs again after the batch, so cycles a hostile pickle
    # builds are still freed, one batch at a time.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _check_batch(batch, options, rules)
    finally:
        if collecting:
            gc.enable()


def _check_batch(batch: Batch, options: ScanOptions, rules: list[Rule]) -> ChunkResult:
    findings: list[Finding] = []
    summaries = []
    paths: list[str] = []
    nbytes = files = 0
    checks = [r.check_file for r in rules if r.check_file is not None]
    deep, settings = options.deep, options.settings
    for entry in batch.entries(options.exclude):
        files += 1
        if options.keep_paths:
            paths.append(entry.path)
        meta = read_entry(entry, deep)
        nbytes += meta.size
        ctx = RuleContext(deep, entry.dataset, settings, entry)
        for check in checks:
            found = check(meta, ctx)
            if found is not None:
                findings.append(found)
        summary = summarize(entry, meta)
        if summary is not None:
            summaries.append(encode(summary))
    return ChunkResult(files, nbytes, findings, summaries, paths)


# The pool's workers get the options and rules once, at start-up, not with every batch.
_worker_state: tuple[ScanOptions, list[Rule]] | None = None


def _init_worker(options: ScanOptions) -> None:
    global _worker_state
    _worker_state = (options, selected_rules(options))


def _check_in_worker(batch: Batch) -> ChunkResult:
    assert _worker_state is not None
    return check_batch(batch, *_worker_state)


def plan(layouts: Iterable[Layout], options: ScanOptions) -> Iterator[Batch]:
    """Every file of every dataset, in batches; a directory inside one already walked is
    walked once."""
    walked: list[str] = []
    for layout in layouts:
        for dataset in layout.datasets:
            for root in dataset.cache_dirs:
                real = os.path.realpath(root)
                if any(real == w or real.startswith(w.rstrip(os.sep) + os.sep) for w in walked):
                    continue
                walked.append(real)
                yield from batches(root, dataset=dataset.id, size=BATCH, shard=options.shard)


def check_files(batches_: Iterable[Batch], options: ScanOptions,
                rules: list[Rule]) -> Iterator[ChunkResult]:
    """Results per batch, from a process pool when there is enough work to pay for one."""
    batches_ = iter(batches_)
    first = list(itertools.islice(batches_, IN_PROCESS_BATCHES))
    if options.jobs <= 1 or len(first) < IN_PROCESS_BATCHES:
        for batch in itertools.chain(first, batches_):
            yield check_batch(batch, options, rules)
        return
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else None)
    with context.Pool(options.jobs, initializer=_init_worker, initargs=(options,)) as pool:
        yield from pool.imap_unordered(_check_in_worker, itertools.chain(first, batches_))


def count_files(layouts: Iterable[Layout], options: ScanOptions) -> int:
    return sum(len(b.names) + len(b.errors) for b in plan(layouts, options))


@dataclass
class FilePhase:
    """What reading every file gave: file findings, counts, and the summaries for the
    dataset rules (in a SummaryStore the caller closes)."""

    findings: list[Finding]
    files: int
    bytes: int
    store: SummaryStore
    paths: list[str] = dataclasses.field(default_factory=list)  # when options.keep_paths


def check_all_files(layouts: list[Layout], options: ScanOptions, rules: list[Rule],
                    on_progress: Callable[[int], None] | None = None) -> FilePhase:
    phase = FilePhase([], 0, 0, SummaryStore())
    for result in check_files(plan(layouts, options), options, rules):
        phase.files += result.files
        phase.bytes += result.bytes
        phase.findings.extend(result.findings)
        phase.paths.extend(result.paths)
        phase.store.add_blobs(result.summaries)
        if on_progress is not None:
            on_progress(result.files)
    return phase


def check_datasets(store: SummaryStore, options: ScanOptions, rules: list[Rule]) -> list[Finding]:
    """The dataset rules, over every summary in `store` (all ranks' when sharded)."""
    findings: list[Finding] = []
    for dataset in store.datasets():
        view = store.view(dataset)
        ctx = RuleContext(options.deep, dataset or None, options.settings)
        for rule in rules:
            if rule.check_dataset is not None:
                findings.extend(rule.check_dataset(view, ctx))
    return findings


def build_report(targets: tuple[str, ...], layouts: list[Layout], findings: list[Finding],
                 files: int, nbytes: int, options: ScanOptions,
                 paths: Iterable[str] = ()) -> Report:
    return Report.build(
        targets,
        [_with_severity(f, options) for f in findings],
        files,
        nbytes,
        datasets=[d.id for lay in layouts for d in lay.datasets],
        trainers=sorted({lay.trainer for lay in layouts}),
        checked=paths,
    )


def scan(targets: Iterable[str], options: ScanOptions | None = None, *,
         on_start: Callable[[int | None], None] | None = None,
         on_progress: Callable[[int], None] | None = None) -> Report:
    """Scan `targets` (dirs, files or trainer configs). Raises TargetError for a bad target."""
    options = options or ScanOptions()
    targets = tuple(targets)
    layouts = resolve(targets)
    rules = selected_rules(options)
    if on_start is not None:
        on_start(count_files(layouts, options))
    phase = check_all_files(layouts, options, rules, on_progress)
    try:
        findings = phase.findings + check_datasets(phase.store, options, rules)
    finally:
        phase.store.close()
    return build_report(targets, layouts, findings, phase.files, phase.bytes, options, phase.paths)


def _with_severity(finding: Finding, options: ScanOptions) -> Finding:
    override = options.severity.get(finding.code)
    return finding if override is None else dataclasses.replace(finding, severity=override)
