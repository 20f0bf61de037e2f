"""`cachedoctor verify --text-encoder`: a sample of caption embeddings against fresh embeddings of
their captions, in the layouts that say which caption each file embedded (kohya, musubi-tuner,
SimpleTuner). The caches are written as the trainers write them, by the reference text encoder
(a seeded table of word vectors); tests/verify/test_verify_transformers.py does the same with a
real transformers CLIPTextModel."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from verify_helpers import TEXT_EMBEDDERS, digest

from cachedoctor.fixtures.projects import aitoolkit, kohya, musubi, onetrainer, simpletuner
from cachedoctor.layouts import resolve
from cachedoctor.verify import VerifyOptions, run
from cachedoctor.verify.sample import SampleSize
from cachedoctor.verify.text_encoders import ReferenceTextEncoder

from conftest import invoke

BUILDERS = {"kohya": kohya.build, "musubi": musubi.build, "simpletuner": simpletuner.build,
            "onetrainer": onetrainer.build}
ALL = SampleSize.parse("all")


def verify_text(project, seed: int = 0, **options):
    return run(resolve([str(project.config)]), None, VerifyOptions(**options),
               text_encoder=ReferenceTextEncoder(seed))


def text_results(report):
    return [d for d in report.datasets if d.kind == "text"]


@pytest.fixture(params=list(BUILDERS))
def trainer(request) -> str:
    return request.param


def test_embeddings_of_their_captions_verify_and_nothing_is_written(trainer: str, tmp_path: Path) -> None:
    project = BUILDERS[trainer](tmp_path / trainer)
    written = TEXT_EMBEDDERS[trainer](project)
    before = digest(project.root)
    report = verify_text(project, sample=ALL)
    compared = [c for d in text_results(report) for c in d.compared]
    assert not report.findings and len(compared) == len(written) >= 9
    assert max(c.close.distance for c in compared) < 0.05  # float16/bfloat16 storage only
    assert report.captions > 0 and report.images == 0
    assert digest(project.root) == before


def test_embeddings_of_another_text_encoder_are_cd608(trainer: str, tmp_path: Path) -> None:
    project = BUILDERS[trainer](tmp_path / trainer)
    TEXT_EMBEDDERS[trainer](project, seed=1)
    report = verify_text(project, sample=ALL)
    assert {f.code for f in report.findings} == {"CD608"}
    assert sum(f.details["entries"] for f in report.findings) == \
        sum(len(d.compared) for d in text_results(report))
    assert report.exit_code() == 1


def test_a_kohya_caption_edited_after_caching_is_cd607(tmp_path: Path) -> None:
    project = kohya.build(tmp_path / "kohya")
    written = TEXT_EMBEDDERS["kohya"](project)
    entry, caption_file = sorted(written.items())[3]
    caption_file.write_text("a red car parked by the sea\n")
    report = verify_text(project, sample=ALL)
    [finding] = report.findings
    assert finding.code == "CD607" and finding.path == str(entry)
    assert "'a red car parked by the sea'" in finding.message and report.exit_code("warning") == 1


def test_swapped_kohya_captions_are_cd607_naming_the_other(tmp_path: Path) -> None:
    project = kohya.build(tmp_path / "kohya")
    written = sorted(TEXT_EMBEDDERS["kohya"](project).items())
    (a, caption_a), (b, caption_b) = written[0], written[1]
    text_a, text_b = caption_a.read_text(), caption_b.read_text()
    caption_a.write_text(text_b)
    caption_b.write_text(text_a)
    report = verify_text(project, sample=ALL)
    assert sorted((f.code, f.path, f.details["matches"]) for f in report.findings) == \
        [("CD607", str(a), str(b)), ("CD607", str(b), str(a))]


def test_a_musubi_caption_edited_after_caching_is_cd607_with_the_caption_it_records(tmp_path: Path) -> None:
    """musubi records the caption it embedded (caption1): that caption embeds to the file's
    tensor, which confirms the diagnosis."""
    project = musubi.build(tmp_path / "musubi")
    written = TEXT_EMBEDDERS["musubi"](project)
    entry = next(e for e in sorted(written) if e.name == "img_001_qi_te.safetensors")
    caption_file = project.root / "images" / "img_001.txt"
    old = caption_file.read_text().strip()
    caption_file.write_text("a completely different caption\n")
    report = verify_text(project, sample=ALL)
    [finding] = report.findings
    assert finding.code == "CD607" and finding.path == str(entry)
    assert finding.details["recorded"] == old and "the caption it records" in finding.message


def test_a_simpletuner_embedding_of_another_caption_is_cd607(tmp_path: Path) -> None:
    """SimpleTuner names the file by the caption's md5: its content is of another caption."""
    project = simpletuner.build(tmp_path / "simpletuner")
    written = sorted(TEXT_EMBEDDERS["simpletuner"](project).items())
    (a, _), (b, _) = written[0], written[4]
    shutil.copyfile(b, a)
    report = verify_text(project, sample=ALL)
    [finding] = report.findings
    assert finding.code == "CD607" and finding.path == str(a) and finding.details["matches"] == str(b)


