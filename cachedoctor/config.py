"""Policy from `cachedoctor.toml` or `[tool.cachedoctor]` in `pyproject.toml`, and from flags.

Discovery is ruff's: from the working directory upward, the first directory holding a
`cachedoctor.toml` (its keys at the top level) or a `pyproject.toml` with a
`[tool.cachedoctor]` table; in one directory `cachedoctor.toml` wins. `--config FILE` names
the file instead, `--isolated` ignores every file. Keys:

    select = ["CD1", "CD201"]      # codes or prefixes; default: every rule
    extend-select = ["CD103"]      # added to select
    ignore = ["CD107"]
    exclude = ["cache/legacy/*"]   # globs, relative to the file's directory when they hold a /
    fail-on = "warning"            # error | warning | info | never
    deep = true                    # read whole tensors (CRC32, NaN/Inf)
    baseline = "cachedoctor-baseline.json"   # relative to the file's directory
    severity = { CD201 = "error" }
    include-info = true            # fix acts on info findings too (--[no-]include-info wins)
    [rules.CD201]                  # (in pyproject: [tool.cachedoctor.rules.CD201])
    min-ratio = 2.0
    min-wasted-bytes = 1_000_000

Layers, lowest first: the file, `--config 'KEY = VALUE'` overrides (TOML, as ruff takes them),
then the flags. A scalar from a higher layer wins; `severity` and `rules` merge key by key;
`exclude` adds up; selection resolves as ruff's does (`--select` starts afresh, `--ignore` and
`--extend-select` adjust what the file chose). An unknown key, a wrong type or an unknown rule
is a ConfigError naming the file and the key.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from cachedoctor.applied import AppliedPolicy
from cachedoctor.findings import DEFAULT_FAIL_ON, FailOn, Severity
from cachedoctor.options import ScanOptions, Selection, resolve_selection
from cachedoctor.regular_files import open_regular

CONFIG_FILE = "cachedoctor.toml"
PYPROJECT = "pyproject.toml"
FAIL_ON = tuple(FailOn)
KEYS = ("select", "extend-select", "ignore", "exclude", "fail-on", "deep", "baseline", "severity",
        "rules", "include-info")


class ConfigError(Exception):
    """A config file or option that cannot be used: a usage error (exit code 2)."""


def _frozen() -> Mapping:
    return MappingProxyType({})


@dataclass(frozen=True)
class Config:
    """One layer of policy. None (or empty) means "not set here": a lower layer decides."""

    selection: tuple[Selection, ...] = ()
    exclude: tuple[str, ...] = ()  # globs; relative ones with a / made absolute
    fail_on: FailOn | None = None
    deep: bool | None = None
    baseline: str | None = None  # absolute path
    severity: Mapping[str, Severity] = field(default_factory=_frozen)
    rules: Mapping[str, Mapping[str, Any]] = field(default_factory=_frozen)
    include_info: bool | None = None  # fix acts on info findings too
    source: str = ""  # what reports call this layer: a file, `--config '...'`, "command line"

    def over(self, lower: Config) -> Config:
        """This layer on top of `lower`."""
        rules = {code: dict(values) for code, values in lower.rules.items()}
        for code, values in self.rules.items():
            rules.setdefault(code, {}).update(values)
        return Config(
            selection=(*lower.selection, *self.selection),
            exclude=(*lower.exclude, *self.exclude),
            fail_on=self.fail_on if self.fail_on is not None else lower.fail_on,
            deep=self.deep if self.deep is not None else lower.deep,
            baseline=self.baseline if self.baseline is not None else lower.baseline,
            severity=MappingProxyType({**lower.severity, **self.severity}),
            rules=MappingProxyType(rules),
            include_info=self.include_info if self.include_info is not None else lower.include_info,
        )


@dataclass(frozen=True)
class Policy:
    """Everything a run needs to know: what to scan with, when to fail, what is known."""

    options: ScanOptions
    fail_on: FailOn = DEFAULT_FAIL_ON
    baseline: str | None = None
    applied: AppliedPolicy = field(default_factory=AppliedPolicy)  # config layers, rules off
    include_info: bool = False  # fix acts on info findings too


def find(start: str | os.PathLike | None = None) -> Path | None:
    """The config file that applies in `start` (default: the working directory), or None."""
    here = Path(start or os.getcwd()).absolute()
    for directory in (here, *here.parents):
        candidate = directory / CONFIG_FILE
        if candidate.is_file():
            return candidate
        candidate = directory / PYPROJECT
        if candidate.is_file() and _read(candidate).get("tool", {}).get("cachedoctor") is not None:
            return candidate
    return None


MAX_CONFIG_BYTES = 16 * 2**20


def _read(path: Path) -> dict[str, Any]:
    try:
        # a regular file only, opened without blocking, of a config's size: the API may be
        # handed a FIFO, and a project's config may come with a cache
        fd, st = open_regular(str(path))
        with open(fd, "rb") as f:
            if st.st_size > MAX_CONFIG_BYTES:
                raise ConfigError(f"{path}: {st.st_size:,} bytes, more than a cachedoctor config "
                                  f"holds ({MAX_CONFIG_BYTES // 2**20} MiB at most): not read")
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    # the file may have come with a cache: what tomllib cannot take is a ConfigError too
    except RecursionError:
        raise ConfigError(f"{path}: invalid TOML: nested too deeply") from None
    except ValueError as exc:  # an integer of more digits than int() takes
        raise ConfigError(f"{path}: invalid TOML: {str(exc).split(';')[0]}") from None


def load(path: str | os.PathLike) -> Config:
    """The policy in one file: `[tool.cachedoctor]` of a pyproject.toml, else the whole file."""
    path = Path(path).absolute()
    data = _read(path)
    if path.name == PYPROJECT:
        table = data.get("tool", {}).get("cachedoctor")
        if table is None:
            raise ConfigError(f"{path}: no [tool.cachedoctor] table")
        return dataclasses.replace(parse(table, str(path), "tool.cachedoctor.", str(path.parent)),
                                   source=f"{path} [tool.cachedoctor]")
    return parse(data, str(path), "", str(path.parent))


def parse(table: Any, source: str, prefix: str = "", base: str | None = None) -> Config:
    """Check one table of settings and turn it into a Config layer.

    `prefix` is how its keys are named in error messages (`tool.cachedoctor.`); relative paths
    in it are relative to `base` (default: the working directory).
    """
    base = base or os.getcwd()

    def error(key: str, problem: str) -> ConfigError:
        return ConfigError(f"{source}: {prefix}{key}: {problem}")

    if not isinstance(table, dict):
        raise ConfigError(f"{source}: {prefix.rstrip('.') or 'the file'} must be a table")
    unknown = [k for k in table if k not in KEYS]
    if unknown:
        raise error(unknown[0], f"unknown key (known: {', '.join(KEYS)})")
    levels, off = _severity(table.get("severity", {}), error)
    selection = Selection(
        select=_selectors(table, "select", error) if "select" in table else None,
        extend_select=_selectors(table, "extend-select", error) or (),
        ignore=(*(_selectors(table, "ignore", error) or ()), *off),
    )
    fail_on = table.get("fail-on")
    if fail_on is not None:
        if fail_on not in FAIL_ON:
            raise error("fail-on", f"expected one of {', '.join(FAIL_ON)}, got {fail_on!r}")
        fail_on = FailOn(fail_on)  # parsed here, once: a FailOn from now on
    deep = table.get("deep")
    if deep is not None and not isinstance(deep, bool):
        raise error("deep", f"expected true or false, got {deep!r}")
    include_info = table.get("include-info")
    if include_info is not None and not isinstance(include_info, bool):
        raise error("include-info", f"expected true or false, got {include_info!r}")
    baseline = table.get("baseline")
    if baseline is not None and not isinstance(baseline, str):
        raise error("baseline", f"expected a path, got {baseline!r}")
    return Config(
        selection=(selection,) if selection != Selection() else (),
        exclude=anchor(_strings(table, "exclude", error), base),
        fail_on=fail_on,
        deep=deep,
        baseline=os.path.join(base, os.path.expanduser(baseline)) if baseline else None,
        severity=MappingProxyType(levels),
        rules=MappingProxyType(_rule_settings(table.get("rules", {}), error)),
        include_info=include_info,
        source=source,
    )


def anchor(patterns: Iterable[str], base: str) -> tuple[str, ...]:
    """Exclude globs as the walk matches them: one with a `/` that does not start with `*` is
    taken relative to `base`; others match anywhere (a bare name matches the file name)."""
    return tuple(
        os.path.join(base, p) if "/" in p and not p.startswith(("*", "/")) else p
        for p in patterns
    )


def _strings(table: dict, key: str, error) -> tuple[str, ...]:
    value = table.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise error(key, f"expected a list of strings, got {value!r}")
    return tuple(value)


def _rules() -> dict:
    from cachedoctor.checks import RULES

    return RULES


def _selectors(table: dict, key: str, error) -> tuple[str, ...]:
    from cachedoctor.checks import get

    selectors = []
    for given in _strings(table, key, error):
        rule = get(given)  # a code or a name (retained-batch-storage)
        selector = rule.code if rule else given.strip().upper()
        if not any(code.startswith(selector) for code in _rules()):
            raise error(key, f"{given.strip()!r} is no rule code, prefix or name (`cachedoctor rules` "
                             "lists them)")
        selectors.append(selector)
    return tuple(selectors)


def _rule(code: Any, key: str, error):
    from cachedoctor.checks import get

    rule = get(str(code))
    if rule is None:
        raise error(key, f"no rule {code!r} (`cachedoctor rules` lists them)")
    return rule


def _severity(table: Any, error) -> tuple[dict[str, Severity], tuple[str, ...]]:
    """The severity overrides, and the codes set to "off" (switched off, as by `ignore`)."""
    if not isinstance(table, dict):
        raise error("severity", f"expected a table of code = severity, got {table!r}")
    levels, off = {}, []
    for code, level in table.items():
        rule = _rule(code, f"severity.{code}", error)
        word = level.strip().upper() if isinstance(level, str) else None
        if word == "OFF":
            off.append(rule.code)
        elif word in Severity.__members__:
            levels[rule.code] = Severity.parse(level)
        else:
            raise error(f"severity.{code}", f"expected error, warning, info or off, got {level!r}")
    return levels, tuple(off)


def _rule_settings(table: Any, error) -> dict[str, dict[str, Any]]:
    if not isinstance(table, dict):
        raise error("rules", f"expected a table of rule tables, got {table!r}")
    settings: dict[str, dict[str, Any]] = {}
    for code, values in table.items():
        rule = _rule(code, f"rules.{code}", error)
        if not isinstance(values, dict):
            raise error(f"rules.{code}", f"expected a table of settings, got {values!r}")
        for key, value in values.items():
            name = f"rules.{code}.{key}"
            if key not in rule.settings:
                known = ", ".join(rule.settings) or "none"
                raise error(name, f"{rule.code} has no such setting (its settings: {known})")
            settings.setdefault(rule.code, {})[key] = _typed(value, rule.settings[key], name, error)
    return settings


def _typed(value: Any, default: Any, key: str, error) -> Any:
    """`value` if it has the default's type (an integer does for a float); else an error."""
    if isinstance(default, bool) or isinstance(value, bool):
        ok = isinstance(value, bool) and isinstance(default, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float))
    else:
        ok = isinstance(value, type(default))
    if not ok:
        raise error(key, f"expected {type(default).__name__}, got {value!r}")
    if isinstance(default, (int, float)) and not isinstance(default, bool) and value < 0:
        raise error(key, f"must not be negative, got {value!r}")
    return float(value) if isinstance(default, float) else value


