"""reencode: quarantined entries whose image is known, and missing entries, written again in the
trainer's own naming, container, layout and dtype, loadable with the trainer's own call."""

from __future__ import annotations

import gzip
import hashlib
import io
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import safetensors
import safetensors.torch
import torch
from repair_helpers import MARKER, isolated_state, kept_digest, tree_digest  # noqa: F401

from cachedoctor.fix_kinds import QUARANTINE, REENCODE
from cachedoctor.fixtures import clean, unsafe_pickle
from cachedoctor.fixtures.clean import aitoolkit_metadata, kohya_arrays
from cachedoctor.fixtures.images import write_png
from cachedoctor.fixtures.latents import TinyVAE, image_batch, latent_batch
from cachedoctor.formats import read_path
from cachedoctor.images import load as load_image
from cachedoctor.repair import build_plan, recover_caches, undo_run
from cachedoctor.repair.encoders import EncoderError, ReferenceEncoder, resolve
from cachedoctor.repair.plan import Reencode
from cachedoctor.repair.reencode import EntryFormat, NoFormat, ReencodeTarget, format_of, neighbour_format

from conftest import run_cli, scan_paths

SIDE = 512  # pixels: LATENT_SHAPE's [4, 64, 64] times the VAE factor 8


def images_for(directory: Path, n: int, seed: int = 0) -> list[Path]:
    """PNGs with the pixels of `latent_batch(n, seed=seed)`'s images, one per latent."""
    directory.mkdir(parents=True, exist_ok=True)
    return [write_png(directory / f"img_{i:03d}.png", SIDE, SIDE, seed=(seed, i)) for i in range(n)]


def fix_with(cache: Path, reencode: Reencode, deep: bool = False):
    recover_caches([str(cache)])
    plan = build_plan(scan_paths(cache, deep=deep), [str(cache)], reencode)
    return plan, plan.execute()


def test_the_reference_encoder_is_the_fixtures_encoder(tmp_path: Path) -> None:
    [png] = images_for(tmp_path, 1)
    image = load_image(str(png))
    assert torch.equal(image, image_batch(1, SIDE, SIDE)[0])
    latent = ReferenceEncoder().encode(image, 4).half()
    assert torch.equal(latent.view(torch.int16), latent_batch(1)[0].view(torch.int16))


def trainer_load(path: Path) -> object:
    """SimpleTuner's loading call for its containers: gzip.decompress first where gzipped."""
    data = path.read_bytes()
    return torch.load(io.BytesIO(gzip.decompress(data)) if data[:2] == b"\x1f\x8b" else path,
                      weights_only=True, map_location="cpu")


