"""## What it does
Reports a latent whose spatial size is not what its bucket needs: the bucket's pixel size
divided by the VAE factor. The bucket size comes from the trainer: SimpleTuner's `target_size`
in `aspect_ratio_bucket_metadata_<id>.json` (looked up by the sha256 of the image's stem),
kohya's bucket for the image size in the npz name under the dataset's bucket settings,
OneTrainer's `crop_resolution` in `aggregate.pt`, ai-toolkit's `crop_width`/`crop_height` in
the safetensors header, musubi-tuner's bucket for the size in the file name. A OneTrainer
sample cached before 2024-07-14 is judged by the mean of its `latent_image_distribution`, the
latent its loader trained on. musubi's factor is 16 for FLUX.2, Ideogram 4, ERNIE-Image and
HunyuanVideo 1.5 and 8 for the others; Wan (whose factor depends on the model) and HiDream-O1
expect no size. A Kandinsky 5 latent cached with musubi's `--nabla_resize` may be the bucket
rounded up to a multiple of 128 px instead. SimpleTuner's factor is its `--model_family`'s: 8 for most, 16 for FLUX.2,
ERNIE and Ideogram (patchified before caching), HunyuanVideo 1.5 and Wan 2.2 TI2V-5B, 32 for
Sana and LTX-Video; a family whose cached latents cachedoctor does not know expects no size.

kohya's FLUX, SD3, Lumina, Anima and HunyuanImage npz (and SD/SDXL ones from sd-scripts with
PR #2269) key each latent by its size (`latents_<h>x<w>`) and may hold several. Such a file
is judged by the key of its bucket: one without it is reported only when the config sets
`skip_cache_check` (or the deprecated `skip_latents_validity_check`, which sd-scripts' full
FLUX, SD3, Lumina and Anima fine-tune scripts take for it; it is read for those npz only).
Under `skip_cache_check`, a subset with `flip_aug` also needs the flipped latent of the key
it loads (`latents_flipped_<h>x<w>`; `latents_flipped` in SD/SDXL and legacy `<stem>.npz`
files): a file without it is reported too. Datasets that share an image dir (one set of images
trained at two resolutions) share its npz files: each file is judged for every one of them,
and reported for the first whose bucket it fails.

## Why is this bad?
The trainer does not check: kohya's `is_disk_cached_latents_expected` looks only for keys, and
SimpleTuner trusts a file that exists. A latent made at another resolution (the config changed,
the bucket settings changed, a file was copied from another run) is stacked with the right-sized
latents of its bucket and training stops at `torch.stack`, or it trains on a wrongly scaled
sample without a word.

kohya's size-keyed npz are the exception: sd-scripts encodes an image again when its file lacks
the bucket's key, and adds the key to the file. With `skip_cache_check` it trusts any file that
exists, and training stops with `ValueError: latents_<h>x<w> not found in <file>` when it first
loads that image, for whichever dataset's bucket lacks its key. A missing flipped latent loads
as None, and the first sample of that image that flip_aug mirrors (half of them, at random)
stops training with `TypeError: new(): data must be a sequence (got NoneType)`. sd-scripts also
reads `original_size` and `crop_ltrb` (with the latent's suffix) from every file it loads, and
checks neither: a file without them stops training with `KeyError`, `skip_cache_check` or not.
An ai-toolkit entry without its `latent` tensor (one holding only the pixel `tensor` of
`cache_tensors_to_disk`, say) is trusted because it exists, and stops training with
`KeyError: 'latent'`.

## Example
```
CD302 error train/10_person/img_0042_1024x0768_sdxl.npz
      latent is 128x128 (h x w); bucket 1152x896 needs 112x144: it was encoded at another resolution
CD302 error train/10_person/img_0007_0768x1024_flux.npz
      no latents_128x96 for bucket 768x1024 (it holds a 64x48 latent): with skip_cache_check,
      sd-scripts does not encode it again and stops with ValueError when it loads the file
CD302 error train/10_person/img_0003_1024x1024_flux.npz
      no latents_flipped_128x128 for bucket 1024x1024: with flip_aug and skip_cache_check,
      sd-scripts does not encode it again; it loads None for the flipped latent and stops
      with TypeError at the first sample it flips
CD302 error train/10_person/img_0011_0640x0480_sdxl.npz
      no crop_ltrb for bucket 576x448: sd-scripts' validity check looks only for the latents,
      so it loads this file and stops with KeyError: 'crop_ltrb is not a file in the archive'
```

## Fix
`cachedoctor fix` quarantines the file; `--reencode` encodes it again at the bucket's size (a
kohya npz keeps the keys of its other resolutions, and gets its flipped latent with flip_aug).
A quarantined kohya npz is cached again by sd-scripts, `skip_cache_check` or not: it only
trusts files that exist.
"""

