"""The quarantine keeps each original as `<relpath>.quarantined`, where no trainer that lists its
cache by extension takes it for an entry; runs journaled before that naming are still undone.

SimpleTuner lists a cache dir with os.walk (hidden folders too) and keeps every name that ends
with `.pt` (simpletuner/helpers/data_backend/local.py list_files, bghira/SimpleTuner@bc8e6ab7);
it torch.loads every listed file when it scans its cache (caching/vae.py scan_cache_contents)
and deletes what it finds no image for under scan_for_errors.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

from repair_helpers import MARKER, fix_in_process, isolated_state, kept_copy, tree_digest  # noqa: F401

from cachedoctor.fixtures import clean, truncated_archive, unsafe_pickle
from cachedoctor.repair import undo_run
from cachedoctor.repair.caches import state_dir
from cachedoctor.repair.journal import JOURNAL


def simpletuner_lists(cache: Path) -> list[str]:
    """What SimpleTuner's list_files(["pt"]) returns for `cache`: os.walk, endswith."""
    return sorted(os.path.relpath(os.path.join(root, name), cache)
                  for root, _, names in os.walk(cache) for name in names
                  if name.lower().endswith((".pt",)))


def test_no_quarantined_file_is_listed_as_a_cache_entry(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    healthy = clean.build(cache, 2)
    (torn,) = truncated_archive.build(cache)
    (hostile,) = unsafe_pickle.build(cache, marker=tmp_path / MARKER)
    listed_before = simpletuner_lists(cache)

    plan, result = fix_in_process(cache)

    assert not result.failed and {a.path for a in plan.actions} == {str(torn), str(hostile)}
    assert simpletuner_lists(cache) == sorted(p.name for p in healthy)
    assert set(listed_before) - set(simpletuner_lists(cache)) == {torn.name, hostile.name}
    for gone in (torn, hostile):
        assert kept_copy(cache, result.run_id, gone.name).is_file()
    assert not (tmp_path / MARKER).exists()


def test_a_run_journaled_with_bare_quarantine_names_is_undone(tmp_path: Path) -> None:
    """A run made before the `.quarantined` naming: the journal recorded the bare name and the
    copy sits under it. undo finds it there and puts it back."""
    cache = tmp_path / "cache"
    clean.build(cache, 2)
    (torn,) = truncated_archive.build(cache)
    before = tree_digest(cache)
    _, result = fix_in_process(cache)
    kept = kept_copy(cache, result.run_id, torn.name)
    bare = kept.with_name(torn.name)
    kept.rename(bare)  # as that version left it
    journal = os.path.join(state_dir(str(cache)), JOURNAL)
    with sqlite3.connect(journal) as db:
        db.execute("UPDATE actions SET quarantine = ? WHERE run_id = ?",
                   (os.fsencode(os.path.relpath(bare, cache)), result.run_id))

    [undone] = undo_run(result.run_id, [str(cache)])

    assert undone.restored == 1 and not undone.conflicts
    assert tree_digest(cache) == before and not bare.exists()


def test_a_journal_naming_another_copy_cannot_steer_undo(tmp_path: Path) -> None:
    """The recorded quarantine path only chooses between the two names a run can have used;
    a journal naming some other file gets today's name, and undo takes nothing else."""
    cache = tmp_path / "cache"
    clean.build(cache, 2)
    (torn,) = truncated_archive.build(cache)
    _, result = fix_in_process(cache)
    decoy = cache / "decoy.pt"
    decoy.write_bytes(b"not the original")
    journal = os.path.join(state_dir(str(cache)), JOURNAL)
    with sqlite3.connect(journal) as db:
        db.execute("UPDATE actions SET quarantine = ? WHERE run_id = ?", (b"decoy.pt", result.run_id))

    [undone] = undo_run(result.run_id, [str(cache)])

    assert undone.restored == 1 and torn.is_file() and decoy.read_bytes() == b"not the original"
