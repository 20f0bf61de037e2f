"""verify's output: a text summary per dataset (the distribution of each metric, the findings
and the throughput), or the same as one JSON object."""

from __future__ import annotations

import json
import os
from typing import IO, Any

from cachedoctor.findings import display_path, printable
from cachedoctor.verify.run import VerifyReport


def as_json(report: VerifyReport) -> dict[str, Any]:
    options = report.options
    return {
        "encoder": report.encoder, "device": options.device, "seed": options.seed,
        "sample": str(options.sample), "batch_size": options.batch_size,
        "datasets": [d.as_dict() for d in report.datasets],
        "findings": [f.to_dict() for f in report.findings],
        "images_encoded": report.images, "encode_seconds": round(report.seconds, 3),
        "images_per_second": round(report.images_per_second, 2),
        "text_encoder": report.text_encoder, "captions_embedded": report.captions,
        "embed_seconds": round(report.text_seconds, 3),
    }


def write_json(report: VerifyReport, out: IO[str]) -> None:
    json.dump(as_json(report), out, indent=2)
    out.write("\n")


def write_text(report: VerifyReport, out: IO[str]) -> None:
    options = report.options
    encoders = ", ".join(f"{what} {spec}" for what, spec in (("encoder", report.encoder),
                                                            ("text encoder", report.text_encoder)) if spec)
    out.write(f"cachedoctor verify: {encoders}, device {options.device}, "
              f"sample {options.sample} per dataset, seed {options.seed}\n")
    for dataset in report.datasets:
        where = display_path(dataset.cache_dir, os.getcwd()) if dataset.cache_dir else ""
        what = f"{dataset.trainer}, caption embeddings" if dataset.kind == "text" else dataset.trainer
        out.write(f"\n{printable(dataset.id)} ({what}) {where}\n")
        if dataset.note:
            out.write(f"  not verified: {printable(dataset.note)}\n")
            continue
        compared = dataset.compared
        skipped = [c for c in dataset.checked if c.verdict == "skipped"]
        bad = [c for c in compared if c.verdict != "ok"]
        out.write(f"  {len(dataset.checked)} of {dataset.entries} entries sampled, {len(compared)} "
                  f"compared, {len(compared) - len(bad)} match, {len(bad)} do not\n")
        for metric, values in dataset.distribution().items():
            tail = "p5" if "p5" in values else "p95"
            out.write(f"  {metric:<9} min {values['min']:.4f}  median {values['median']:.4f}  "
                      f"{tail} {values[tail]:.4f}  max {values['max']:.4f}\n")
        for c in skipped[:5]:
            out.write(f"  skipped {printable(os.path.basename(c.entry))}: {printable(c.note)}\n")
        if len(skipped) > 5:
            out.write(f"  ... {len(skipped) - 5} more skipped (--format json lists them)\n")
    if report.findings:
        out.write("\n")
    for finding in report.findings:
        out.write(f"{finding.code} {finding.severity} {display_path(finding.path, os.getcwd())}\n"
                  f"      {printable(finding.message)}\n")
    work = []
    if report.encoder is not None:
        work.append(f"{report.images} images encoded in {report.seconds:.1f} s "
                    f"({report.images_per_second:.1f} images/s on {options.device})")
    if report.text_encoder is not None:
        work.append(f"{report.captions} captions embedded in {report.text_seconds:.1f} s")
    out.write(f"\n{len(report.findings)} finding{'s' * (len(report.findings) != 1)}; {'; '.join(work)}\n")
