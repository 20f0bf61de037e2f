"""Run a scan: walk the layouts, read files in a process pool, run the rules, build a Report.

Files stream through the pool in chunks; a worker returns only findings, counts and compact
summaries, so memory does not grow with the number of clean files (summaries spill to disk,
see summary.py). Dataset rules run once the files are read.
"""

from __future__ import annotations

import dataclasses
import itertools
import multiprocessing
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from cachedoctor.findings import Finding, Report
from cachedoctor.formats import UNREADABLE, describe_os_error, read_path
from cachedoctor.formats.meta import IMAGE, FileMeta
from cachedoctor.inventory import IMAGE as IMAGE_ROLE
from cachedoctor.inventory import Entry, walk
from cachedoctor.layouts import Layout, resolve
from cachedoctor.options import ScanOptions
from cachedoctor.rule import Rule, RuleContext
from cachedoctor.summary import SummaryStore, encode, summarize

CHUNK = 256
IN_PROCESS_LIMIT = 512  # fewer files than this are read without starting a pool


@dataclass(frozen=True)
class ChunkResult:
    files: int
    bytes: int
    findings: list[Finding]
    summaries: list[tuple[str, bytes]]


def selected_rules(options: ScanOptions) -> list[Rule]:
    from cachedoctor.checks import RULES

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


def check_entries(entries: list[Entry], options: ScanOptions, rules: list[Rule]) -> ChunkResult:
    findings: list[Finding] = []
    summaries = []
    nbytes = 0
    checks = [r.check_file for r in rules if r.check_file is not None]
    for entry in entries:
        meta = read_entry(entry, options.deep)
        nbytes += meta.size
        ctx = RuleContext(options.deep, entry.dataset, options.settings, entry)
        for check in checks:
            findings.extend(check(meta, ctx))
        summary = summarize(entry, meta)
        if summary is not None:
            summaries.append(encode(summary))
    return ChunkResult(len(entries), nbytes, findings, summaries)


# The pool's workers get the options and rules once, at start-up, not with every chunk.
_worker_state: tuple[ScanOptions, list[Rule]] | None = None


def _init_worker(options: ScanOptions) -> None:
    global _worker_state
    _worker_state = (options, selected_rules(options))


def _check_in_worker(entries: list[Entry]) -> ChunkResult:
    assert _worker_state is not None
    return check_entries(entries, *_worker_state)


def iter_entries(layouts: Iterable[Layout], options: ScanOptions) -> Iterator[Entry]:
    """Every file of every dataset; a directory inside one already walked is walked once."""
    walked: list[str] = []
    for layout in layouts:
        for dataset in layout.datasets:
            for root in dataset.cache_dirs:
                real = os.path.realpath(root)
                if any(real == w or real.startswith(w.rstrip(os.sep) + os.sep) for w in walked):
                    continue
                walked.append(real)
                yield from walk(root, dataset=dataset.id, exclude=options.exclude)


def _chunks(entries: Iterator[Entry], size: int) -> Iterator[list[Entry]]:
    while chunk := list(itertools.islice(entries, size)):
        yield chunk


def _results(entries: Iterator[Entry], options: ScanOptions,
             rules: list[Rule]) -> Iterator[ChunkResult]:
    first = list(itertools.islice(entries, IN_PROCESS_LIMIT))
    if options.jobs <= 1 or len(first) < IN_PROCESS_LIMIT:
        for chunk in _chunks(itertools.chain(first, entries), CHUNK):
            yield check_entries(chunk, options, rules)
        return
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else None)
    with context.Pool(options.jobs, initializer=_init_worker, initargs=(options,)) as pool:
        yield from pool.imap_unordered(
            _check_in_worker, _chunks(itertools.chain(first, entries), CHUNK)
        )


def count_files(layouts: Iterable[Layout], options: ScanOptions) -> int:
    return sum(1 for _ in iter_entries(layouts, options))


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
    findings: list[Finding] = []
    files = nbytes = 0
    store = SummaryStore()
    try:
        for result in _results(iter_entries(layouts, options), options, rules):
            files += result.files
            nbytes += result.bytes
            findings.extend(result.findings)
            store.add_blobs(result.summaries)
            if on_progress is not None:
                on_progress(result.files)
        for dataset in store.datasets():
            view = store.view(dataset)
            for rule in rules:
                if rule.check_dataset is not None:
                    ctx = RuleContext(options.deep, dataset or None, options.settings)
                    findings.extend(rule.check_dataset(view, ctx))
    finally:
        store.close()
    findings = [_with_severity(f, options) for f in findings]
    return Report.build(
        targets,
        findings,
        files,
        nbytes,
        datasets=[d.id for lay in layouts for d in lay.datasets],
        trainers=sorted({lay.trainer for lay in layouts}),
    )


def _with_severity(finding: Finding, options: ScanOptions) -> Finding:
    override = options.severity.get(finding.code)
    return finding if override is None else dataclasses.replace(finding, severity=override)
