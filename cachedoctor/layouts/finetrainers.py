"""finetrainers (a-r-r-o-w/finetrainers): the folders its precomputation writes, which a bare
scan must know because of where their tensors were saved from.

Since 9bb9aff (2025-03) `finetrainers/data/precomputation.py` saves each processed item with
`torch.save(item, <precomputation_dir>/finetrainers-precomputed-data/<data_type>-<index>.pt)`
(`condition-<i>.pt`, `latent-<i>.pt`; `precomputation_dir` defaults to
`<output_dir>/precomputed`). The items are the model processors' outputs as made on the
rank's GPU, saved without `.cpu()`, and a Wan latent item's `latents_mean` / `latents_std`
are made by `torch.tensor(vae.config...)` on the CPU beside its CUDA `latents`.
`_load_item` loads every file with `map_location=torch.device(rank)`, so where a tensor was
saved from never reaches training: no CD501 and no CD502 in such a folder.

Before (f311f16 .. 61d14a7, finetrainers/trainer.py `prepare_precomputations`) it wrote
`<data_root>/<model>_<model id>_precomputed/{conditions,latents}/{conditions,latents}-<process>-<i>.pt`,
also from the GPU, and loaded them with `map_location="cpu"` (finetrainers/dataset.py).
"""

from __future__ import annotations

import os

PRECOMPUTED_DATA_DIR = "finetrainers-precomputed-data"
# the older layout: <data_root>/<model>_<id>_precomputed/<folder>/<folder>-<process>-<i>.pt;
# process 0 writes index 0 first, so its first file marks the folder
OLDER_FOLDERS = ("conditions", "latents")
OLDER_PARENT_SUFFIX = "_precomputed"


def precomputed_folder(path: str) -> bool:
    """Whether `path` holds finetrainers' precomputed items, which it loads with a
    map_location (a name test, and for the older layout one stat)."""
    base = os.path.basename(path)
    if base == PRECOMPUTED_DATA_DIR:
        return True
    if base not in OLDER_FOLDERS or not os.path.dirname(path).endswith(OLDER_PARENT_SUFFIX):
        return False
    return os.path.isfile(os.path.join(path, f"{base}-0-0.pt"))
