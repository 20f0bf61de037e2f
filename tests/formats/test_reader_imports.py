"""A default scan of safetensors, npy and npz files imports neither torch nor numpy.

torch costs ~2 s and numpy ~100 ms of import in every worker process; only --deep needs numpy.
cachedoctor reads zip archives with its own parser, so none of its modules imports zipfile
either; the interpreter's start-up may (an editable install's import hook does, on some
setuptools versions), which is not cachedoctor's doing and not checked.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import safetensors.torch
import torch

REPO = Path(__file__).resolve().parents[2]


def test_default_scan_imports_neither_torch_nor_numpy(tmp_path):
    safetensors.torch.save_file({"latent": torch.randn(4, 8, 8)}, str(tmp_path / "a.safetensors"),
                                metadata={"format": "pt"})
    np.save(tmp_path / "b.npy", np.zeros((4, 8, 8), np.float16))
    np.savez(tmp_path / "c_0512x0512_sdxl.npz", latents=np.zeros((4, 8, 8), np.float32),
             original_size=np.array([512, 512]), crop_ltrb=np.array([0, 0, 512, 512]))
    np.savez_compressed(tmp_path / "d.npz", latents=np.zeros((4, 8, 8), np.float32),
                        mask=np.array([object()], dtype=object))
    code = (
        "import sys\n"
        f"sys.meta_path.insert(0, ImportedBy({[str(REPO)]!r}))\n"
        "from cachedoctor.formats import read_path\n"
        f"for name in ('a.safetensors', 'b.npy', 'c_0512x0512_sdxl.npz', 'd.npz'):\n"
        f"    meta = read_path({str(tmp_path)!r} + '/' + name)\n"
        "    assert meta.tensors[0].shape == (4, 8, 8), meta\n"
        "print(sorted(m for m in ('torch', 'numpy', 'safetensors') if m in sys.modules))\n"
        "print(sorted(sys.meta_path[0].found))\n"
    )
    out = subprocess.run([sys.executable, "-c", IMPORTED_BY + code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    heavy, zipfile_importers = out.stdout.splitlines()
    assert heavy == "[]"
    assert zipfile_importers == "[]"


# A meta-path hook that notes which of the repository's files imports zipfile (the first frame
# outside importlib's own machinery), then lets the normal finders load it.
IMPORTED_BY = """
import sys


class ImportedBy:
    def __init__(self, roots):
        self.roots, self.found = tuple(roots), set()

    def find_spec(self, name, path=None, target=None):
        if name == "zipfile":
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename.startswith("<frozen"):
                frame = frame.f_back
            if frame is not None and frame.f_code.co_filename.startswith(self.roots):
                self.found.add(frame.f_code.co_filename)
        return None

"""
