"""What a trainer layout is, and the names one is built from, in one module.

A trainer layout is a module registered in layouts.LAYOUTS under its NAME (a new trainer is one
module plus one line there). It satisfies TrainerLayout: `claims(config)` says whether a parsed
config file is that trainer's, `discover(folder)` lists the config files a project folder holds
by its conventions, and `load(config)` builds the Layout. It builds that Layout from the names
below (the Layout and naming types, typed config reads, path resolution, the cache-entry
helpers), so this one import is all a new layout needs from the package.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from cachedoctor.formats.meta import FileMeta
from cachedoctor.layouts.base import (
    ANY_DEVICE,
    NO_FACTS,
    CacheFacts,
    ConfigProblem,
    Dataset,
    DirectoryNaming,
    Layout,
    Naming,
    Origin,
    frozen,
)
from cachedoctor.layouts.common import (
    Problems,
    ending,
    listdir,
    names,
    subdirs,
    typed,
    unique,
    working_dir,
)
from cachedoctor.layouts.entries import (
    Changes,
    Entries,
    EntryFormat,
    EntrySpec,
    Geometry,
    NoSpec,
    container_of,
    healthy,
    most_common,
    neighbour_format,
    only,
)
from cachedoctor.layouts.paths import canonical, resolve
from cachedoctor.layouts.sources import ConfigFile, type_name
from cachedoctor.layouts.sources import load as load_config

__all__ = [
    "ANY_DEVICE", "NO_FACTS", "CacheFacts", "Changes", "ConfigFile", "ConfigProblem", "Dataset",
    "DirectoryNaming", "Entries", "EntryFormat", "EntrySpec", "FileMeta", "Geometry", "Layout",
    "Naming", "NoSpec", "Origin", "Problems", "TrainerLayout", "canonical", "container_of",
    "ending", "frozen", "healthy", "listdir", "load_config", "most_common", "names",
    "neighbour_format", "only", "resolve", "subdirs", "type_name", "typed", "unique",
    "working_dir",
]


@runtime_checkable
class TrainerLayout(Protocol):
    """A trainer's layout module, as layouts.LAYOUTS holds it."""

    NAME: str

    def claims(self, config: ConfigFile) -> bool:
        """Whether `config` (parsed) is this trainer's, by its name and content."""
        ...

    def discover(self, folder: str) -> list[str]:
        """The config files `folder` holds by this trainer's conventions (not yet claimed)."""
        ...

    def load(self, config: ConfigFile) -> Layout:
        """The Layout `config` describes (its problems inside, never raised)."""
        ...
