"""Which caption each text-embedding file of a dataset is of, as its trainer pairs them.

- kohya sd-scripts: `<stem>_te_outputs.npz` (SDXL) and `<stem>_<arch>_te.npz` beside the image;
  the caption is the image's caption file, `<stem>.caption` (sd-scripts' default
  `caption_extension`) or else `<stem>.txt`, its first line stripped.
- musubi-tuner: `<stem>_<arch>_te.safetensors` in the cache directory; the caption is the one the
  dataset gives the item now (its caption file or jsonl line, read as the layout reads it), and
  the file records the caption it embedded (`caption1` metadata).
- SimpleTuner: `<md5(caption)>-<family>.pt` in the text cache dir: the name is the hash of the
  raw caption, so an image's caption (its `.txt` file, or its file name) names its entry, and an
  entry found that way is of that caption for certain.

- OneTrainer: `text/<group>/variation-0/<i>.pt` is the text of sample i, the image that
  `image/<group>/variation-0/aggregate.pt` lists at index i (paired by number, as the scan pairs
  them, when the cache holds one image and one text group); the caption is the image's `.txt`
  (the concept's default prompt source, `sample`). A caption file of several lines is skipped:
  OneTrainer draws one line per text variation.

ai-toolkit's text cache is not paired (its files do not say which caption they embedded), nor
OneTrainer's other variations and prompt sources: such a dataset is reported with a note.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass

from cachedoctor.layouts.base import Dataset
from cachedoctor.regular_files import read_small

KOHYA_TEXT = re.compile(r"^(?P<stem>.+?)(?:_te_outputs|_[a-z0-9]+_te)\.npz$")
CAPTION_BYTES = 65536  # a caption file longer than this is no caption
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".avif", ".jxl", ".tif", ".tiff")


@dataclass(frozen=True)
class TextEntry:
    """One text-embedding file and the caption its trainer would embed for it now."""

    path: str
    caption: str | None  # None: the dataset gives its item no caption (skipped, saying why)
    source: str  # where the caption comes from (a caption file, a jsonl, the file name)
    recorded: str | None = None  # the caption the file says it embedded (musubi's caption1)


class NotPaired(Exception):
    """The dataset's text entries cannot be paired with captions; str() says why."""


def text_entries(trainer: str, dataset: Dataset) -> list[TextEntry]:
    """The dataset's text-embedding files with their captions, sorted by path."""
    directory = dataset.text_cache_dir
    if directory is None or not os.path.isdir(directory):
        return []
    if trainer == "kohya":
        return _kohya(directory)
    if trainer == "musubi":
        return _musubi(directory, dataset)
    if trainer == "simpletuner":
        return _simpletuner(directory, dataset)
    if trainer == "onetrainer":
        return _onetrainer(directory, dataset)
    raise NotPaired(f"cachedoctor does not know which caption each {trainer} text-embedding file "
                    "is of")


def read_caption(path: str) -> str | None:
    """A caption file's text as the trainers read it (stripped), None if there is none."""
    raw = read_small(path, CAPTION_BYTES)  # a FIFO or /dev/zero is no caption
    if raw is None or len(raw) > CAPTION_BYTES:
        return None
    return raw.decode("utf-8", "replace").strip()


def _names(directory: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir(directory) if not n.startswith("."))
    except OSError:
        return []


def _kohya(directory: str) -> list[TextEntry]:
    out = []
    for name in _names(directory):
        match = KOHYA_TEXT.match(name)
        if match is None:
            continue
        stem = os.path.join(directory, match["stem"])
        for extension in (".caption", ".txt"):
            caption = read_caption(stem + extension)
            if caption is not None:
                # sd-scripts reads the first line of a caption file
                out.append(TextEntry(os.path.join(directory, name), caption.splitlines()[0] if caption else "",
                                     stem + extension))
                break
        else:
            out.append(TextEntry(os.path.join(directory, name), None, f"no {match['stem']}.caption or .txt"))
    return out


def _musubi(directory: str, dataset: Dataset) -> list[TextEntry]:
    from cachedoctor.formats import read_path
    from cachedoctor.layouts.musubi import TEXT_ENTRY

    captions = dataset.options.get("captions")
    out = []
    for name in _names(directory):
        match = TEXT_ENTRY.match(name)
        if match is None:
            continue
        path = os.path.join(directory, name)
        recorded = (read_path(path).metadata or {}).get("caption1")
        caption = captions.get(match["stem"]) if captions is not None else None
        where = f"the dataset's caption of {match['stem']}" if caption is not None else \
            f"the dataset gives {match['stem']} no caption"
        out.append(TextEntry(path, caption, where, recorded if isinstance(recorded, str) else None))
    return out


def _simpletuner(directory: str, dataset: Dataset) -> list[TextEntry]:
    family = dataset.model_family or ""
    found: dict[str, TextEntry] = {}
    for image_dir in dataset.image_dirs:
        for root, dirs, names in os.walk(image_dir):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for name in sorted(names):
                if not name.lower().endswith(IMAGE_EXTENSIONS):
                    continue
                stem = os.path.splitext(name)[0]
                candidates = [(read_caption(os.path.join(root, stem + ".txt")), f"{stem}.txt"),
                              (stem, f"the file name {name}")]
                for caption, source in candidates:
                    if caption is None:
                        continue
                    entry = os.path.join(directory, f"{hashlib.md5(caption.encode()).hexdigest()}-{family}.pt")
                    if entry not in found and os.path.isfile(entry):
                        found[entry] = TextEntry(entry, caption, source)
    return [found[k] for k in sorted(found)]


def _onetrainer(directory: str, dataset: Dataset) -> list[TextEntry]:
    aggregates = getattr(dataset.naming, "aggregates", None) or {}
    images = [d for d in aggregates if os.path.basename(d) == "variation-0"]
    texts = [os.path.join(directory, g, "variation-0") for g in _names(directory)
             if os.path.isdir(os.path.join(directory, g, "variation-0"))]
    if len(images) != 1 or len(texts) != 1:
        raise NotPaired(f"the OneTrainer cache holds {len(images)} image and {len(texts)} text "
                        "groups: cachedoctor pairs text samples with images only for one of each")
    listed, text_dir = aggregates[images[0]], texts[0]
    out = []
    for name in _names(text_dir):
        stem, extension = os.path.splitext(name)
        if extension != ".pt" or not stem.isdigit():
            continue
        path = os.path.join(text_dir, name)
        image = listed[int(stem)][0] if int(stem) < len(listed) else None
        if image is None:
            out.append(TextEntry(path, None, f"aggregate.pt lists no image at index {stem}"))
            continue
        caption_file = os.path.splitext(image)[0] + ".txt"
        caption = read_caption(caption_file)
        if caption is None or "\n" in caption:
            why = "no caption file" if caption is None else "a caption file of several lines"
            out.append(TextEntry(path, None, f"{why} {os.path.basename(caption_file)}"))
            continue
        out.append(TextEntry(path, caption, caption_file))
    return out
