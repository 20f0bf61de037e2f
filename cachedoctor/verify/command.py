"""The `cachedoctor verify` command's work, kept out of cli.py: check the options, resolve the
targets and the encoder, run, and print. Usage problems are one line and exit 2."""

from __future__ import annotations

import sys

from cachedoctor.findings import printable
from cachedoctor.verify.run import VerifyOptions
from cachedoctor.verify.sample import SampleError, SampleSize


class UsageError(Exception):
    """A bad option or target; str() is the one line to print."""


def verify(targets: list[str], encoder: str | None, sample: str, device: str, seed: int, batch_size: int,
           fmt: str, fail_on: str, quiet: bool, text_encoder: str | None = None) -> int:
    """Run verify and print its report; the exit code (UsageError for bad options)."""
    if encoder is None and text_encoder is None:
        raise UsageError("give --encoder SPEC (latents), --text-encoder SPEC (caption embeddings), or both")
    if fmt not in ("text", "json"):
        raise UsageError(f"unknown --format {fmt!r}: expected text or json")
    if fail_on not in ("error", "warning", "info", "never"):
        raise UsageError(f"unknown --fail-on {fail_on!r}: expected error, warning, info or never")
    if device != "cpu" and not device.startswith("cuda"):
        raise UsageError(f"unknown --device {device!r}: expected cpu or cuda")
    if batch_size < 1:
        raise UsageError("--batch-size must be at least 1")
    try:
        size = SampleSize.parse(sample)
    except SampleError as exc:
        raise UsageError(str(exc)) from None
    from cachedoctor.layouts import TargetError, resolve
    from cachedoctor.repair.encoders import EncoderError
    from cachedoctor.repair.encoders import resolve as resolve_encoder
    from cachedoctor.verify.text_encoders import resolve as resolve_text_encoder

    try:
        layouts = resolve(targets)
        chosen = resolve_encoder(encoder) if encoder is not None else None
        chosen_text = resolve_text_encoder(text_encoder) if text_encoder is not None else None
    except (TargetError, EncoderError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise UsageError(f"--device {device}: no CUDA device here (torch.cuda.is_available() is False)")
    from cachedoctor.verify.report import write_json, write_text
    from cachedoctor.verify.run import run

    def progress(line: str) -> None:
        if not quiet:
            print(printable(line), file=sys.stderr, flush=True)  # a dataset id is the config's text

    try:
        report = run(layouts, chosen, VerifyOptions(size, seed, device, batch_size), progress, chosen_text)
    except EncoderError as exc:
        raise UsageError(str(exc)) from None
    (write_json if fmt == "json" else write_text)(report, sys.stdout)
    return report.exit_code(fail_on)
