"""verify --text-encoder transformers:PATH with a real transformers CLIPTextModel: tiny, random
weights, saved with save_pretrained beside a CLIPTokenizer built here from a vocabulary of single
byte-level characters (no merges, nothing downloaded). The kohya cache is written as sd-scripts
writes SDXL's text encoder outputs: captions padded to 77 tokens, the penultimate hidden state.
Skipped without transformers (pip install 'cachedoctor[text]')."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from cachedoctor.fixtures.projects import kohya
from cachedoctor.layouts import resolve
from cachedoctor.verify import VerifyOptions, run
from cachedoctor.verify.sample import SampleSize
from cachedoctor.verify.text_encoders import resolve as resolve_text

from conftest import invoke

transformers = pytest.importorskip("transformers")


def byte_characters() -> list[str]:
    """The 256 printable characters byte-level BPE maps bytes to (GPT-2's table)."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def tiny_clip(directory: Path, seed: int) -> Path:
    """A 2-layer CLIPTextModel of 32 features and its tokenizer, saved as a trainer's would be."""
    directory.mkdir(parents=True)
    characters = byte_characters()
    tokens = ["<|startoftext|>", "<|endoftext|>", *characters, *(c + "</w>" for c in characters)]
    (directory / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}))
    (directory / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = transformers.CLIPTokenizer(str(directory / "vocab.json"), str(directory / "merges.txt"))
    tokenizer.save_pretrained(directory)
    torch.manual_seed(seed)
    config = transformers.CLIPTextConfig(
        vocab_size=len(tokens), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=77, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    transformers.CLIPTextModel(config).eval().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("clips")
    return tiny_clip(root / "clip", 0), tiny_clip(root / "other", 1)


def cache_text(project, clip: Path) -> dict[Path, Path]:
    """sd-scripts' SDXL `<stem>_te_outputs.npz`: hidden_state1 = the penultimate layer of the
    captions padded to 77 tokens (hidden_state2 and pool2: the second encoder's, not verified)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(clip)
    model = transformers.CLIPTextModel.from_pretrained(clip).eval()
    out = {}
    for caption_file in sorted((project.root / "train" / kohya.DATASET).glob("*.txt")):
        ids = tokenizer(caption_file.read_text().strip(), padding="max_length", max_length=77,
                        truncation=True, return_tensors="pt").input_ids
        with torch.no_grad():
            hidden = model(ids, output_hidden_states=True).hidden_states[-2][0]
        entry = caption_file.with_name(f"{caption_file.stem}_te_outputs.npz")
        rng = np.random.default_rng(0)
        np.savez(entry, hidden_state1=hidden.half().numpy(),
                 hidden_state2=rng.standard_normal((77, 64)).astype("float16"),
                 pool2=rng.standard_normal(64).astype("float16"))
        out[entry] = caption_file
    return out


def verify(project, clip: Path, device: str = "cpu"):
    return run(resolve([str(project.config)]), None,
               VerifyOptions(sample=SampleSize.parse("all"), device=device),
               text_encoder=resolve_text(f"transformers:{clip}"))


def test_a_cache_of_the_same_clip_verifies(clips, tmp_path: Path) -> None:
    project = kohya.build(tmp_path / "kohya")
    cache_text(project, clips[0])
    report = verify(project, clips[0])
    [dataset] = [d for d in report.datasets if d.kind == "text"]
    assert not report.findings and len(dataset.compared) == 9
    assert dataset.details["pairing"]["output"] == "penultimate"
    assert dataset.distribution()["distance"]["max"] < 0.05


def test_a_cache_of_another_clip_is_cd608(clips, tmp_path: Path) -> None:
    project = kohya.build(tmp_path / "kohya")
    cache_text(project, clips[1])
    assert [f.code for f in verify(project, clips[0]).findings] == ["CD608"]


def test_an_edited_caption_is_cd607_through_the_cli(clips, tmp_path: Path) -> None:
    project = kohya.build(tmp_path / "kohya")
    entry, caption_file = sorted(cache_text(project, clips[0]).items())[5]
    caption_file.write_text("a dog in the snow\n")
    result = invoke("verify", str(project.config), "--text-encoder", f"transformers:{clips[0]}",
                    "--format", "json", "-q")
    data = json.loads(result.stdout)
    assert result.exit_code == 0 and [(f["code"], f["path"]) for f in data["findings"]] == [("CD607", str(entry))]


def test_a_pipeline_dirs_second_text_encoder_is_named_with_hash_2(clips, tmp_path: Path) -> None:
    pipeline = tmp_path / "pipeline"
    for sub in ("text_encoder_2", "tokenizer_2"):
        (pipeline / sub).mkdir(parents=True)
        for f in clips[0].iterdir():
            (pipeline / sub / f.name).write_bytes(f.read_bytes())
    project = kohya.build(tmp_path / "kohya")
    cache_text(project, clips[0])
    assert not verify(project, f"{pipeline}#2").findings  # type: ignore[arg-type]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_same_on_cuda(clips, tmp_path: Path) -> None:
    project = kohya.build(tmp_path / "kohya")
    written = sorted(cache_text(project, clips[0]).items())
    clean = verify(project, clips[0], device="cuda")
    assert not clean.findings and clean.options.device == "cuda"
    written[5][1].write_text("a dog in the snow\n")
    assert [(f.code, f.path) for f in verify(project, clips[0], device="cuda").findings] == \
        [("CD607", str(written[5][0]))]
