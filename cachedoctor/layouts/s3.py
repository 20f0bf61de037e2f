"""An `s3://bucket/prefix` target given with no trainer config: a bare layout, listed from the
bucket. As a bare cache dir on disk, every "folder" (key prefix up to a slash) that holds cache
files is a dataset of its own, bucket folders belong to their parent's. What a bare dir on disk
learns by listing sub-folders before the walk (kohya image dirs, ai-toolkit `_latent_cache`,
OneTrainer aggregates) is not looked for here: a bucket has no cheap directory listing."""

from __future__ import annotations

from cachedoctor.layouts.bare import BareNaming
from cachedoctor.layouts.base import Dataset, Layout, TargetError, frozen
from cachedoctor.remote import join, split
from cachedoctor.remote.listing import check_target


def layout(url: str) -> Layout:
    """The bare Layout of `url`; a TargetError when it cannot be listed or holds nothing."""
    bucket, key = split(url)
    url = join(bucket, key)
    why = check_target(url)
    if why is not None:
        raise TargetError(why)
    name = key.rpartition("/")[2] or bucket
    return Layout("bare", None, (Dataset(name, (url,), naming=BareNaming(frozen({}), url)),))
