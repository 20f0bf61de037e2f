"""Score cachedoctor (and picklescan, when installed) on a corpus of hostile and benign files.

    python benchmarks/hostile_corpus.py DIR... [--json OUT]

The corpus is not part of the repository: fetch it for a local run, e.g. picklescan's own test
samples (`tests/data` and `tests/data2` of github.com/mmaitre314/picklescan).

Ground truth comes from the loaders themselves, not from file names: each file is handed, in a
child process without network, to `pickle.load`, `torch.load(weights_only=False)` and
`np.load(allow_pickle=True)` (every member of an npz). An audit hook records every global the
unpickler resolves (the `pickle.find_class` audit event) and refuses the dangerous events a payload
would raise (os.system, subprocess, exec, sockets, file writes), so a payload is stopped at its
first step. A file "executes" when a loader resolved a global outside the weights-only set that
torch itself accepts (plus numpy's own array reconstruction), or raised a refused event.

Scoring: every file that executes must get an error-severity finding from `cachedoctor scan`.
Files no loader executes fall in two groups: those the corpus names as attacks (a pickle in a zip
member flagged encrypted, a second pickle after the first STOP: payloads another loader would
reach), which should be errors too, and benign ones, which must get no CD105.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# Run in a child: prints one JSON line {"globals": [...], "refused": [...], "loaded": [...]}.
ORACLE = r"""
import io, json, pickle, sys, zipfile
import numpy as np
import torch
from torch._weights_only_unpickler import _get_allowed_globals

path = sys.argv[1]
seen, refused, loaded = [], [], []
REFUSE = ("os.system", "os.exec", "os.spawn", "os.posix_spawn", "os.fork", "os.kill", "os.remove",
          "os.unlink", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.putenv", "os.truncate",
          "shutil.", "subprocess.", "socket.", "exec", "ctypes.", "webbrowser.",
          "urllib.Request", "http.client", "ftplib.", "smtplib.", "glob.", "code.__new__",
          "import", "sys._getframe", "object.__setattr__", "builtins.input")

def hook(event, args):
    if event == "pickle.find_class":
        seen.append(f"{args[0]}.{args[1]}")
        return
    if event == "open":
        mode = args[1] if len(args) > 1 and isinstance(args[1], str) else "r"
        if any(c in mode for c in "wax+"):
            refused.append(f"open:{args[0]}:{mode}")
            raise PermissionError("refused by the corpus oracle")
        return
    if event.startswith(REFUSE):
        # a module imported for a global may run code: refused, but not itself evidence
        # (torch.load imports lazily on benign files too)
        if event != "import":
            refused.append(event)
        raise PermissionError("refused by the corpus oracle")

import numpy.lib.format  # noqa: F401  (imports done before the hook refuses imports)
sys.addaudithook(hook)

def attempt(name, fn):
    try:
        fn()
        loaded.append(name)
    except BaseException:
        pass

def np_load():
    obj = np.load(path, allow_pickle=True)
    if hasattr(obj, "files"):
        for key in obj.files:
            obj[key]

with open(path, "rb") as f:
    data = f.read()
