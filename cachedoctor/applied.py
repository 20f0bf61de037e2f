"""The policy a scan ran under, as its report shows it: the config files and overrides
applied, and the rules they switched off. A config file found in the working directory (or
above it) applies without being named, so every report says which one did."""

from __future__ import annotations

from dataclasses import dataclass

from cachedoctor.units import listing

# Rules whose absence a reader would not notice, and what goes unreported without them.
GUARDS = {
    "CD105": ("unsafe-pickle", "a pickle that runs code when the trainer loads it goes unreported"),
    "CD002": ("checker-error", "a file cachedoctor failed to check goes unreported"),
}


@dataclass(frozen=True)
class AppliedPolicy:
    """Where a scan's policy came from. `configs` lists every config layer applied, lowest
    first: a file (`/p/cachedoctor.toml`, `/p/pyproject.toml [tool.cachedoctor]`) and each
    `--config 'KEY = VALUE'` override; `disabled` pairs each rule switched off with the layer
    that switched it off (a config, "the command line" or "the arguments")."""

    configs: tuple[str, ...] = ()
    disabled: tuple[tuple[str, str], ...] = ()
    isolated: bool = False  # --isolated: no config file was looked for
    lowered: tuple[tuple[str, str, str], ...] = ()  # (code, severity, layer) set below error
    excluded: tuple[str, ...] = ()  # exclude globs of config layers: files never checked

    @property
    def alerts(self) -> tuple[tuple[str, str], ...]:
        """(code, one line) per guard rule a config switched off. A flag or keyword argument
        that does is not alerted on: whoever typed it knows; a config file may come with a
        cache, or sit in a parent directory, unseen."""
        off = tuple((code, f"{code} ({GUARDS[code][0]}) is switched off by {by}: "
                           f"{GUARDS[code][1]}")
                    for code, by in self.disabled if code in GUARDS and by in self.configs)
        # a guard lowered below error no longer fails the run (`--fail-on error`): as silent
        # in CI as switched off
        lowered = tuple((code, f"{code} ({GUARDS[code][0]}) is lowered to {level} by {by}: "
                               f"{GUARDS[code][1]} below --fail-on warning")
                        for code, level, by in self.lowered if code in GUARDS and by in self.configs)
        return off + lowered

    @property
    def warnings(self) -> tuple[str, ...]:
        return tuple(text for _, text in self.alerts)

    def summary(self) -> str:
        """One line for people: 'config: /p/cachedoctor.toml; switched off: CD101, CD102'."""
        configs = ", ".join(self.configs) if self.configs else (
            "none (--isolated)" if self.isolated else "none")
        line = f"config: {configs}"
        if self.disabled:
            line += f"; switched off: {listing([code for code, _ in self.disabled])}"
        if self.excluded:  # a file a config excludes is judged by no rule, CD105 included
            line += f"; not checked: {listing(list(self.excluded))}"
        return line

    def to_dict(self) -> dict:
        """The `policy` object of the JSON report."""
        return {
            "configs": list(self.configs),
            "isolated": self.isolated,
            "disabled": [{"code": code, "by": by} for code, by in self.disabled],
            "warnings": list(self.warnings),
        }