def test_the_pairing_found_is_reported(tmp_path: Path) -> None:
    """SimpleTuner's prompt_embeds hold the first encoder's penultimate state in their leading
    features: that is the pairing the sample agrees on."""
    project = simpletuner.build(tmp_path / "simpletuner")
    TEXT_EMBEDDERS["simpletuner"](project)
    [dataset] = text_results(verify_text(project, sample=ALL))
    assert dataset.details["pairing"] == {"cached": "prompt_embeds", "output": "penultimate", "features": 32}


def test_a_onetrainer_caption_edited_after_caching_is_cd607(tmp_path: Path) -> None:
    """Text sample i is of the image aggregate.pt lists at i; its caption is that image's .txt."""
    project = onetrainer.build(tmp_path / "onetrainer")
    entry, caption_file = sorted(TEXT_EMBEDDERS["onetrainer"](project).items())[6]
    caption_file.write_text("a portrait in the rain\n")
    report = verify_text(project, sample=ALL)
    assert [(f.code, f.path) for f in report.findings] == [("CD607", str(entry))]


def test_a_layout_without_caption_pairing_says_why(tmp_path: Path) -> None:
    """ai-toolkit's text cache files do not say which caption they embedded."""
    project = aitoolkit.build(tmp_path / "ai-toolkit")
    text_cache = project.root / "datasets" / aitoolkit.DATASET / "_t_e_cache"
    text_cache.mkdir()
    (text_cache / "img_000_abc.safetensors").write_bytes(b"")
    report = verify_text(project)
    [dataset] = text_results(report)
    assert not report.findings and "ai-toolkit" in dataset.note and not dataset.checked


def test_the_cli_runs_the_text_half_alone_and_both(tmp_path: Path) -> None:
    project = kohya.build(tmp_path / "kohya")
    written = TEXT_EMBEDDERS["kohya"](project)
    entry, caption_file = sorted(written.items())[2]
    caption_file.write_text("something else entirely\n")
    text = invoke("verify", str(project.config), "--text-encoder", "reference", "--fail-on", "warning")
    assert text.exit_code == 1 and "CD607 warning" in text.stdout and entry.name in text.stdout
    assert "caption embeddings" in text.stdout and "captions embedded" in text.stdout
    assert "images encoded" not in text.stdout
    both = invoke("verify", str(project.config), "--encoder", "reference", "--text-encoder", "reference",
                  "--format", "json", "-q")
    data = json.loads(both.stdout)
    assert both.exit_code == 0 and [f["code"] for f in data["findings"]] == ["CD607"]
    assert sorted(d["kind"] for d in data["datasets"]) == ["latents", "text"]
    assert data["captions_embedded"] > 0 and data["images_encoded"] == 9


def test_neither_encoder_is_one_line_and_exit_2(tmp_path: Path) -> None:
    project = kohya.build(tmp_path / "kohya")
    result = invoke("verify", str(project.config))
    assert result.exit_code == 2 and "--text-encoder" in result.stderr and len(result.stderr.splitlines()) == 1


@pytest.mark.parametrize("spec, said", [("verify_helpers:failing_text_encoder", "exploded"),
                                        ("nosuchmodule_xyz:f", "cannot import"),
                                        ("transformers:/nonexistent/dir", "")])
def test_a_text_encoder_that_fails_is_one_line_and_exit_2(spec: str, said: str, tmp_path: Path) -> None:
    project = kohya.build(tmp_path / "kohya")
    TEXT_EMBEDDERS["kohya"](project)
    result = invoke("verify", str(project.config), "--text-encoder", spec, "-q")
    assert result.exit_code == 2 and len(result.stderr.splitlines()) == 1 and said in result.stderr


def test_an_unreadable_embedding_is_skipped_and_the_others_judged(tmp_path: Path) -> None:
    project = kohya.build(tmp_path / "kohya")
    entry = sorted(TEXT_EMBEDDERS["kohya"](project))[0]
    entry.write_bytes(entry.read_bytes()[:50])
    report = verify_text(project, sample=ALL)
    [dataset] = text_results(report)
    [skipped] = [c for c in dataset.checked if c.verdict == "skipped"]
    assert skipped.entry == str(entry) and len(dataset.compared) == 8 and not report.findings