attempt("pickle", lambda: pickle.loads(data))
attempt("torch", lambda: torch.load(io.BytesIO(data), weights_only=False, map_location="cpu"))
attempt("numpy", np_load)
allowed = set(_get_allowed_globals())
print(json.dumps({"globals": seen, "refused": refused, "loaded": loaded, "allowed": sorted(allowed)}))
"""

NUMPY_RECONSTRUCT = {
    "numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct",
    "numpy.ndarray", "numpy.dtype", "numpy.core.multiarray.scalar", "numpy._core.multiarray.scalar",
}
CONTAINERS = {"builtins.set", "builtins.frozenset", "builtins.list", "builtins.dict", "builtins.tuple",
              "__builtin__.set", "collections.OrderedDict", "_codecs.encode", "builtins.bytearray"}


# how picklescan's corpus names its attack samples
ATTACK_NAME = re.compile(r"malicious|GHSA-|exploit|sploit|exfiltration|injection|FileIO|FileHandler|"
                         r"urlopen|CodeType|bypass", re.IGNORECASE)


def oracle(path: Path) -> dict:
    """What the loaders do with `path`, observed in a child process with no network."""
    cmd = [sys.executable, "-c", ORACLE, str(path)]
    if sys.platform == "linux" and _can_unshare():
        cmd = ["unshare", "--net", *cmd]
    with tempfile.TemporaryDirectory() as cwd:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:  # the child died: a payload that crashed the interpreter counts as executing
        return {"executes": True, "why": f"loader process died ({proc.returncode})", "loaded": []}
    got = json.loads(lines[-1])
    safe = set(got["allowed"]) | NUMPY_RECONSTRUCT | CONTAINERS
    bad = sorted({g for g in got["globals"] if g not in safe})
    executes = bool(bad or got["refused"])
    why = ", ".join(bad + got["refused"])[:200]
    return {"executes": executes, "why": why, "loaded": got["loaded"]}


def _can_unshare() -> bool:
    try:
        return subprocess.run(["unshare", "--net", "true"], capture_output=True).returncode == 0
    except OSError:
        return False


def cachedoctor_verdicts(files: list[Path]) -> dict[str, list[tuple[str, str]]]:
    """Each file's findings (code, severity), from one `cachedoctor scan --isolated` of copies."""
    verdicts: dict[str, list[tuple[str, str]]] = {str(f): [] for f in files}
    with tempfile.TemporaryDirectory() as tmp:
        # one folder per file: each is judged alone, as a user scanning that one file would
        targets = []
        for i, f in enumerate(files):
            d = Path(tmp, str(i))
            d.mkdir()
            (d / f.name).write_bytes(f.read_bytes())
            targets.append(d / f.name)
        out = subprocess.run(
            [sys.executable, "-m", "cachedoctor", "scan", "--isolated", "--format", "json",
             "--fail-on", "never", *map(str, targets)],
            capture_output=True, text=True, cwd=tmp, timeout=600)
        report = json.loads(out.stdout)
        index = {str(t.relative_to(tmp)): str(f) for t, f in zip(targets, files, strict=True)}
        for finding in report["findings"]:
            original = index.get(finding["path"]) or index.get(os.path.relpath(finding["path"], tmp))
            if original is not None:
                verdicts[original].append((finding["code"], finding["severity"]))
    return verdicts


def picklescan_verdict(path: Path) -> str | None:
    """'flagged', 'clean' or 'error' from picklescan's API; None when it is not installed."""
    try:
        from picklescan.scanner import scan_file_path
    except ImportError:
        return None
    try:
        result = scan_file_path(str(path))
    except Exception:
        return "error"
    if result.infected_files or result.issues_count:
        return "flagged"
    return "error" if result.scan_err else "clean"


def score(dirs: list[Path]) -> dict:
    files = sorted(p for d in dirs for p in d.rglob("*") if p.is_file())
    ours = cachedoctor_verdicts(files)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        truths = list(pool.map(oracle, files))
    rows = []
    for f, truth in zip(files, truths, strict=True):
        findings = ours[str(f)]
        rows.append({
            "file": str(f), "executes": truth["executes"], "why": truth["why"], "loaded": truth["loaded"],
            "cachedoctor": sorted(set(findings)),
            "error": any(sev == "error" for _, sev in findings),
            "cd105": any(code == "CD105" for code, _ in findings),
            "picklescan": picklescan_verdict(f),
        })
    for r in rows:
        r["group"] = ("executes" if r["executes"] else
                      "attack" if ATTACK_NAME.search(Path(r["file"]).name) else "benign")
    groups = {g: [r for r in rows if r["group"] == g] for g in ("executes", "attack", "benign")}
    summary = {"files": len(rows), **{g: len(rs) for g, rs in groups.items()}}
    summary["cachedoctor"] = {
        "executes_as_error": sum(r["error"] for r in groups["executes"]),
        "attack_as_error": sum(r["error"] for r in groups["attack"]),
        "benign_with_cd105": sum(r["cd105"] for r in groups["benign"]),
    }
    if any(r["picklescan"] is not None for r in rows):
        summary["picklescan"] = {
            "executes_flagged": sum(r["picklescan"] == "flagged" for r in groups["executes"]),
            "attack_flagged": sum(r["picklescan"] == "flagged" for r in groups["attack"]),
            "benign_flagged": sum(r["picklescan"] == "flagged" for r in groups["benign"]),
        }
    return {"summary": summary, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dirs", nargs="+", type=Path)
    parser.add_argument("--json", type=Path, help="write every file's row here")
    args = parser.parse_args()
    result = score(args.dirs)
    for r in result["rows"]:
        ours = ",".join(f"{c}:{s[0]}" for c, s in r["cachedoctor"]) or "-"
        flagged = r["cd105"] if r["group"] == "benign" else not r["error"]
        mark = ("FP  " if r["group"] == "benign" else "MISS") if flagged else "ok  "
        print(f"{mark} {r['group']:8} {Path(r['file']).name:40} "
              f"cachedoctor={ours:22} picklescan={r['picklescan']}  {r['why'][:60]}")
    print(json.dumps(result["summary"], indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
