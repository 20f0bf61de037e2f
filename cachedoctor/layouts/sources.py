"""Config files read as the trainers read them, keeping the line of every key.

JSON and TOML are parsed by the standard library (its error messages name the line and column);
a second pass over the same text records where each key and list item starts. YAML comes from
PyYAML's safe loader and its node marks. `config.env` files are parsed like SimpleTuner's
`parse_env_file` (`export KEY=value`, quotes stripped), with `${KEY}` of an earlier line
expanded as the bash that once sourced it did. A file that does not parse is a
TargetError naming the file, the place and what was expected.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from cachedoctor.layouts.base import Origin, TargetError
from cachedoctor.layouts.bigfiles import BeyondLimit, read_whole

KINDS = {".json": "json", ".toml": "toml", ".yaml": "yaml", ".yml": "yaml", ".env": "env"}
# a trainer config, dataset config or concept file is KBs (a few MB with thousands of datasets);
# the large files beside a dataset (kohya's metadata_file, bucket caches) go through bigfiles
MAX_CONFIG_BYTES = 64 * 1024 * 1024

Path_ = tuple[str | int, ...]


@dataclass(frozen=True)
class ConfigFile:
    """A parsed config file and the line of each of its keys."""

    path: str  # absolute
    kind: str  # json, toml, yaml, env
    data: Any
    lines: Mapping[Path_, int] = field(default_factory=lambda: MappingProxyType({}))

    def line(self, *keys: str | int) -> int | None:
        """The line of the key at `keys`, or of its nearest enclosing key or item."""
        while keys:
            found = self.lines.get(keys)
            if found is not None:
                return found
            keys = keys[:-1]
        return None

    def origin(self, *keys: str | int) -> Origin:
        return Origin(self.path, key_text(keys), self.line(*keys))


def key_text(keys: Path_) -> str:
    """("datasets", 0, "subsets", 1, "image_dir") -> "datasets[0].subsets[1].image_dir".

    The index into a top-level list (SimpleTuner's datasets, OneTrainer's concepts) is left
    out: the line already says which item, and the key reads as the user wrote it."""
    if keys and isinstance(keys[0], int) and len(keys) > 1:
        keys = keys[1:]
    out = ""
    for key in keys:
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else str(key))
    return out


def kind_of(path: str) -> str | None:
    name = os.path.basename(path).lower()
    if name.endswith(".env") or name == "config.env":
        return "env"
    return KINDS.get(os.path.splitext(name)[1])


def read_text(path: str) -> str:
    # a regular file only, opened without blocking: a config (or one it names) may come with a
    # cache, and a FIFO there would hang the scan. read_whole allocates the file's size, not
    # MAX_CONFIG_BYTES: `f.read(limit + 1)` reserved 64 MiB for every small config it read
    try:
        raw = read_whole(path, MAX_CONFIG_BYTES)
    except BeyondLimit:
        raise TargetError(f"{path}: larger than {MAX_CONFIG_BYTES // 2**20} MiB: not a config file") from None
    except OSError as exc:
        raise TargetError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise TargetError(f"{path}: not UTF-8 text (byte {exc.start}): expected a config file") from None


def load(path: str, kind: str | None = None) -> ConfigFile:
    """Parse the config at `path` (its kind from the extension unless given)."""
    path = os.path.abspath(path)
    kind = kind or kind_of(path)
    if kind is None:
        raise TargetError(f"{path}: unknown config type: expected .json, .toml, .yaml or .env")
    text = read_text(path)
    data, lines = PARSERS[kind](text, path)
    return ConfigFile(path, kind, data, MappingProxyType(lines))


# -- JSON --------------------------------------------------------------------------------------


def _json(text: str, path: str) -> tuple[Any, dict[Path_, int]]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TargetError(f"{path}:{exc.lineno}: not valid JSON: {exc.msg} "
                          f"(line {exc.lineno}, column {exc.colno})") from None
    except RecursionError:
        raise TargetError(f"{path}: not valid JSON: nested too deeply") from None
    lines: dict[Path_, int] = {}
    try:
        _JsonLines(text, lines).value(0, ())
    except (IndexError, ValueError, RecursionError):
        lines.clear()  # positions are a nicety; the data is what matters
    return data, lines


_WS = re.compile(r"[ \t\n\r]*")
_SCALAR = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][-+]?\d+)?|true|false|null")


class _JsonLines:
    """Walks text that json.loads accepted and records where each key and item starts."""

    def __init__(self, text: str, lines: dict[Path_, int]) -> None:
        self.text, self.lines = text, lines
        self.newlines = [m.start() for m in re.finditer("\n", text)]

    def line_at(self, pos: int) -> int:
        import bisect

        return bisect.bisect_left(self.newlines, pos) + 1

    def skip(self, pos: int) -> int:
        return _WS.match(self.text, pos).end()  # type: ignore[union-attr]

    def value(self, pos: int, path: Path_) -> int:
        pos = self.skip(pos)
        char = self.text[pos]
        if char == "{":
            pos = self.skip(pos + 1)
            if self.text[pos] == "}":
                return pos + 1
            while True:
                pos = self.skip(pos)
                key, end = json.decoder.scanstring(self.text, pos + 1)
                self.lines.setdefault((*path, key), self.line_at(pos))
                pos = self.skip(end)  # at ':'
                pos = self.value(pos + 1, (*path, key))
                pos = self.skip(pos)
                if self.text[pos] == "}":
                    return pos + 1
                pos += 1  # ','
        if char == "[":
            pos = self.skip(pos + 1)
            if self.text[pos] == "]":
                return pos + 1
            index = 0
            while True:
                pos = self.skip(pos)
                self.lines.setdefault((*path, index), self.line_at(pos))
                pos = self.skip(self.value(pos, (*path, index)))
                index += 1
                if self.text[pos] == "]":
                    return pos + 1
                pos += 1
        if char == '"':
            return json.decoder.scanstring(self.text, pos + 1)[1]
        match = _SCALAR.match(self.text, pos)
        if match is None:
            raise ValueError(pos)
        return match.end()


# -- TOML --------------------------------------------------------------------------------------

_TOML_HEADER = re.compile(r"^\s*(\[\[?)\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
_TOML_PART = r"(?:[A-Za-z0-9_-]+|\"[^\"]*\"|'[^']*')"
_TOML_KEY = re.compile(rf"^\s*({_TOML_PART}(?:\s*\.\s*{_TOML_PART})*)\s*=")


def _toml(text: str, path: str) -> tuple[Any, dict[Path_, int]]:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        message = str(exc)
        line = re.search(r"line (\d+)", message)
        where = f":{line.group(1)}" if line else ""
        raise TargetError(f"{path}{where}: not valid TOML: {message}") from None
    except RecursionError:
        raise TargetError(f"{path}: not valid TOML: nested too deeply") from None
    except ValueError as exc:  # an integer of more digits than int() takes
        raise TargetError(f"{path}: not valid TOML: {str(exc).split(';')[0]}") from None
    return data, _toml_lines(text)


def _toml_parts(dotted: str) -> list[str]:
    return [p.strip().strip("\"'") for p in re.findall(r"\"[^\"]*\"|'[^']*'|[^.]+", dotted)]


def _toml_lines(text: str) -> dict[Path_, int]:
    """Lines of table headers and keys (array-of-tables items get their index)."""
    lines: dict[Path_, int] = {}
    counts: dict[Path_, int] = {}  # array-of-tables path (with parent indices) -> items so far
    table: Path_ = ()
    in_string: str | None = None
    depth = 0  # open brackets of a multi-line array value
    for number, line in enumerate(text.splitlines(), 1):
        if in_string:
            if in_string in line:
                in_string = None
            continue
        if depth > 0:
            depth += _brackets(line)
            continue
        header = _TOML_HEADER.match(line)
        if header:
            parts = _toml_parts(header.group(2))
            resolved: list[str | int] = []
            # parents that are arrays of tables refer to their latest item
            for part in parts[:-1]:
                resolved.append(part)
                key = tuple(resolved)
                if key in counts:
                    resolved.append(counts[key] - 1)
            resolved.append(parts[-1])
            if header.group(1) == "[[":
                key = tuple(resolved)
                counts[key] = counts.get(key, 0) + 1
                for sub in [k for k in counts if len(k) > len(key) and k[: len(key)] == key]:
                    del counts[sub]  # a new item starts its own sub-arrays
                resolved.append(counts[key] - 1)
            table = tuple(resolved)
            lines.setdefault(table, number)
            continue
        key = _TOML_KEY.match(line)
        if key:
            lines.setdefault((*table, *_toml_parts(key.group(1))), number)
            rest = line[key.end():]
            for quote in ('"""', "'''"):
                if rest.count(quote) == 1:
                    in_string = quote
            if in_string is None:
                depth = max(0, _brackets(rest))
    return lines


