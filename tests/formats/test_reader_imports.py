"""A default scan of safetensors, npy and npz files imports neither torch nor numpy.

torch costs ~2 s and numpy ~100 ms of import in every worker process; only --deep needs numpy.
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
        "from cachedoctor.formats import read_path\n"
        f"for name in ('a.safetensors', 'b.npy', 'c_0512x0512_sdxl.npz', 'd.npz'):\n"
        f"    meta = read_path({str(tmp_path)!r} + '/' + name)\n"
        "    assert meta.tensors[0].shape == (4, 8, 8), meta\n"
        "print(sorted(m for m in ('torch', 'numpy', 'safetensors', 'zipfile') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
