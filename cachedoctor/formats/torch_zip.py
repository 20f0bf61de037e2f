"""torch.save's zip format: `<prefix>/data.pkl` names the tensors, `<prefix>/data/<key>` holds
each storage's bytes, `<prefix>/version` the format version.

The checks are the ones torch.load makes when it opens the archive and rebuilds each tensor
(PyTorchStreamReader and torch.serialization._load). torch's wording goes in parentheses, so
that a user can match their traceback. The first entry must sit in a subdirectory: its name
is the prefix, and torch writes the file's stem or `archive`. data.pkl and a version record
must exist. Every storage data.pkl names must have a record of numel x itemsize bytes, and
every tensor must lie inside its storage.

Records are found as torch finds them, by name with A-Z folded (PyTorchStreamReader asks
miniz with flags 0). Two entries whose names fold alike are two readings of one record, which
is an error. Every data.pkl among them is unpickled (restricted), so its globals count
whichever one a loader takes. Entries torch never reads are scanned for pickles as any zip's
are (zip_members).

With `deep`, every entry's CRC32 is checked (torch.load never does) and float tensors are
searched for NaN and Inf. Each storage entry is read once (inflated, when a zip tool deflated
it), in bounded chunks that feed both checks, however many tensors view it.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import re
from dataclasses import dataclass

from cachedoctor.formats import crc as checksum
from cachedoctor.formats.meta import TORCH_ZIP, FileMeta, TensorMeta
from cachedoctor.formats.nonfinite import (
    FLOAT_DTYPES,
    holds_none,
    itemsize,
    none_test,
    nonfinite_offsets,
)
from cachedoctor.formats.source import BytesSource, Source
from cachedoctor.formats.torch_tensors import clip, is_dense, nonfinite_counts, tensor_metas
from cachedoctor.formats.unpickler import (
    MAX_PICKLE_BYTES,
    StorageRef,
    UnpickleError,
    load_restricted,
    root_kind,
)
from cachedoctor.formats.zip_members import PickleScan, ascii_fold, scan_members
from cachedoctor.formats.zipdir import (
    MAX_WHOLE_ENTRY,
    STORED,
    OversizedEntry,
    ZipDirectory,
    ZipEntry,
    crc_mismatch,
    entry_chunks,
    entry_crc,
    read_entry,
)

# Files of one cache mostly share their data.pkl byte for byte (same structure, shape, dtype),
# so its analysis is kept per worker, keyed by the bytes and the stored record sizes.
MEMO_PICKLE_BYTES = 64 * 1024
# Every record a read looks at besides the storages.
READ_RECORDS = frozenset({"data.pkl", "version", ".data/version", "byteorder"})
STORAGE = re.compile(r"data/[0-9]+\Z")  # a storage as torch.save names it (its key: a number)


def scanned(rest: str) -> bool:
    """Whether the entry `<prefix>/<rest>` (A-Z folded) is scanned as any zip member is: all
    but the records the reader reads and torch.save's storages (raw tensor bytes)."""
    return rest not in READ_RECORDS and not STORAGE.match(rest)


@dataclass(frozen=True, slots=True)
class _Parsed:
    """The analysis of one data.pkl (shared by every file holding the same bytes)."""

    storages: tuple[tuple[str, StorageRef], ...] = ()
    tensors: tuple[TensorMeta, ...] = ()
    tensor_errors: tuple[str, ...] = ()
    root: str | None = None
    globals: tuple[str, ...] = ()
    unsafe: tuple[str, ...] = ()
    error: str | None = None


def _parse(data: bytes, stored: tuple[tuple[str, int], ...]) -> _Parsed:
    try:
        unpickled = load_restricted(data)
    except UnpickleError as exc:
        return _Parsed(globals=tuple(exc.globals), unsafe=tuple(exc.unsafe_globals), error=str(exc))
    tensors, errors = tensor_metas(unpickled.obj, dict(stored))
    return _Parsed(tuple(unpickled.storages.items()), tuple(tensors), tuple(errors),
                   root_kind(unpickled.obj), tuple(unpickled.globals),
                   tuple(unpickled.unsafe_globals))