@pytest.mark.parametrize(("container", "dtype"), [("zip", "float16"), ("gzip", "bfloat16"), ("legacy", "float32")])
def test_quarantined_entries_are_written_again_as_their_neighbours_are(container: str, dtype: str,
                                                                        tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    latents = clean.build(cache, n=6, container=container, dtype=dtype)
    images = images_for(tmp_path / "images", 6)
    originals = {p.name: trainer_load(p) for p in latents}
    latents[1].write_bytes(latents[1].read_bytes()[:5000])  # cut short (CD101)
    latents[2].write_bytes(b"")  # empty (CD102)
    unsafe_pickle.build(cache, marker=tmp_path / MARKER, how=container, name="latent_003")  # CD105
    broken = tree_digest(cache)
    sources = {str(p): str(i) for p, i in zip(latents, images, strict=True)}

    plan, result = fix_with(cache, Reencode(ReferenceEncoder(), sources))

    assert [a.kind for a in plan.actions] == [QUARANTINE] * 3 + [REENCODE] * 3
    assert not result.failed
    for path, image in zip(latents[1:4], images[1:4], strict=True):
        value, original = trainer_load(path), originals[path.name]
        assert path.read_bytes()[:2] == latents[0].read_bytes()[:2], "the neighbours' container"
        assert (value.dtype, value.shape) == (original.dtype, original.shape)
        encoded = ReferenceEncoder().encode(load_image(str(image)), 4).to(value.dtype)
        assert torch.equal(value, encoded)
        # the trainer encoded a batch, we one image: the same latent up to rounding
        assert torch.allclose(value.float(), original.float(), atol=0.02, rtol=0.01)
    assert not scan_paths(cache).findings and not (tmp_path / MARKER).exists()
    kept = kept_digest(cache, result.run_id)
    assert kept == {k: broken[k] for k in ("latent_001.pt", "latent_002.pt", "latent_003.pt")}

    undo_run(result.run_id, [str(cache)])
    assert tree_digest(cache) == broken


def test_an_entry_without_a_known_image_is_only_quarantined(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    latents = clean.build(cache, n=3)
    latents[0].write_bytes(b"")

    plan, result = fix_with(cache, Reencode(ReferenceEncoder(), {}))

    assert [a.kind for a in plan.actions] == [QUARANTINE]
    [note] = [n for n in plan.notes if n.skipped]
    assert "source image is unknown" in note.message
    assert not latents[0].exists() and not result.failed


def trainer_targets(tmp_path: Path) -> list[tuple[ReencodeTarget, object]]:
    """Missing entries (CD404) of each trainer, as their layouts describe them, with the
    loading call the trainer uses."""
    image = str(images_for(tmp_path / "images", 1, seed=7)[0])
    stem = "img_000"
    size = (SIDE, SIDE)
    tag, metadata = aitoolkit_metadata(f"{stem}.png", (4, 64, 64))
    kohya_extras = {k: v for k, v in kohya_arrays(torch.zeros(4, 64, 64)).items() if k != "latents"}
    simpletuner = tmp_path / "simpletuner" / f"{hashlib.sha256(stem.encode()).hexdigest()}.pt"
    onetrainer = tmp_path / "onetrainer" / "image" / ("a" * 64) / "variation-0" / "3.pt"
    kohya = tmp_path / "kohya" / f"{stem}_{size[0]:04d}x{size[1]:04d}_sdxl.npz"
    aitoolkit = tmp_path / "aitoolkit" / "_latent_cache" / f"{stem}_{tag}.safetensors"
    for path in (simpletuner, onetrainer, kohya, aitoolkit):
        path.parent.mkdir(parents=True)

    def np_load(path: Path) -> dict:
        with np.load(path, allow_pickle=False) as npz:
            return {k: npz[k] for k in npz.files}

    return [
        (ReencodeTarget(image, str(simpletuner), EntryFormat("gzip", None, "bfloat16", 4, scaled=True)),
         lambda: trainer_load(simpletuner)),
        (ReencodeTarget(image, str(onetrainer), EntryFormat(
            "zip", "latent_image", "float16", 4,
            extras={"original_resolution": (SIDE, SIDE), "crop_offset": (0, 0)})),
         lambda: trainer_load(onetrainer)["latent_image"]),
        (ReencodeTarget(image, str(kohya), EntryFormat("npz", "latents", "float32", 4, extras=kohya_extras)),
         lambda: np_load(kohya)["latents"]),
        (ReencodeTarget(image, str(aitoolkit), EntryFormat("safetensors", "latent", "bfloat16", 4,
                                                           scaled=True, metadata=metadata)),
         lambda: safetensors.torch.load_file(aitoolkit)["latent"]),
    ]


def test_missing_entries_of_each_trainer_load_with_the_trainers_own_call(tmp_path: Path) -> None:
    jobs = trainer_targets(tmp_path)
    roots = [str(Path(t.path).parent) for t, _ in jobs]
    expected = TinyVAE(4, 0).encode(image_batch(1, SIDE, SIDE, seed=7), "float32")[0]

    plan = build_plan(scan_paths(*roots), roots, Reencode(ReferenceEncoder(), targets=tuple(t for t, _ in jobs)))
    result = plan.execute()

    assert [a.kind for a in plan.actions] == [REENCODE] * 4 and not result.failed
    for target, load in jobs:
        value = load()
        value = value if isinstance(value, torch.Tensor) else torch.from_numpy(value)
        fmt = target.format
        assert str(value.dtype).removeprefix("torch.") == fmt.dtype
        assert tuple(value.shape) == (4, 64, 64)
        assert torch.equal(value, expected.to(value.dtype)), target.path
        assert format_of_written(target.path) == (fmt.container, fmt.key, fmt.dtype)
    assert dict(safetensors.safe_open(jobs[3][0].path, "np").metadata()) == dict(jobs[3][0].format.metadata)
    assert not scan_paths(*roots).findings

    undo_run(result.run_id, roots)
    assert not any(Path(t.path).exists() for t, _ in jobs)


def format_of_written(path: str) -> tuple:
    meta = read_path(path)
    assert not meta.errors and not meta.unsafe_globals
    latent = max(meta.tensors, key=lambda t: t.numel)
    container = {"torch-zip": "gzip" if meta.compression else "zip", "safetensors": "safetensors",
                 "npz": "npz"}[meta.format]
    return container, latent.path[0] if latent.path else None, latent.dtype


def test_a_new_entry_never_overwrites_one_that_appeared_meanwhile(tmp_path: Path) -> None:
    [image] = images_for(tmp_path / "images", 1)
    cache = tmp_path / "cache"
    clean.build(cache, n=1)
    target = ReencodeTarget(str(image), str(cache / "new.pt"), EntryFormat("zip", None, "float16", 4))
    plan = build_plan(scan_paths(cache), [str(cache)], Reencode(ReferenceEncoder(), targets=(target,)))
    (cache / "new.pt").write_bytes(b"written by a trainer meanwhile")

    [outcome] = plan.execute().outcomes

    assert outcome.state == "skipped" and (cache / "new.pt").read_bytes() == b"written by a trainer meanwhile"


@pytest.mark.parametrize(
    ("writer", "why"),
    [
        (lambda d: clean.kohya_npz(d, 2), "3 tensors"),
        (lambda d: clean.safetensors_latents(d, 2), "header metadata"),
        (lambda d: clean.build(d, 2) and [torch.save({"latents": torch.zeros(4, 8, 8)}, d / f"d{i}.pt")
                                          for i in range(2)], None),
    ],
)
def test_neighbour_formats_that_only_a_trainer_layout_can_write(writer, why: str | None, tmp_path: Path) -> None:
    writer(tmp_path)
    if why is None:  # bare tensors beside dicts: the bare ones, being healthy and simple, set it
        fmt = neighbour_format(str(tmp_path / "latent_000.pt"))
        assert (fmt.container, fmt.key, fmt.dtype, fmt.channels) == ("zip", None, "float16", 4)
        with pytest.raises(NoFormat, match="dicts"):
            format_of(read_path(str(tmp_path / "d0.pt")))
        return
    ext = ".npz" if "tensors" in why else ".safetensors"
    with pytest.raises(NoFormat, match=why):
        neighbour_format(str(tmp_path / f"missing{ext}"))


def test_neighbours_that_are_broken_do_not_count(tmp_path: Path) -> None:
    clean.build(tmp_path, n=2, container="legacy")
    for i in range(3):
        (tmp_path / f"broken_{i}.pt").write_bytes(b"PK\x03\x04 garbage")
    fmt = neighbour_format(str(tmp_path / "new.pt"))
    assert (fmt.container, fmt.dtype, fmt.channels, fmt.batch_dim) == ("legacy", "float16", 4, False)
    with pytest.raises(NoFormat, match=r"broken_0\.pt is itself broken"):
        neighbour_format(str(tmp_path / "new.pt"), exclude=[str(p) for p in tmp_path.glob("latent_*.pt")])
    with pytest.raises(NoFormat, match=r"no healthy \.npz file beside it"):
        neighbour_format(str(tmp_path / "new.npz"))


def write_module(directory: Path, name: str, body: str) -> None:
    (directory / f"{name}.py").write_text(textwrap.dedent(body))


def test_a_module_callable_encoder_and_its_scaling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_module(tmp_path, "my_vae", """
        import torch
        from cachedoctor.fixtures.latents import TinyVAE

        def encode(image):
            return TinyVAE(4, 0).encode(image[None], "float32")
        encode.scaling_factor = 0.5
        encode.shift_factor = 0.25

        def wrong_channels(image):
            return TinyVAE(16, 0).encode(image[None], "float32")[0]

        def not_a_tensor(image):
            return image.numpy()
    """)
    monkeypatch.syspath_prepend(str(tmp_path))
    [image] = images_for(tmp_path / "images", 1)
    cache = tmp_path / "cache"
    clean.build(cache, n=1)
    fmt = EntryFormat("zip", None, "float32", 4, scaled=True)
    raw = TinyVAE(4, 0).encode(image_batch(1, SIDE, SIDE), "float32")[0]

    target = ReencodeTarget(str(image), str(cache / "scaled.pt"), fmt)
    plan = build_plan(scan_paths(cache), [str(cache)], Reencode(resolve("my_vae:encode"), targets=(target,)))
    result = plan.execute()
    assert not result.failed
    assert torch.equal(torch.load(cache / "scaled.pt", weights_only=True), (raw - 0.25) * 0.5)

    before = tree_digest(cache)
    for spec, message in (("my_vae:wrong_channels", "gives 16 channels"), ("my_vae:not_a_tensor", "not a tensor")):
        target = ReencodeTarget(str(image), str(cache / "bad.pt"), fmt)
        result = build_plan(scan_paths(cache), [str(cache)], Reencode(resolve(spec), targets=(target,))).execute()
        [failed] = result.failed
        assert message in failed.message
        assert tree_digest(cache) == before


def test_a_diffusers_autoencoder_is_loaded_from_a_local_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "site" / "diffusers"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(textwrap.dedent("""
        import json, os, types
        import torch
        from cachedoctor.fixtures.latents import TinyVAE

        class AutoencoderKL:
            @classmethod
            def from_pretrained(cls, path, subfolder=None, local_files_only=False):
                assert local_files_only
                with open(os.path.join(path, subfolder or "", "config.json")) as f:
                    vae = cls()
                    vae.config = types.SimpleNamespace(**json.load(f))
                return vae

            dtype = torch.float32

            def eval(self):
                return self

            def encode(self, pixels):
                assert pixels.min() >= -1 and pixels.max() <= 1
                latent = TinyVAE(self.config.latent_channels, 0).encode(pixels, "float32")
                return types.SimpleNamespace(latent_dist=types.SimpleNamespace(mode=lambda: latent))
    """))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    for name in [m for m in sys.modules if m == "diffusers" or m.startswith("diffusers.")]:
        monkeypatch.delitem(sys.modules, name)  # a real diffusers imported earlier would win
    model = tmp_path / "sdxl"
    (model / "vae").mkdir(parents=True)
    (model / "vae" / "config.json").write_text('{"latent_channels": 4, "scaling_factor": 0.13025}')
    [image] = images_for(tmp_path / "images", 1)
    cache = tmp_path / "cache"
    cache.mkdir()

    encoder = resolve(f"diffusers:{model}")
    target = ReencodeTarget(str(image), str(cache / "e.pt"), EntryFormat("zip", None, "float32", 4, scaled=True))
    result = build_plan(scan_paths(cache), [str(cache)], Reencode(encoder, targets=(target,))).execute()

    assert not result.failed
    raw = TinyVAE(4, 0).encode(image_batch(1, SIDE, SIDE), "float32")[0]
    assert torch.equal(torch.load(cache / "e.pt", weights_only=True), raw * 0.13025)
    with pytest.raises(EncoderError, match=r"no config\.json"):
        resolve(f"diffusers:{tmp_path}")


def test_cli_reencode_on_a_bare_cache_quarantines_and_says_why_it_cannot_encode(cache: Path) -> None:
    clean.build(cache, n=3)
    (cache / "latent_001.pt").write_bytes(b"")

    result = run_cli("fix", str(cache), "--yes", "--reencode", "--encoder", "reference")

    assert result.returncode == 0, result.stderr
    assert "no re-encode: its source image is unknown" in result.stdout
    assert not (cache / "latent_001.pt").exists()
