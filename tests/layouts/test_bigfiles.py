"""layouts.bigfiles: a large JSON object streamed an entry at a time reads as json.loads reads
it, refuses what json.loads refuses (at its line and column), and stops at its limits without
reading a hostile file; config files are read without reserving their limit."""

from __future__ import annotations

import json
import os
import random
import re
import tracemalloc
from pathlib import Path

import pytest

from cachedoctor.layouts import bigfiles
from cachedoctor.layouts.bigfiles import BeyondLimit, NotAnObject, NotJson, object_items, read_whole
from cachedoctor.layouts.sources import read_text


def _value(rnd: random.Random, depth: int = 0) -> object:
    roll = rnd.random()
    if depth > 3 or roll < 0.3:
        return rnd.choice([1, -2.5e-3, 1e22, 0, True, False, None, 'x\u00e9\n"\\', "", 3.14159,
                           123456789012, "\u65e5\u672c", "\U0001f600"])
    if roll < 0.6:
        return [_value(rnd, depth + 1) for _ in range(rnd.randint(0, 4))]
    return {f"k{rnd.randint(0, 9)}": _value(rnd, depth + 1) for _ in range(rnd.randint(0, 4))}


def test_streamed_entries_are_what_json_loads_reads_or_refuses(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random objects, half of them broken, read in chunks as small as one byte (a number,
    an escape or a UTF-8 character cut by a chunk's end must not change the outcome)."""
    rnd = random.Random(7)
    path = tmp_path / "m.json"
    for _ in range(600):
        monkeypatch.setattr(bigfiles, "CHUNK", rnd.choice([1, 2, 3, 7, 64, 4096]))
        doc = {f"/img/{j}.jpg": _value(rnd) for j in range(rnd.randint(0, 6))}
        text = json.dumps(doc, indent=rnd.choice([None, 2]), ensure_ascii=rnd.random() < 0.5)
        if rnd.random() < 0.5:
            cut = rnd.randrange(len(text) + 1)
            text = (text[:cut] + rnd.choice(["", ",", "}", "]", "x", '"', "1e", "\x01", ":"])
                    + text[cut + rnd.randint(0, 2):])
        path.write_text(text, encoding="utf-8")
        try:
            expected = json.loads(text)
        except json.JSONDecodeError as exc:
            if text.lstrip()[:1] == "{":
                where = re.escape(f"{exc.msg} (line {exc.lineno}, column {exc.colno})")
                with pytest.raises(NotJson, match=where):
                    list(object_items(str(path), 2**30))
            else:
                with pytest.raises(NotJson):
                    list(object_items(str(path), 2**30))
            continue
        if isinstance(expected, dict):
            assert dict(object_items(str(path), 2**30)) == expected, text
        else:
            with pytest.raises(NotAnObject):
                list(object_items(str(path), 2**30))


def test_a_hostile_size_is_refused_before_a_byte_is_read(tmp_path: Path) -> None:
    """A 100 GiB file (sparse: no disk used) is BeyondLimit at once, memory untouched."""
    path = tmp_path / "huge.json"
    with open(path, "wb") as f:
        f.write(b'{"a": 1')
        f.truncate(100 * 2**30)
    try:
        for read in (lambda: list(object_items(str(path), 16 * 2**30)),
                     lambda: read_whole(str(path), 2**30)):
            with pytest.raises(BeyondLimit, match=r"107,374,182,400 bytes, beyond cachedoctor's "
                                                  r"reading limit of \d+ GiB: not checked"):
                read()
    finally:
        path.unlink()


def test_one_entry_past_its_limit_is_beyond_it_but_whitespace_is_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bigfiles, "CHUNK", 1024)
    monkeypatch.setattr(bigfiles, "MAX_ENTRY", 4096)
    path = tmp_path / "m.json"
    path.write_text('{"a": 1,' + " " * 100_000 + '"b": [' + "1, " * 2000 + "1]}")
    with pytest.raises(BeyondLimit, match="one entry of the file"):
        list(object_items(str(path), 2**20))
    path.write_text('{"a": 1,' + " \n" * 100_000 + '"b": 2}')
    assert list(object_items(str(path), 2**20)) == [("a", 1), ("b", 2)]


def test_a_fifo_is_refused_not_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "m.json"
    os.mkfifo(fifo)
    with pytest.raises(OSError):
        list(object_items(str(fifo), 2**20))
    with pytest.raises(OSError):
        read_whole(str(fifo), 2**20)


def test_a_small_config_is_read_without_reserving_the_limit(tmp_path: Path) -> None:
    """read_text read `f.read(MAX_CONFIG_BYTES + 1)`: a 64 MiB buffer for every config."""
    path = tmp_path / "dataset.toml"
    path.write_text('[general]\nresolution = 512\n')
    tracemalloc.start()
    try:
        assert read_text(str(path)) == '[general]\nresolution = 512\n'
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 256 * 2**10