from __future__ import annotations

from collections.abc import Iterator

from cachedoctor.findings import Finding, Severity
from cachedoctor.fix_kinds import FixKind
from cachedoctor.formats.meta import NPZ
from cachedoctor.inventory import LATENT
from cachedoctor.layouts.kohya import MULTI_RESOLUTION
from cachedoctor.rule import Rule, RuleContext, Selector
from cachedoctor.summary import DatasetView, FileSummary, Group


def wrong(role: str, shape: tuple[int, ...] | None, expected: tuple[int, int] | None) -> bool:
    return (role == LATENT and expected is not None and shape is not None and len(shape) >= 2
            and tuple(shape[-2:]) != expected)


def fails(s: Group | FileSummary) -> bool:
    """A latent of the wrong size, or one lacking a key its trainer reads (kohya's
    original_size, crop_ltrb or flipped latent, see layouts/kohya.lacking; ai-toolkit's
    `latent`)."""
    return wrong(s.role, s.shape, s.expected) or (s.role == LATENT and s.lacks is not None)


def select(view: DatasetView, ctx: RuleContext) -> Selector | None:
    """The latents of the wrong size or lacking a key: each is a finding."""
    if not any(map(fails, view.tally())):
        return None
    return lambda s: (None, None) if fails(s) else None


def check_dataset(view: DatasetView, ctx: RuleContext) -> Iterator[Finding]:
    if not any(map(fails, view.tally())):
        return
    for s in view:
        if not fails(s):
            continue
        if not wrong(s.role, s.shape, s.expected):
            yield RULE.finding(s.path, _lacking(s), ctx, bucket=s.bucket, missing=s.lacks)
            continue
        (h, w), (eh, ew) = s.shape[-2:], s.expected
        if s.format == NPZ and s.family in MULTI_RESOLUTION and s.lacks == f"latents_{eh}x{ew}":
            # kohya's summary holds another size only under skip_cache_check (kohya.loaded_shape);
            # a file holding the bucket's key at another size gets the message below
            message = (f"no latents_{eh}x{ew} for bucket {s.bucket} (it holds a {h}x{w} latent): "
                       "with skip_cache_check, sd-scripts does not encode it again and stops "
                       "with ValueError when it loads the file")
        else:
            message = (f"latent is {h}x{w} (h x w); bucket {s.bucket} needs {eh}x{ew}: it was "
                       "encoded at another resolution")
        yield RULE.finding(s.path, message, ctx, bucket=s.bucket, actual=[h, w],
                           expected=[eh, ew], shape=list(s.shape))


def _lacking(s: Group | FileSummary) -> str:
    """The message for a latent file lacking a key its trainer reads (CacheFacts.lacks)."""
    if s.lacks == "latent":  # ai-toolkit (layouts/aitoolkit.header_facts)
        return ("no `latent` tensor: ai-toolkit trusts an entry that exists and stops with "
                "KeyError: 'latent' when it loads it")
    bucket = f" for bucket {s.bucket}" if s.bucket else ""
    if s.lacks.startswith("latents_") and not s.lacks.startswith("latents_flipped"):
        return (f"no {s.lacks}{bucket}: with skip_cache_check, sd-scripts does not encode it "
                "again and stops with ValueError when it loads the file")
    if s.lacks.startswith("latents_flipped"):
        return (f"no {s.lacks}{bucket}: with flip_aug and skip_cache_check, sd-scripts does not "
                "encode it again; it loads None for the flipped latent and stops with TypeError "
                "at the first sample it flips")
    return (f"no {s.lacks}{bucket}: sd-scripts' validity check looks only for the latents, so "
            f"it loads this file and stops with KeyError: '{s.lacks} is not a file in the "
            "archive'")


RULE = Rule(
    code="CD302",
    name="latent-size-mismatch",
    severity=Severity.ERROR,
    summary="a latent's spatial size is not its bucket's size / VAE factor (trainer metadata)",
    doc=__doc__,
    fix=FixKind.QUARANTINE,
    check_dataset=check_dataset,
    select=select,
)
