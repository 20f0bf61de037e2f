"""Turn scan targets into Layouts: trainer configs become datasets, a bare dir one dataset.

Each trainer is a small module registered in LAYOUTS, a TrainerLayout (layouts/api.py, which
also holds the names a layout is built from): `claims(config)` says whether a parsed config file
is that trainer's (by name and content), `discover(folder)` lists the config files a project
folder holds by that trainer's conventions, and `load(config)` builds the Layout. Given a
config that another one includes (a SimpleTuner multidatabackend.json, a kohya dataset TOML),
`load` starts from the including config found beside it, so that scanning either gives the
same layout.

A target is a cache dir or file (a bare layout), a trainer config file, or a project folder (the
configs found in it; a folder with none is a bare cache dir). A config file that does not parse
is a TargetError: exit 2 with one line naming the file and line.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable

from cachedoctor.layouts import (
    aitoolkit,
    bare,
    diffusion_pipe,
    kohya,
    musubi,
    onetrainer,
    s3,
    simpletuner,
    sources,
)
from cachedoctor.layouts.api import TrainerLayout
from cachedoctor.layouts.base import ConfigProblem, Dataset, Layout, Origin, TargetError
from cachedoctor.layouts.common import one_listing_each, unique
from cachedoctor.remote import is_remote

__all__ = ["LAYOUTS", "ConfigProblem", "Dataset", "Layout", "Origin", "TargetError",
           "TrainerLayout", "resolve"]

# diffusion-pipe first: its claim is the narrowest (a `dataset` path and a [model] table), and
# SimpleTuner would take any config.toml with an output_dir
LAYOUTS: dict[str, TrainerLayout] = {
    diffusion_pipe.NAME: diffusion_pipe,
    simpletuner.NAME: simpletuner,
    onetrainer.NAME: onetrainer,
    musubi.NAME: musubi,  # before kohya: both read TOMLs with [[datasets]]
    kohya.NAME: kohya,
    aitoolkit.NAME: aitoolkit,
}


def resolve(targets: Iterable[str]) -> list[Layout]:
    """The Layouts of `targets`; a target that does not exist is a TargetError."""
    layouts: list[Layout] = []
    with one_listing_each():
        for target in targets:
            if is_remote(target):  # an S3 prefix or object: listed from the bucket
                layouts.append(s3.layout(target))
                continue
            try:
                os.lstat(target)
            except OSError as exc:  # gone, or behind a folder we may not enter
                why = exc.strerror.lower() if exc.strerror else "cannot read it"
                raise TargetError(f"{target}: {why}") from None
            except ValueError:  # os.lstat's answer to a NUL byte: no path holds one
                raise TargetError(f"{target}: no such file or directory (it holds a NUL byte)") from None
            if os.path.isdir(target):
                found = project(target)
                layouts.extend(found or [bare.layout(target)])
            else:
                layouts.append(config_layout(target) or bare.layout(target))
    return _distinct(layouts)


def config_layout(path: str) -> Layout | None:
    """The Layout of a trainer config file, or None when `path` is no trainer's config."""
    kind = sources.kind_of(path)
    if kind is None:
        return None
    config = sources.load(path, kind)
    for module in LAYOUTS.values():
        if module.claims(config):
            return module.load(config)
    return None


def project(folder: str) -> list[Layout]:
    """The Layouts of the trainer configs a project folder holds, by each trainer's conventions."""
    layouts = []
    parsed: dict[str, sources.ConfigFile] = {}  # each file parsed once, whoever lists it
    claimed: set[str] = set()
    for module in LAYOUTS.values():
        for path in module.discover(folder):
            real = os.path.realpath(path)
            if real in claimed or not os.path.isfile(path):
                continue
            if real not in parsed:
                parsed[real] = sources.load(path)
            if module.claims(parsed[real]):
                claimed.add(real)
                layouts.append(module.load(parsed[real]))
    return layouts


def _distinct(layouts: list[Layout]) -> list[Layout]:
    """Drop a layout whose config files another layout already read (a backend config given
    beside its main config), then make dataset ids unique across the scan."""
    kept: list[Layout] = []
    for layout in layouts:
        files = {os.path.realpath(f) for f in layout.files}
        if layout.files and any(files <= {os.path.realpath(f) for f in k.files} for k in kept):
            continue
        kept = [k for k in kept
                if not (k.files and {os.path.realpath(f) for f in k.files} < files)]
        kept.append(layout)
    ids = unique(d.id for lay in kept for d in lay.datasets)
    out, at = [], 0
    for layout in kept:
        new = ids[at : at + len(layout.datasets)]
        at += len(layout.datasets)
        mapping: dict[str, str] = {}
        for dataset, ident in zip(layout.datasets, new, strict=True):
            mapping.setdefault(dataset.id, ident)
        datasets = tuple(_renamed(d, n) for d, n in zip(layout.datasets, new, strict=True))
        problems = tuple(dataclasses.replace(p, dataset=mapping.get(p.dataset, p.dataset))
                         for p in layout.problems)
        out.append(dataclasses.replace(layout, datasets=datasets, problems=problems))
    return out


def _renamed(dataset: Dataset, ident: str) -> Dataset:
    return dataset if dataset.id == ident else dataclasses.replace(dataset, id=ident)
