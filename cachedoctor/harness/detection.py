"""What `cachedoctor scan` says about a harness project: the same engine a user runs."""

from __future__ import annotations

from cachedoctor.engine import scan
from cachedoctor.findings import Report
from cachedoctor.harness.project import Project
from cachedoctor.layouts import resolve
from cachedoctor.options import ScanOptions


def scan_targets(project: Project) -> list[str]:
    """The trainer config when a layout reads it (SimpleTuner's), and the cache dirs.

    Until a layout claims `config.json` it would be scanned as a stray JSON file, so it is left
    out; the cache dirs are walked once either way (the engine skips dirs already walked).
    A project whose entries the harness loads without SimpleTuner's map_location is scanned
    without its config: the device rules judge by the loader the config implies.
    """
    config = str(project.config_path)
    read = not project.plain_loader and resolve([config])[0].trainer != "bare"
    targets = [config] if read else []
    return targets + [str(d) for d in dict.fromkeys(project.cache_dirs) if d.exists()]


def scan_project(project: Project) -> Report:
    # One process: the harness may itself run inside a worker, and these caches are small.
    return scan(scan_targets(project), ScanOptions(jobs=1))
