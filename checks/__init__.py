"""The rule catalogue: one module per rule, registered here in one table.

Codes are a public contract: never renumber, only add.

This folder sits at the top of the repository, beside `cachedoctor/`, not inside it: that is
the project's declared layout, since the rules (each with its explanation as docstring) are
browsed and reviewed as files of their own. It installs as `cachedoctor.checks`: pyproject's
`[tool.setuptools.package-dir]` maps the package to this folder, for `pip install .` and for
`pip install -e .` alike, so code imports it only by that name.
"""

from __future__ import annotations

from cachedoctor.checks import (
    bucket_shape_mismatch,
    cache_name_collision,
    caption_changed,
    checker_error,
    checksum_mismatch,
    clear_each_epoch_multi_process,
    duplicate_dtype_variants,
    embedded_by_another_text_encoder,
    empty_file,
    encoded_by_another_vae,
    flipped_latent,
    foreign_file,
    frame_count_mismatch,
    gzip_not_read,
    image_cache_overlap,
    interrupted_write,
    invalid_config,
    io_error,
    key_declaration_mismatch,
    latent_size_mismatch,
    missing_cache_entries,
    missing_path,
    missing_text_entry,
    mixed_architectures,
    mixed_devices,
    mixed_dtypes,
    mixed_latent_channels,
    non_finite_values,
    orphan_cache_entries,
    paired_with_another_image,
    retained_batch_storage,
    sample_lacks_key,
    scaling_factor_differs,
    shared_cache_dir,
    stale_cache_entry,
    stale_caption_embedding,
    stale_latent,
    tensors_on_accelerator,
    text_embed_mismatch,
    unreadable_archive,
    unsafe_pickle,
    wrong_crop,
    zeroed_values,
)
from cachedoctor.rule import Rule

RULES: dict[str, Rule] = {
    module.RULE.code: module.RULE
    for module in (
        io_error,
        checker_error,
        unreadable_archive,
        empty_file,
        checksum_mismatch,
        interrupted_write,
        unsafe_pickle,
        non_finite_values,
        foreign_file,
        zeroed_values,
        gzip_not_read,
        sample_lacks_key,
        retained_batch_storage,
        bucket_shape_mismatch,
        latent_size_mismatch,
        mixed_latent_channels,
        mixed_dtypes,
        text_embed_mismatch,
        key_declaration_mismatch,
        duplicate_dtype_variants,
        frame_count_mismatch,
        mixed_architectures,
        image_cache_overlap,
        shared_cache_dir,
        clear_each_epoch_multi_process,
        missing_cache_entries,
        orphan_cache_entries,
        stale_cache_entry,
        cache_name_collision,
        missing_path,
        invalid_config,
        stale_caption_embedding,
        missing_text_entry,
        tensors_on_accelerator,
        mixed_devices,
        encoded_by_another_vae,
        scaling_factor_differs,
        flipped_latent,
        wrong_crop,
        paired_with_another_image,
        stale_latent,
        caption_changed,
        embedded_by_another_text_encoder,
    )
}


def get(code: str) -> Rule | None:
    """The rule with this code, or with this name (`retained-batch-storage`)."""
    code = code.strip()
    return RULES.get(code.upper()) or next((r for r in RULES.values() if r.name == code), None)