def _brackets(text: str) -> int:
    """Opened minus closed brackets and braces, outside strings and comments."""
    text = re.sub(r"\"(?:[^\"\\]|\\.)*\"|'[^']*'", "", text).split("#", 1)[0]
    return text.count("[") + text.count("{") - text.count("]") - text.count("}")


# -- YAML --------------------------------------------------------------------------------------


def _yaml(text: str, path: str) -> tuple[Any, dict[Path_, int]]:
    import yaml

    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise TargetError(f"{path}{where}: not valid YAML: {problem}") from None
    except RecursionError:
        raise TargetError(f"{path}: not valid YAML: nested too deeply") from None
    lines: dict[Path_, int] = {}
    if node is not None:
        problem = _yaml_expansion(node)
        if problem:
            raise TargetError(f"{path}: not a trainer config: {problem}")
        _yaml_lines(node, (), lines)
    return data, lines


MAX_YAML_VALUES = 100_000  # a trainer config has hundreds; aliases must not multiply them


def _yaml_expansion(root: Any) -> str | None:
    """Why the document's aliases make it unfit to walk: an alias inside the node it names (a
    cycle), or aliases that expand it past MAX_YAML_VALUES values ("billion laughs"). Each
    node is counted once however often it is named (memo by identity), without recursion."""
    import yaml

    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if not isinstance(node, yaml.CollectionNode):
            sizes[key] = 1
            continue
        children = [n for pair in node.value for n in (pair if isinstance(pair, tuple) else (pair,))]
        if done:
            on_path.discard(key)
            sizes[key] = 1 + sum(sizes[id(c)] for c in children)
            if sizes[key] > MAX_YAML_VALUES:
                return f"its aliases expand it to more than {MAX_YAML_VALUES:,} values"
            continue
        if key in sizes:
            continue
        if key in on_path:
            return f"an alias at line {node.start_mark.line + 1} refers to a node that holds it"
        on_path.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in children if id(c) not in sizes)
    return None


