"""## What it does
Reports a path a trainer config names that does not exist: an image dir (SimpleTuner's
`instance_data_dir`, a OneTrainer concept's `path`, kohya's `image_dir`, ai-toolkit's
`folder_path`) or a config it includes (`data_backend_config`, `concept_file_name`,
`dataset_config`). Relative paths are resolved the way the trainer resolves them; the message
says against which directory. Something else in the path's place (a file where a folder
should be, a folder where a file should be, a FIFO or a device) is reported too, saying what
is there. Cache dirs are not reported: trainers create them.

## Why is this bad?
The trainer stops at start-up, or worse, trains on nothing from that dataset: SimpleTuner skips
a bucket refresh when the data directory is missing, kohya logs `not directory` and goes on
without the subset. A relative path that works from one working directory fails from another.

## Example
```
CD408 error config/multidatabackend.json:4
      instance_data_dir "datasets/photos" (/work/proj/datasets/photos) does not exist; relative
      paths resolve against /work/proj, SimpleTuner's working dir (the folder that holds config/)
```

## Fix
None automatic: correct the path in the config (or create the folder).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from cachedoctor.findings import Finding, Severity
from cachedoctor.layouts.base import MISSING_PATH, Layout
from cachedoctor.rule import Rule, RuleContext


def check_layouts(layouts: Sequence[Layout], ctx: RuleContext) -> Iterator[Finding]:
    return RULE.problem_findings(layouts, MISSING_PATH)


RULE = Rule(
    code="CD408",
    name="missing-path",
    severity=Severity.ERROR,
    summary="a config names an image dir or a config file that does not exist",
    doc=__doc__,
    check_layouts=check_layouts,
)
