"""## What it does
Reports a pickle (inside a torch zip, a gzip-wrapped or legacy torch file, a plain `.pkl`, an
npz object array, or the field metadata of pyarrow's pickled extension type in an Arrow or
Parquet file) that names a global outside the tensor allow-list that
`torch.load(weights_only=True)` accepts. The file is read by a restricted unpickler that
imports nothing and runs nothing; the globals are listed, never resolved.

## Why is this bad?
Unpickling runs code: a `__reduce__` naming `os.system` or `builtins.exec` executes when a
trainer calls `torch.load(..., weights_only=False)` (OneTrainer's cache loader does) or
`np.load(..., allow_pickle=True)`, or when pyarrow before 14.0.1 reads the schema of an Arrow
or Parquet file (CVE-2023-47248: a field whose extension name is `arrow.py_extension_type`).
A cache downloaded from someone else, or a shared cache dir on a multi-user box, can carry one.
Files that merely hold numpy arrays or custom classes are reported too: `weights_only=True`
refuses them (`Unsupported global`), which breaks trainers that load safely.

One class is by design where it is found: OneTrainer before 2024-07-14 (Nerogar/OneTrainer
474dd2c6, mgds 5ea389a) cached the VAE's output as it came, a diffusers
`DiagonalGaussianDistribution` (`latent_image_distribution`: `parameters`, `mean`, `logvar`,
`std`, `var`), in mgds DiskCache samples (`variation-<n>/<i>.pt`, before mgds a8e7480 of
2023-12-16 `image/epoch-<n>/<i>.pt`) that mgds loads with
`weights_only=False`. Pickled as a plain object (its class and its `__dict__`), it runs nothing
but the import of diffusers, which the trainer has loaded already. In such a sample it is no
finding; anywhere else, or beside any other global, it is reported as any other class is.

## Example
```
CD105 error cache/vae/photos/evil.pt  pickle imports globals outside the tensor allow-list: posix.system
```

## Fix
`cachedoctor fix` moves the file to the quarantine without ever loading it; with `--reencode`
a clean entry is encoded from the source image. Never open such a file with
`weights_only=False`.
"""

from __future__ import annotations

import re

from cachedoctor.findings import Finding, Severity
from cachedoctor.fix_kinds import FixKind
from cachedoctor.formats.meta import FileMeta
from cachedoctor.rule import Rule, RuleContext

DANGEROUS_MODULES = ("os", "posix", "nt", "subprocess", "builtins", "__builtin__", "sys",
                     "shutil", "socket", "runpy", "importlib", "pty", "code", "ctypes")


# diffusers' VAE posterior, under its module before and after diffusers 0.25 moved it
VAE_DISTRIBUTION = frozenset({"diffusers.models.vae.DiagonalGaussianDistribution",
                              "diffusers.models.autoencoders.vae.DiagonalGaussianDistribution"})
# a sample of mgds' DiskCache: <cache>/<group sha256>/variation-<n>/<i>.pt, or before mgds
# a8e7480 (2023-12-16) <cache_dir>/image/epoch-<n>/<i>.pt (layouts/onetrainer.py EPOCH)
MGDS_SAMPLE = re.compile(r"[/\\](variation-\d+|image[/\\]epoch-\d+)[/\\]\d+\.pt$")


def by_design(meta: FileMeta) -> bool:
    """An old OneTrainer sample holding the VAE's distribution, and nothing else unsafe."""
    return set(meta.unsafe_globals) <= VAE_DISTRIBUTION and bool(MGDS_SAMPLE.search(meta.path))


def applies(meta: FileMeta, ctx: RuleContext) -> bool:
    """Whether a file with these facts may be judged at all, whatever its name (by_design
    reads the name): a pickle naming a global outside the allow-list."""
    return bool(meta.unsafe_globals)


def check(meta: FileMeta, ctx: RuleContext) -> Finding | None:
    if not applies(meta, ctx) or by_design(meta):
        return None
    names = ", ".join(meta.unsafe_globals[:8])
    if len(meta.unsafe_globals) > 8:
        names += f" (+{len(meta.unsafe_globals) - 8} more)"
    code_exec = [g for g in meta.unsafe_globals if g.split(".")[0] in DANGEROUS_MODULES]
    lead = "pickle can run code: " if code_exec else "pickle imports globals outside the tensor allow-list: "
    return RULE.finding(meta.path, lead + names, ctx, globals=list(meta.unsafe_globals),
                        executes_code=bool(code_exec))


RULE = Rule(
    code="CD105",
    name="unsafe-pickle",
    severity=Severity.ERROR,
    summary="a pickle imports a global outside the tensor allow-list (never loaded)",
    doc=__doc__,
    fix=FixKind.QUARANTINE,
    check_file=check,
    names=True,  # (the file's name is read: see rule.py)
    applies=applies,
)
