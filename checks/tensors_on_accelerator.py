"""## What it does
Reports cache files whose tensors were saved from a GPU (or another non-CPU device): their
storages carry a location such as `cuda:0`, `cuda:3`, `xpu:0` or `mps`.

## Why is this bad?
`torch.load` puts each storage back on the device it was saved from. On a host without that
device it fails: `RuntimeError: Attempting to deserialize object on a CUDA device but
torch.cuda.is_available() is False`, or `on CUDA device 3 but torch.cuda.device_count() is 1`.
On a multi-GPU host every rank loads the sample onto the saving rank's GPU, and mixing those
tensors with live ones fails with `Expected all tensors to be on the same device` (OneTrainer
#459, where the cache is written from `train_device` without `.cpu()`).

Not reported where the trainer's loader passes `map_location`, since every tensor then lands
where the trainer wants it, whatever it was saved from: SimpleTuner loads its caches with
`map_location="cpu"`, OneTrainer's mgds with `map_location=<train_device>` (so does a OneTrainer
cache scanned without its config, known by its `aggregate.pt` files), finetrainers its
`finetrainers-precomputed-data/` items with `map_location=<its rank's device>`. kohya's npz, ai-toolkit's
safetensors and 🤗 datasets' Arrow files record no device. A warning in a cache no trainer
config describes: its loader is unknown, and a plain `torch.load` puts the tensors back on the
saving device.

## Example
```
CD501 warning cache/1024x1024/0042.pt  tensors stored on cuda:0 (1 of 1 tensors)
```

## Fix
`cachedoctor fix` rewrites the file with every tensor on the CPU (`to-cpu`), bit-identical;
trainers then load it with `map_location` or move it where they need it. Writers should call
`.cpu()` before `torch.save`.
"""

from __future__ import annotations

from cachedoctor.findings import Finding, Severity
from cachedoctor.fix_kinds import FixKind
from cachedoctor.formats.meta import FileMeta
from cachedoctor.layouts.base import ANY_DEVICE
from cachedoctor.rule import Rule, RuleContext


def expected(location: str, device: str | None) -> bool:
    """Whether a storage saved at `location` is where a trainer loading onto `device` wants it
    ("cuda" matches "cuda:0"; no device means the CPU)."""
    if device == ANY_DEVICE:
        return True
    if device is None or location == "cpu":
        return location == "cpu"
    return location == device or (":" not in device and location.split(":")[0] == device)


def check(meta: FileMeta, ctx: RuleContext) -> Finding | None:
    device = ctx.facts.expected_device if ctx.facts is not None else None
    off_cpu = [t for t in meta.tensors if not expected(t.location, device)]
    if not off_cpu:
        return None
    locations = sorted({t.location for t in off_cpu})
    return RULE.finding(
        meta.path,
        f"tensors stored on {', '.join(locations)} ({len(off_cpu)} of {len(meta.tensors)} "
        "tensors)",
        ctx,
        locations=locations,
        tensors=[t.display_path for t in off_cpu],
    )


RULE = Rule(
    code="CD501",
    name="tensors-on-accelerator",
    severity=Severity.WARNING,
    summary="tensors stored with a CUDA (or other non-CPU) location",
    doc=__doc__,
    fix=FixKind.TO_CPU,
    check_file=check,
)