_parse_cached = functools.lru_cache(maxsize=512)(_parse)


def read(src: Source, path: str, deep: bool, directory: ZipDirectory,
         prefix: str | None = None) -> FileMeta:
    """Metadata of the torch zip file in `src`; never raises for bad input.

    `prefix`: the file's own archive prefix, when `directory` is another file's of the same
    layout (zip_templates); it only shows in messages.
    """
    try:
        return _Reader(src, path, deep, directory, prefix).read()
    except OSError:
        raise  # the dispatcher reports I/O failures as such
    except Exception as exc:  # malformed input that slipped past a check: still no traceback
        return FileMeta(path, src.size, TORCH_ZIP, deep=deep,
                        errors=(f"cannot read the archive ({type(exc).__name__}: {exc})",))


@dataclass(frozen=True, slots=True)
class TwinPlan:
    """What --deep reads of a twin (read_twin) whose bytes are all in memory, worked out once
    per twin: every entry stored, every float tensor dense."""

    entries: tuple[tuple[int, int, str], ...]  # (data offset, size, name past the prefix)
    # (data offset, size, dtype, tensor indices, their begins, their ends) per storage and dtype
    storages: tuple[tuple[int, int, str, tuple[int, ...], object, object], ...]
    big: bool
    # clean(): the entries whose bytes are equal in every twin (its records: data.pkl, version,
    # byteorder; the payloads its template spells out, such as .format_version) or empty:
    # (their CRCs taken from a list of all, the CRCs their bytes have)
    fixed: tuple[operator.itemgetter | None, tuple[int, ...]] = (None, ())
    varying: tuple[tuple[int, int, int], ...] = ()  # (index, start, end): CRC32 read per file
    # per storage, nonfinite.none_test's proof of no NaN/Inf: (offset, count, test); None
    # when a dtype has none (clean() then always says no)
    values: tuple[tuple, ...] | None = None


def twin_plan(src: Source, twin: FileMeta, directory: ZipDirectory,
              constant: tuple[tuple[int, int], ...] | None = None) -> TwinPlan | None:
    """The TwinPlan of `twin` (read from a file of `directory`'s layout, as `src` is), or None
    when the general path must read its twins (a deflated entry, a strided view). With the
    template's `constant` spans (Template.constant: the payloads every twin holds alike),
    the plan also serves clean()."""

    entries = directory.entries
    cut = entries[0].name.find("/") + 1
    if any(e.method != STORED for e in entries):
        return None
    by_name = {ascii_fold(e.name[cut:]): e for e in entries}
    groups: dict[tuple[str, str], list[int]] = {}
    for i, meta in enumerate(twin.tensors):
        if meta.dtype not in FLOAT_DTYPES or meta.numel == 0 or meta.storage_bytes is None:
            continue
        record = by_name.get(ascii_fold(f"data/{meta.storage_key}"))
        if record is None or meta.extent()[1] > meta.storage_bytes:
            continue  # (not counted by read() either)
        if not is_dense(meta) or meta.itemsize != itemsize(meta.dtype):
            return None
        groups.setdefault((meta.storage_key, meta.dtype), []).append(i)
    storages = []
    for (key, dtype), group in groups.items():
        record = by_name[ascii_fold(f"data/{key}")]
        begins, ends, _ = _extents(twin.tensors, group)
        storages.append((record.data_offset, record.size, dtype, tuple(group), begins, ends))
    big = _Reader(src, "", True, directory)._big_endian(by_name)
    plan = TwinPlan(tuple((e.data_offset, e.size, e.name[cut:]) for e in entries),
                    tuple(storages), big)
    if constant is None:
        return plan
    return dataclasses.replace(plan, **_clean_plan(src, entries, constant, storages, big))


