"""LTX-Video-Trainer (Lightricks/LTX-Video-Trainer): the dataset folder its preprocessing
writes into, which a bare scan must know so as not to take the dataset's own files for strays.

scripts/preprocess_dataset.py writes, by default, beside the dataset file (a CSV, JSON or
JSONL listing captions and media paths relative to it): `<dataset dir>/.precomputed/` with
`latents/` and `conditions/` (and `reference_latents/` for IC-LoRA, `decoded_videos/` with
`--decode`), each file `<media path>.pt` mirroring the media's folders. The trainer's
`data.preprocessed_data_root` may name either folder (src/ltxv_trainer/datasets.py
PrecomputedDataset: "If the given path is the dataset root, use the precomputed
sub-directory"). Scanned bare, the dataset dir's files (its dataset file, media, captions) are
the dataset's, not stray files of a cache; `.precomputed/` holds the caches, whose latents
are packed sequences `[F*H*W, 128]` of each bucket's size and need no layout of their own.
"""

from __future__ import annotations

import os

PRECOMPUTED_DIR = ".precomputed"
SOURCES = ("latents", "conditions")  # PrecomputedDataset's default data_sources


def dataset_folder(path: str) -> bool:
    """A dataset dir holding LTX-Video-Trainer's `.precomputed/latents` or `conditions`."""
    return any(os.path.isdir(os.path.join(path, PRECOMPUTED_DIR, s)) for s in SOURCES)