def _yaml_lines(node: Any, path: Path_, lines: dict[Path_, int]) -> None:
    """The line of every key and item path (the first time an aliased node is reached)."""
    import yaml

    stack = [(node, path)]
    while stack:
        node, path = stack.pop()
        children = []
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode):
                    child = (*path, key.value)
                    lines.setdefault(child, key.start_mark.line + 1)
                    children.append((value, child))
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                child = (*path, index)
                lines.setdefault(child, item.start_mark.line + 1)
                children.append((item, child))
        stack.extend(reversed(children))


# -- shell-style env files ---------------------------------------------------------------------


# `$NAME` / `${NAME}` in an env value: until bd40dc25b (2024-08-31) SimpleTuner's train.sh
# sourced config.env in bash, and its shipped config.env.example set
# DATALOADER_CONFIG="${BASE_DIR}/multidatabackend.json" from a BASE_DIR set above it
_REFERENCE = re.compile(r"\$(?:\{(\w+)\}|(\w+))")
EXPANDED_MAX = 4096  # PATH_MAX: `A=$A$A` lines would otherwise double a value at each line


def _expand(value: str, defined: Mapping[str, str]) -> str:
    """`value` with references to the file's earlier keys replaced as bash would; others (the
    caller's environment, which a scan cannot know) stay as written."""
    if "$" not in value:
        return value
    parts, length, cursor = [], 0, 0
    for match in _REFERENCE.finditer(value):
        part = value[cursor:match.start()] + defined.get(match.group(1) or match.group(2),
                                                          match.group(0))
        length += len(part)
        if length > EXPANDED_MAX:  # stopped as it grows: a line of `$A`s must not fill memory
            return value
        parts.append(part)
        cursor = match.end()
    parts.append(value[cursor:])
    return "".join(parts) if length + len(value) - cursor <= EXPANDED_MAX else value


def _env(text: str, path: str) -> tuple[Any, dict[Path_, int]]:
    data: dict[str, str] = {}
    lines: dict[Path_, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        line = line.removeprefix("export ").strip()
        if "=" not in line:
            continue  # SimpleTuner skips a malformed line with a warning
        key, value = line.split("=", 1)
        key, value = key.strip().removesuffix("+"), value.strip()
        literal = value.startswith("'")  # bash expands nothing inside single quotes
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        data[key] = value if literal else _expand(value, data)
        lines[(key,)] = number
    return data, lines


PARSERS = {"json": _json, "toml": _toml, "yaml": _yaml, "env": _env}


def type_name(value: Any) -> str:
    """How a config value's type reads in a message."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__