def override(text: str) -> Config:
    """A `--config 'KEY = VALUE'` override: one TOML line, keys as in cachedoctor.toml."""
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {text!r}: neither a file nor a TOML `KEY = VALUE` "
                          f"({exc})") from None
    return dataclasses.replace(parse(table, "--config"), source=f"--config {shlex.quote(text)}")


def policy(flags: Config | None = None, *, config: str | os.PathLike | None = None,
           isolated: bool = False, overrides: Iterable[Config] = (),
           cwd: str | None = None) -> Policy:
    """Resolve the layers: the discovered (or named) file, the overrides, then the flags."""
    if isolated and config is not None:
        raise ConfigError("--isolated and --config FILE exclude each other")
    path = None if isolated else Path(config) if config is not None else find(cwd)
    layers = [load(path)] if path is not None else []
    layers += [*overrides, flags or Config()]
    merged = Config()
    for layer in layers:
        merged = layer.over(merged)
    codes = list(_rules())
    enabled = resolve_selection(merged.selection, codes)
    applied = AppliedPolicy(tuple(layer.source for layer in layers[:-1]),
                            switched_off(layers, codes), isolated, lowered(layers),
                            tuple(p for layer in layers[:-1] for p in layer.exclude))
    options = ScanOptions(
        deep=bool(merged.deep),
        selected=frozenset(enabled),
        exclude=merged.exclude,
        severity=merged.severity,
        settings=merged.rules,
    )
    return Policy(options, merged.fail_on or DEFAULT_FAIL_ON, merged.baseline, applied,
                  include_info=bool(merged.include_info))


def _label(layer: Config) -> str:
    """A layer as a report names it: its file, its `--config '...'`, or "the command line"."""
    named = layer.source.startswith("--") or os.path.isabs(layer.source.split(" [")[0])
    return layer.source if named else f"the {layer.source or 'arguments'}"


def lowered(layers: list[Config]) -> tuple[tuple[str, str, str], ...]:
    """(code, severity, layer) for each rule whose severity ends below error, with the layer
    that set it (the last one to)."""
    by: dict[str, tuple[str, str]] = {}
    for layer in layers:
        for code, level in layer.severity.items():
            by[code] = (str(level), _label(layer))
    return tuple((code, level, label) for code, (level, label) in by.items()
                 if level != str(Severity.ERROR))


def switched_off(layers: list[Config], codes: list[str]) -> tuple[tuple[str, str], ...]:
    """Each code the layers switch off, with the layer that did (the last one to)."""
    by: dict[str, str] = {}
    selection: tuple[Selection, ...] = ()
    before = set(codes)
    for layer in layers:
        selection = (*selection, *layer.selection)
        after = set(resolve_selection(selection, codes))
        for code in before - after:
            by[code] = _label(layer)
        before = after
    return tuple((code, by[code]) for code in codes if code not in before)

