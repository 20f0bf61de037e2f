"""## What it does
Reports what is wrong in a trainer config that parses but that the trainer cannot use as
written:

- a key of the wrong type (`"vae_cache_clear_each_epoch": "yes"`, `resolution = "big"`);
- a dataset without its image dir (`instance_data_dir`, `image_dir`, `folder_path`, a
  concept's `path`);
- an `{env:VAR}` placeholder whose variable is not set;
- a duplicate dataset id;
- a bucket file the trainer cannot load: SimpleTuner's `aspect_ratio_bucket_indices_<id>.json`
  that is not valid JSON, not a JSON object, or whose `aspect_ratio_bucket_indices` is no
  mapping (a file without that key, as SimpleTuner wrote until August 2023, is no finding:
  SimpleTuner reads it as no buckets and buckets the images again).

A file beside the dataset that is larger than cachedoctor reads is a **warning**: it was not
checked, which says nothing against the dataset. The limits lie far beyond what millions of
images make: kohya's `metadata_file` and SimpleTuner's bucket metadata 16 GiB, SimpleTuner's
bucket indices and musubi-tuner's jsonl files 1 GiB. The rules that needed the file did not
run on what it names.

Each finding names the file, the line, the key and what was expected.

A config file that does not parse at all (bad JSON, TOML or YAML) is no finding: the scan stops
with a one-line error naming the file and line, and exit code 2.

## Why is this bad?
Trainers react differently, and rarely well. SimpleTuner refuses to start without
`instance_data_dir`, but silently substitutes an empty string for an unset `{env:VAR}` (so a
cache dir may land in `/`). kohya and OneTrainer stop with a validation traceback. A bucket
file that is not JSON is thrown away and rebuilt on the next start, with every latent of the
dataset re-checked; one that is JSON of the wrong shape stops SimpleTuner in `reload_cache`.

## Example
```
CD409 error config/multidatabackend.json:11
      {env:DATA_ROOT} in instance_data_dir is not set: SimpleTuner puts an empty string in its place
```

## Fix
None automatic: correct the config as the message says.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

from cachedoctor.findings import Finding, Severity
from cachedoctor.layouts.base import INVALID, Layout
from cachedoctor.rule import Rule, RuleContext


def check_layouts(layouts: Sequence[Layout], ctx: RuleContext) -> Iterator[Finding]:
    for finding in RULE.problem_findings(layouts, INVALID):
        # a file past cachedoctor's reading limit (the layout sets `reading_limit`) is unknown,
        # not broken: an error there would fail a healthy dataset's scan
        if "reading_limit" in finding.details:
            finding = dataclasses.replace(finding, severity=Severity.WARNING)
        yield finding


RULE = Rule(
    code="CD409",
    name="invalid-config",
    severity=Severity.ERROR,
    summary="a trainer config parses but a key has the wrong type, a required key or env var is missing",
    doc=__doc__,
    check_layouts=check_layouts,
)
