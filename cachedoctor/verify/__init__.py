"""`cachedoctor verify`: re-encode a sample of cache entries from their images and compare.

The metadata checks cannot see a latent encoded by another VAE of the same shape, stored with
another scaling factor, of a flipped or shifted crop, of another image, or of an image edited
since: the values are all well-formed. `verify` takes a reproducible random sample of each
dataset's entries (sample.py), encodes their source images again with the trainer's own
geometry as the layout describes it (the same `EntrySpec` that `fix --reencode` writes from,
encode.py), compares the cached latent with the fresh one (compare.py) and names what went
wrong with a CD6xx rule (diagnose.py). With a text encoder it does the same for caption
embeddings (text.py): each file paired with its caption as its trainer pairs them (captions.py),
embedded again (text_encoders.py), CD607 and CD608. It reads the cache, the images and the
captions; it never writes.
"""

from cachedoctor.verify.run import VerifyOptions, VerifyReport, run

__all__ = ["VerifyOptions", "VerifyReport", "run"]