def _clean_plan(src: Source, entries: tuple[ZipEntry, ...], constant: tuple[tuple[int, int], ...],
                storages: list, big: bool) -> dict:
    """clean()'s part of a TwinPlan."""
    fixed, actual, varying = [], [], []
    for i, e in enumerate(entries):
        start, end = e.data_offset, e.data_offset + e.size
        if start == end or any(a <= start and end <= b for a, b in constant):
            fixed.append(i)  # the same bytes in every twin: their CRC is worked out once
            actual.append(checksum.crc32(src.pread(start, e.size)) if e.size else 0)
        else:
            actual.append(0)
            varying.append((i, start, end))
    getter = operator.itemgetter(*fixed) if fixed else None
    values = []
    for offset, size, dtype, *_ in storages:
        test = none_test(dtype, big)
        if test is None or size < test[0].itemsize:
            return {}
        values.append((offset, size // test[0].itemsize, test))
    return {"fixed": (getter, getter(actual) if getter else ()), "varying": tuple(varying),
            "values": tuple(values)}


def clean(data: bytes, plan: TwinPlan, recorded: tuple[int, ...]) -> bool:
    """Whether a twin's bytes (`data`, the whole file, whose central directory records the
    CRC32s `recorded`) hold nothing --deep would report: every CRC32 right, no NaN/Inf in any
    float storage. True is then read_twin's answer (the twin's facts); False says only that
    read_twin must look (a CRC32 not recorded, a NaN, a wrong CRC), and costs it nothing but
    this call. The cheapest proof: the records' CRCs compared to theirs worked out once, the
    others' read, and two reductions per storage (nonfinite.holds_none)."""
    if plan.values is None:
        return False
    getter, expected = plan.fixed
    if getter is not None and getter(recorded) != expected:
        return False
    crc32, whole = checksum.fast(), memoryview(data)
    for i, start, end in plan.varying:
        if crc32(whole[start:end]) != recorded[i]:
            return False
    return all(holds_none(data, offset, count, test) for offset, count, test in plan.values)


def read_twin(src: Source, path: str, twin: FileMeta, directory: ZipDirectory,
              crcs: tuple[int, ...], prefix: str, plan: TwinPlan | None = None) -> FileMeta:
    """--deep of a file laid out as `directory`'s (another file's, zip_templates) whose records
    torch reads hold the same bytes as that of `twin`, a deep FileMeta that found nothing: its
    facts are twin's, so only this file's CRC32s (`crcs`, from its own directory) and values
    are read. What read() would report, at the cost of the checks alone: with `plan` and the
    file in memory, straight from memoryview slices of it."""
    whole = src.buffer
    if plan is not None and whole is not None and len(whole) == src.size and any(
            crc for crc, (_, size, _) in zip(crcs, plan.entries, strict=True) if size):
        return _read_planned(memoryview(whole), path, twin, crcs, prefix, plan)
    cut = directory.entries[0].name.find("/") + 1
    own = ZipDirectory(tuple(
        ZipEntry(f"{prefix}/{e.name[cut:]}", e.method, crc, e.compressed_size, e.size,
                 e.header_offset, e.data_offset)
        for e, crc in zip(directory.entries, crcs, strict=True)),
        directory.cd_offset, directory.trailing_bytes)
    reader = _Reader(src, path, True, own)
    records = {ascii_fold(e.name[len(prefix) + 1 :]): e for e in own.entries}
    try:
        nonfinite = reader._scan_storages(records, twin.tensors, reader._big_endian(records),
                                          clip(f"{prefix}/"))
        crc_errors = reader._crc_errors()
    except OSError:
        raise  # the dispatcher reports I/O failures as such
    except Exception as exc:  # as read(): no traceback for input that slipped past a check
        return FileMeta(path, src.size, TORCH_ZIP, deep=True,
                        errors=(f"cannot read the archive ({type(exc).__name__}: {exc})",))
    if not (nonfinite or crc_errors or reader.errors or reader.notes):
        return twin.renamed(path)  # the same facts: whoever judges it may reuse twin's verdict
    return dataclasses.replace(twin, path=path, nonfinite=nonfinite, crc_errors=crc_errors,
                               errors=tuple(reader.errors), notes=tuple(reader.notes),
                               mtime=0.0, same_as=None)


def _read_planned(data: memoryview, path: str, twin: FileMeta, crcs: tuple[int, ...],
                  prefix: str, plan: TwinPlan) -> FileMeta:
    """read_twin for a planned twin whose file is all in `data`, with its CRC32s recorded."""
    import numpy as np

    crc32 = checksum.crc32
    crc_errors = []
    for (offset, size, rest), recorded in zip(plan.entries, crcs, strict=True):
        actual = crc32(data[offset : offset + size])
        if actual != recorded:
            crc_errors.append(crc_mismatch(clip(f"{prefix}/{rest}"), recorded, actual))
    counts: dict[int, int] = {}
    for offset, size, dtype, group, begins, ends in plan.storages:
        found = nonfinite_offsets(data[offset : offset + size], dtype, plan.big)
        if found is not None:  # (rare) how many of them each tensor reaches
            reached = np.searchsorted(found, ends) - np.searchsorted(found, begins)
            for i, n in zip(group, reached.tolist(), strict=True):
                counts[i] = n
    nonfinite = tuple((twin.tensors[i].path, counts[i]) for i in sorted(counts) if counts[i])
    if not (nonfinite or crc_errors):
        return twin.renamed(path)  # the same facts: whoever judges it may reuse twin's verdict
    return dataclasses.replace(twin, path=path, nonfinite=nonfinite, crc_errors=tuple(crc_errors),
                               mtime=0.0, same_as=None)


class _Reader:
    def __init__(self, src: Source, path: str, deep: bool, directory: ZipDirectory,
                 own_prefix: str | None = None) -> None:
        self.src, self.path, self.deep, self.directory = src, path, deep, directory
        self.own_prefix = own_prefix
        self.errors: list[str] = []
        self.notes: list[str] = []
        self.globals: list[str] = []
        self.unsafe: list[str] = []
        self.others: list[ZipEntry] = list(directory.entries)  # entries not read as records
        # --deep: CRC32 of the entries already streamed (None: it inflates too far)
        self._crc: dict[ZipEntry, int | None] = {}

    def read(self) -> FileMeta:
        directory, errors = self.directory, self.errors
        entries = directory.entries
        if directory.trailing_bytes:
            self.notes.append(f"{directory.trailing_bytes:,} bytes follow the end of the zip "
                              "archive (torch.load ignores them)")
        if not entries:
            errors.append("the zip archive has no entries, so no data.pkl")
            return self._meta()
        first = entries[0].name
        slash = first.find("/")
        if slash < 0:
            errors.append(f"the first entry '{clip(first)}' is not in a directory, so torch.load "
                          "finds no data.pkl (file in archive is not in a subdirectory)")
            return self._meta()
        # torch.load (miniz) finds a record by its name with A-Z folded, zipfile by the exact
        # name: entries whose names fold alike are two readings of one record
        prefix = first[: slash + 1]
        folded, cut = ascii_fold(prefix), len(prefix)
        records: dict[str, ZipEntry] = {}
        self.others = []  # entries outside the prefix, and second readings of a record
        twins: list[tuple[ZipEntry, ZipEntry]] = []
        for e in entries:
            name = ascii_fold(e.name)
            if not name.startswith(folded):
                self.others.append(e)
            elif (first_reading := records.setdefault(name[cut:], e)) is not e:
                twins.append((first_reading, e))
                self.others.append(e)
        # records torch.load never reads (any but the ones it reads and the storages): another
        # tool may still unpickle them, np.load read one as an object array
        self.others += [e for name, e in records.items() if scanned(name)]
        if twins:
            errors.append(self._twins_message(*twins[0]))
        # from here on, only for messages
        prefix = clip(prefix if self.own_prefix is None else self.own_prefix + "/")
        pkl = records.get("data.pkl")
        if pkl is None:
            errors.append(f"the archive has no {prefix}data.pkl, which holds the saved object "
                          "(torch.load: failed locating file data.pkl)")
        self._check_version(records, prefix)
        self._check_byteorder(records, prefix)
        if pkl is None:
            return self._meta()
        pickles = [pkl, *(e for first_reading, e in twins if first_reading is pkl)]
        if len(pickles) > 1:  # each unpickled below: not again as an unknown member
            self.others = [e for e in self.others if e not in pickles]
        # by the key as the entry spells it (data.pkl's keys are matched exactly here)
        stored = {e.name[cut + 5 :]: e.size for name, e in records.items()
                  if name.startswith("data/")}
        parsed = None
        for pkl in pickles:  # every reading: its globals count, whichever a loader takes
            parsed = self._unpickle(pkl, stored) or parsed
        if parsed is None:
            return self._meta()
        for key, ref in parsed.storages:
            name = clip(key)
            record = records.get(ascii_fold(f"data/{key}"))
            if record is None:
                errors.append(
                    f"data.pkl names storage '{name}' but the archive has no {prefix}data/{name} "
                    f"(torch.load: failed locating file data/{name})")
                continue
            if record.size != ref.nbytes:
                errors.append(
                    f"storage {prefix}data/{name} holds {record.size:,} bytes where data.pkl "
                    f"expects {ref.nbytes:,} ({ref.numel:,} x {ref.dtype}) (torch.load: record "
                    f"size ({record.size} bytes) does not match expected size ({ref.nbytes} "
                    f"bytes ...); older torch: record size {record.size} mismatch with dst size "
                    f"{ref.nbytes})")
        errors.extend(parsed.tensor_errors)
        tensors = parsed.tensors
        nonfinite: tuple = ()
        if self.deep:
            nonfinite = self._scan_storages(records, tensors, self._big_endian(records), prefix)
        return self._meta(root=parsed.root, tensors=tensors, nonfinite=nonfinite)

    @staticmethod
    def _twins_message(one: ZipEntry, other: ZipEntry) -> str:
        a, b = clip(one.name), clip(other.name)
        if one.name == other.name:
            return (f"the archive holds '{a}' twice: zipfile reads the last copy, torch.load "
                    "(miniz) either one, so a scan of one proves nothing about the other")
        return (f"entries '{a}' and '{b}' name one record: torch.load (miniz) matches names "
                "case-insensitively and may read either, zipfile reads the exact name, so a "
                "scan of one proves nothing about the other")

    def _check_version(self, records: dict[str, ZipEntry], prefix: str) -> None:
        record = records.get(".data/version") or records.get("version")
        if record is None:
            self.errors.append(f"the archive has no {prefix}version record, which torch.load "
                               'requires (Expected hasRecord("version") to be true)')
            return
        text = read_entry(self.src, record, 32).strip()
        if not text.isdigit() or int(text) < 1:
            shown = clip(text.decode("ascii", "replace"))
            self.errors.append(f"the version record holds '{shown}', not a format version")

    def _check_byteorder(self, records: dict[str, ZipEntry], prefix: str) -> None:
        """torch.load reads the byteorder record (torch >= 2.1 writes one) and takes exactly
        `little` or `big`, nothing else: not even with a newline."""
        record = records.get("byteorder")
        if record is None:
            return
        data = read_entry(self.src, record, 16)
        if data not in (b"little", b"big"):
            shown = clip(data.decode("ascii", "replace"))
            self.errors.append(f"the {prefix}byteorder record holds '{shown}', neither 'little' "
                               "nor 'big' (torch.load: Unknown endianness type)")

    def _unpickle(self, pkl: ZipEntry, stored: dict[str, int]) -> _Parsed | None:
        if pkl.size > MAX_PICKLE_BYTES:
            self.errors.append(f"data.pkl is {pkl.size:,} bytes, more than the "
                               f"{MAX_PICKLE_BYTES // 2**20} MiB cachedoctor unpickles: not checked")
            return None
        data = read_entry(self.src, pkl)
        key = tuple(stored.items())
        parsed = _parse_cached(data, key) if len(data) <= MEMO_PICKLE_BYTES else _parse(data, key)
        self.globals += [g for g in parsed.globals if g not in self.globals]
        self.unsafe += [g for g in parsed.unsafe if g not in self.unsafe]
        if parsed.error is not None:
            self.errors.append(f"data.pkl is damaged: {parsed.error}")
            return None
        return parsed

    def _big_endian(self, records: dict[str, ZipEntry]) -> bool:
        record = records.get("byteorder")
        return record is not None and read_entry(self.src, record, 16).strip() == b"big"

    def _crc_recorded(self) -> bool:
        return not all(e.crc == 0 for e in self.directory.entries if e.size)

    def _scan_storages(self, records: dict[str, ZipEntry], tensors: tuple[TensorMeta, ...],
                       big: bool, prefix: str) -> tuple:
        """--deep: (path, count) for each float tensor with NaN or Inf among the elements it
        reaches, in tensor order, as torch_tensors.nonfinite_counts finds them; and, on the
        way, the CRC32 of each storage entry those tensors view (for _crc_errors).

        Each such storage is read once, in chunks (zipdir.entry_chunks): an entry is never
        whole in memory, and many tensors viewing one storage cost one pass, not one each.
        A dense tensor is counted from the chunks (one NaN/Inf search per chunk, then a
        binary search per tensor in the rare chunk that has any); a strided view is gathered
        as before: from the file for a stored entry, else from a copy of the bytes the
        storage's strided views span, kept while the chunks pass.
        """
        views: dict[str, list[int]] = {}
        for i, meta in enumerate(tensors):
            if meta.dtype not in FLOAT_DTYPES or meta.numel == 0 or meta.storage_bytes is None:
                continue
            if (ascii_fold(f"data/{meta.storage_key}") in records
                    and meta.extent()[1] <= meta.storage_bytes):
                views.setdefault(meta.storage_key, []).append(i)
        counts = [0] * len(tensors)
        check_crc = self._crc_recorded()
        for key, indices in views.items():
            record = records[ascii_fold(f"data/{key}")]
            if record.method == STORED and not check_crc:  # tensors read straight from the file
                self._count_from_file(record, [tensors[i] for i in indices], counts, indices, big)
                continue
            try:
                self._stream_storage(record, tensors, indices, counts, big, check_crc,
                                     f"{prefix}data/{clip(key)}")
            except OversizedEntry as exc:
                self.errors.append(str(exc))
                self._crc[record] = None
                for i in indices:
                    counts[i] = 0
        return tuple((tensors[i].path, n) for i, n in enumerate(counts) if n)

    def _count_from_file(self, record: ZipEntry, metas: list[TensorMeta], counts: list[int],
                         indices: list[int], big: bool) -> None:
        src, offset = self.src, record.data_offset
        for i, meta in zip(indices, metas, strict=True):
            found = nonfinite_counts([meta], lambda _key: (src, offset), big)
            counts[i] = found[0][1] if found else 0

    def _stream_storage(self, record: ZipEntry, tensors: tuple[TensorMeta, ...],
                        indices: list[int], counts: list[int], big: bool, check_crc: bool,
                        name: str) -> None:
        import numpy as np

        dense: dict[str, list[int]] = {}  # dtype -> tensors counted from the chunks
        strided: list[int] = []
        for i in indices:
            meta = tensors[i]
            if is_dense(meta) and meta.itemsize == itemsize(meta.dtype):
                dense.setdefault(meta.dtype, []).append(i)
            else:
                strided.append(i)
        bounds: dict[str, tuple] = {}  # dtype -> its tensors' extents, once a chunk has NaN/Inf
        stored = record.method == STORED
        if stored:  # strided views are read from the file afterwards, as without CRCs
            held_from = held_to = 0
        else:
            held_from = min((tensors[i].extent()[0] for i in strided), default=0)
            held_to = max((tensors[i].extent()[1] for i in strided), default=0)
            if held_to - held_from > MAX_WHOLE_ENTRY:
                self.notes.append(
                    f"the strided tensors viewing {name} span {held_to - held_from:,} bytes, "
                    "more than --deep gathers from a deflated entry: their NaN/Inf are not "
                    "counted")
                strided, held_from, held_to = [], 0, 0
        held = bytearray()
        # with CRCs the whole entry, checked; without (only deflated entries come here), as
        # much as read_entry reads and nothing past it
        stop = None if check_crc else record.size
        crc, pos = 0, 0
        for chunk in entry_chunks(self.src, record, stop=stop):
            if check_crc:
                crc = checksum.crc32(chunk, crc)
            end = pos + len(chunk)
            for dtype, group in dense.items():
                found = nonfinite_offsets(chunk, dtype, big)  # None: none (nearly always)
                if found is not None:
                    begins, ends, found_so_far = bounds.get(dtype) or bounds.setdefault(
                        dtype, _extents(tensors, group))
                    found += pos
                    lo, hi = np.clip(begins, pos, end), np.clip(ends, pos, end)
                    found_so_far += np.searchsorted(found, hi) - np.searchsorted(found, lo)
            if held_from < end and pos < held_to:
                held += memoryview(chunk)[max(held_from - pos, 0) : held_to - pos]
            pos = end
        if check_crc:
            self._crc[record] = crc
        for dtype, (_, _, found_so_far) in bounds.items():  # (the rest found none)
            for i, n in zip(dense[dtype], found_so_far.tolist(), strict=True):
                counts[i] = n
        if stored:
            self._count_from_file(record, [tensors[i] for i in strided], counts, strided, big)
            return
        if strided and len(held) < held_to - held_from:  # a short stream: zeros, all finite,
            held += bytes(held_to - held_from - len(held))  # for the bytes it lacks
        src = BytesSource(held)
        for i in strided:
            found = nonfinite_counts([tensors[i]], lambda _key: (src, -held_from), big)
            counts[i] = found[0][1] if found else 0

    def _crc_errors(self) -> tuple[str, ...]:
        entries = self.directory.entries
        if not self._crc_recorded():
            if any(e.size for e in entries):
                self.notes.append("CRC32 not recorded (every entry's checksum is 0, as torch "
                                  "writes with compute_crc32=False): bytes cannot be verified")
            return ()
        found = []
        for e in entries:
            if e in self._crc:  # a storage streamed by _scan_storages
                actual = self._crc[e]
                if actual is None:  # it inflates too far: reported as an error
                    continue
            else:
                try:
                    actual = entry_crc(self.src, e)
                except OversizedEntry as exc:
                    self.errors.append(str(exc))
                    self._crc[e] = None
                    continue
            if actual != e.crc:
                found.append(crc_mismatch(clip(e.name), e.crc, actual))
        return tuple(found)

    def _meta(self, **fields) -> FileMeta:
        crc_errors = self._crc_errors() if self.deep else ()
        # members torch.load never reads (outside the prefix, second readings of a record):
        # another tool may unpickle them
        if self.others:
            found = PickleScan()
            scan_members(self.src, self.others, found)
            self.errors += found.errors
            self.globals += [g for g in found.globals if g not in self.globals]
            self.unsafe += [g for g in found.unsafe if g not in self.unsafe]
        return FileMeta(self.path, self.src.size, TORCH_ZIP, globals=tuple(self.globals),
                        unsafe_globals=tuple(self.unsafe), errors=tuple(self.errors),
                        crc_errors=crc_errors, notes=tuple(self.notes), deep=self.deep, **fields)


def _extents(tensors: tuple[TensorMeta, ...], group: list[int]) -> tuple:
    """(begins, ends, zeros) of the tensors `group` names, as numpy arrays: the NaN/Inf each
    holds is counted into the zeros by a binary search of each chunk's offsets."""
    import numpy as np

    return (np.array([tensors[i].extent()[0] for i in group], np.int64),
            np.array([tensors[i].extent()[1] for i in group], np.int64),
            np.zeros(len(group), np.int64))
