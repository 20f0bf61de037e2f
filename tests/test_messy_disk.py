"""A folder of several projects, scanned bare: each cache is judged as if scanned alone.

Users point the scan at whatever folder holds their training work: a OneTrainer project, a
SimpleTuner project and stray caches side by side. Nothing there may judge its neighbours.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from cachedoctor.fixtures import corpus, device_tagged

from conftest import by_code, codes, scan_paths


@pytest.fixture(scope="module")
def projects(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("work")
    corpus.build("onetrainer", root / "onetrainer-project")  # mgds saves on cuda:0
    corpus.build("simpletuner", root / "simpletuner-project")
    return root


def test_a_folder_of_projects_scans_clean(projects: Path) -> None:
    # each project alone is clean, and so is the folder that holds them both
    assert codes(scan_paths(projects / "onetrainer-project")) == set()
    assert codes(scan_paths(projects / "simpletuner-project")) == set()
    assert scan_paths(projects).findings == ()


def test_a_onetrainer_cache_deep_in_a_bare_tree_keeps_its_loader(projects: Path) -> None:
    # the cache's parent: no aggregate.pt at a depth the bare layout looks, yet each
    # `<sha256>/variation-<n>` folder shows mgds, which loads with map_location
    assert scan_paths(projects / "onetrainer-project" / "workspace-cache").findings == ()


def test_devices_are_compared_within_one_folder_of_a_bare_tree(tmp_path: Path) -> None:
    for i in range(3):
        device_tagged.build(tmp_path / "gpu-cache", "cuda:0", seed=i, name=f"{i:04d}")
        device_tagged.build(tmp_path / "cpu-cache", "cpu", seed=i, name=f"{i:04d}")
    report = scan_paths(tmp_path)
    # the GPU folder's files load onto the GPU (CD501), but no folder mixes devices
    assert codes(report) == {"CD501"}
    assert len(by_code(report, "CD501")) == 3
    device_tagged.build(tmp_path / "cpu-cache", "cuda:1", seed=9, name="0009")
    mixed = by_code(scan_paths(tmp_path), "CD502")
    assert [(f.path, f.details["locations"]) for f in mixed] == [
        (str(tmp_path / "cpu-cache"), {"cpu": 3, "cuda:1": 1})]


def test_images_nested_in_a_bare_cache_are_still_strays(tmp_path: Path) -> None:
    device_tagged.build(tmp_path / "cache", "cpu")
    photos = tmp_path / "cache" / "photos"
    photos.mkdir()
    (photos / "a.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(32))
    assert [f.path for f in by_code(scan_paths(tmp_path / "cache"), "CD107")] == [
        str(photos / "a.png")]


def test_a_kohya_image_dir_of_two_architectures_below_the_folder_scanned(tmp_path: Path) -> None:
    # train/5_style holds `_sdxl.npz` (4 channels) beside `_flux.npz` (16) of the same images:
    # scanned from the disk above the project, as from train/ itself, each family is its own
    tree = corpus.build("kohya", tmp_path / "disk" / "kohya")
    assert scan_paths(tree.root).findings == ()
    assert scan_paths(tmp_path / "disk").findings == ()
    planted = corpus.build("kohya", tmp_path / "bad" / "kohya", plant=("train", "CD303"))
    assert [f.path for f in by_code(scan_paths(tmp_path / "bad"), "CD303")] == [
        str(planted.planted[1])]


def test_a_musubi_media_dir_below_the_folder_scanned_keeps_its_images(tmp_path: Path) -> None:
    # musubi's kontext/ holds its latents beside its images (no cache_directory): scanned from
    # the disk above the project, its images are no strays (CD107), as when it is scanned alone
    from cachedoctor.fixtures.projects import musubi

    project = musubi.build(tmp_path / "disk" / "musubi")
    assert scan_paths(project.root / "kontext").findings == ()
    assert scan_paths(tmp_path / "disk").findings == ()


def test_file_browser_files_in_a_cache_are_no_files_of_it(tmp_path: Path) -> None:
    # Finder, Explorer and Dolphin write these into any folder they show; macOS writes an
    # AppleDouble `._<name>` beside every file copied to exFAT or an SMB share
    cache = tmp_path / "latents"
    device_tagged.build(cache, "cpu", name="0000")
    (cache / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1" + bytes(64))
    (cache / "Thumbs.db").write_bytes(bytes.fromhex("d0cf11e0a1b11ae1") + bytes(64))
    (cache / "desktop.ini").write_text("[.ShellClassInfo]\r\nIconResource=x.ico,0\r\n")
    (cache / ".directory").write_text("[Desktop Entry]\nIcon=folder\n")
    for made in list(cache.iterdir()):
        (cache / f"._{made.name}").write_bytes(b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X  ")
    assert scan_paths(cache).findings == ()
    (cache / "caption.txt").write_text("a photo\n")  # a truly foreign file still is one
    assert [f.path for f in scan_paths(cache).findings] == [str(cache / "caption.txt")]


def test_a_folder_of_projects_keeps_its_projects_files(tmp_path: Path) -> None:
    # a project folder below the one scanned holds no cache file: its README and logs are a
    # project's, not strays (the folder scanned itself is read and judged: see
    # tests/formats/test_zip_attacks.py, a hostile zip given at the top)
    corpus.build("bucketed", tmp_path / "cache-a")
    notes = tmp_path / "run-2"
    notes.mkdir()
    (notes / "README.md").write_text("# my training runs\n")
    (notes / "train.log").write_text("step 1 loss 0.1\n")
    assert scan_paths(tmp_path).findings == ()


def test_a_folder_named_like_a_cache_file_is_none(tmp_path: Path) -> None:
    # every Windows drive holds `$RECYCLE.BIN/`: a folder, not a `.bin` cache file, so the
    # projects' images and notes on that drive are no strays of a cache
    drive = tmp_path / "drive"
    (drive / "$RECYCLE.BIN").mkdir(parents=True)
    (drive / "System Volume Information").mkdir()
    (drive / "System Volume Information" / "IndexerVolumeGuid").write_bytes(b"{\x00x\x00}")
    corpus.build("bucketed", drive / "caches")
    photos = drive / "photos"
    photos.mkdir()
    (photos / "a.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(32))
    assert scan_paths(drive).findings == ()


def _lora(path: Path, rank: int = 4) -> None:
    import torch
    from safetensors.torch import save_file

    save_file({"lora_unet_in.lora_down.weight": torch.ones(rank, 320, dtype=torch.float16),
               "lora_unet_in.lora_up.weight": torch.ones(320, rank, dtype=torch.float16)},
              str(path), {"ss_network_module": "networks.lora"})


def test_trainer_outputs_beside_caches_are_no_caches(tmp_path: Path) -> None:
    # a project folder scanned bare: besides its caches, the trainers' outputs, each holding
    # weights (cache-looking files) beside its model card, state files and sample images
    import torch

    png = b"\x89PNG\r\n\x1a\n" + bytes(32)
    corpus.build("bucketed", tmp_path / "cache")
    aitk = tmp_path / "output" / "my_lora"  # ai-toolkit: save_root
    (aitk / "samples").mkdir(parents=True)
    _lora(aitk / "my_lora.safetensors")
    _lora(aitk / "my_lora_000000250.safetensors")
    torch.save({"state": {}, "param_groups": []}, aitk / "optimizer.pt")
    (aitk / "config.yaml").write_text("job: extension\n")
    (aitk / "samples" / "1700000000000__000000250_0.jpg").write_bytes(b"\xff\xd8\xff\xe0" + bytes(32))
    st = tmp_path / "simpletuner-output"  # SimpleTuner / diffusers scripts: output_dir
    (st / "checkpoint-500").mkdir(parents=True)
    _lora(st / "pytorch_lora_weights.safetensors")
    (st / "README.md").write_text("---\nlicense: other\n---\n# a LoRA\n")
    (st / "image_0.png").write_bytes(png)
    _lora(st / "checkpoint-500" / "pytorch_lora_weights.safetensors")
    torch.save({"state": {}, "param_groups": []}, st / "checkpoint-500" / "optimizer.bin")
    torch.save({"step": 500}, st / "checkpoint-500" / "random_states_0.pkl")
    (st / "checkpoint-500" / "training_state.json").write_text('{"global_step": 500}')
    kohya_out = tmp_path / "kohya-output"  # sd-scripts: output_dir, --save_state
    (kohya_out / "sample").mkdir(parents=True)
    (kohya_out / "style-state").mkdir()
    _lora(kohya_out / "style.safetensors")
    _lora(kohya_out / "style-000001.safetensors", rank=8)
    (kohya_out / "sample" / "style_000100_00_20240101000000.png").write_bytes(png)
    torch.save({"state": {}}, kohya_out / "style-state" / "optimizer.bin")
    torch.save({"step": 100}, kohya_out / "style-state" / "random_states_0.pkl")
    (kohya_out / "style-state" / "train_state.json").write_text('{"current_step": 100}')
    assert scan_paths(tmp_path).findings == ()


def test_one_musubi_dataset_cached_for_two_models_is_no_mix(tmp_path: Path) -> None:
    # one dataset config cached for Qwen-Image and then for FLUX Kontext: musubi-tuner's
    # suffixes keep both in one cache_directory, each loader globbing `*_<arch>.safetensors`
    import re

    from cachedoctor.fixtures.projects import age_all, encode, musubi

    project = musubi.build(tmp_path / "disk" / "musubi")
    shared = project.root / "cache" / "qwen"
    for latent in sorted(shared.glob("*_qi.safetensors")):
        stem, width, height = re.match(r"(.+)_(\d{4})x(\d{4})_qi", latent.name).groups()
        image = project.root / "images" / f"{stem}.png"
        tensor = encode(image, int(width), int(height), 0, channels=16, dtype="bfloat16")
        _, h, w = tensor.shape
        musubi.save_latents(shared / musubi.latent_name(stem, int(width), int(height), "fk"),
                            {f"latents_1x{h}x{w}_bfloat16": tensor,
                             f"latents_control_1x{h}x{w}_bfloat16": tensor.flip(-1).contiguous()},
                            "flux_kontext", int(width), int(height))
        musubi.save_text(shared / f"{stem}_fk_te.safetensors",
                         {"t5_vec_bfloat16": musubi.embed(0, 9, 64),
                          "clip_l_pooler_bfloat16": musubi.embed(0, 1, 32)[0]},
                         "flux_kontext", image.with_suffix(".txt").read_text().strip())
    age_all(project.root)
    for target in (shared, project.root / "cache", tmp_path / "disk", project.config):
        assert scan_paths(target).findings == (), target


def test_an_editor_s_leftovers_in_a_cache_are_no_files_of_it(tmp_path: Path) -> None:
    # vim's swap file, emacs's lock (a symlink that dangles by design), auto-save and backups,
    # left by a user who opened a caption or a bucket JSON inside the cache folder
    cache = tmp_path / "latents"
    device_tagged.build(cache, "cpu", name="0000")
    (cache / ".buckets.json.swp").write_bytes(b"b0VIM 9.0\x00" + bytes(64))
    (cache / ".#buckets.json").symlink_to("user@host.4242:1764150000")
    (cache / "#buckets.json#").write_text("{}")
    (cache / "buckets.json~").write_text("{}")
    assert scan_paths(cache).findings == ()
    (cache / "latest.pt").symlink_to("gone/0001.pt")  # a trainer's own name that dangles
    assert [(f.code, Path(f.path).name) for f in scan_paths(cache).findings] == [
        ("CD001", "latest.pt")]


def test_a_finder_file_under_a_cache_name_is_read_like_any_other(tmp_path: Path) -> None:
    """SimpleTuner lists its cache with os.walk and endswith(".pt"), dotfiles included, and
    torch.loads every file it listed when it scans the cache (data_backend/local.py list_files,
    caching/vae.py scan_cache_contents, bghira/SimpleTuner@HEAD of 2026-11): a `._<name>.pt`
    holding a pickle is judged, while the resource fork Finder really writes there is not."""
    cache = tmp_path / "latents"
    (made,) = device_tagged.build(cache, "cpu", name="0000")
    fork = cache / f"._{made.name}"
    fork.write_bytes(b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X        " + bytes(4000))
    assert scan_paths(cache).findings == ()
    assert scan_paths(cache, deep=True).findings == ()

    class Payload:
        def __reduce__(self):
            return (print, ("ran",))

    fork.write_bytes(pickle.dumps(Payload()))
    assert [(f.code, f.path) for f in scan_paths(cache).findings] == [("CD105", str(fork))]


def test_a_killed_rsync_s_temp_file_is_a_leftover_not_a_broken_entry(tmp_path: Path) -> None:
    # rsync receives into `.<name>.XXXXXX` and renames it when whole: killed mid-copy, the
    # temp stays, cut short. The trainer never reads it: a leftover (CD104), not CD101
    cache = tmp_path / "latents"
    (made,) = device_tagged.build(cache, "cpu", name="0000")
    partial = cache / f".{made.name}.Xy12Ab"
    partial.write_bytes(made.read_bytes()[:300])
    assert [(f.code, f.path) for f in scan_paths(cache).findings] == [("CD104", str(partial))]


def test_a_dataset_linked_into_a_project_is_no_loop(tmp_path: Path) -> None:
    # the same cache under a second name (a symlink beside it, or linked into a project) is
    # walked once, silently; a link to a folder above it still loops (CD001)
    corpus.build("bucketed", tmp_path / "cache")
    (tmp_path / "cache-link").symlink_to("cache")
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "latents").symlink_to(tmp_path / "cache" / "latents")
    assert scan_paths(tmp_path).findings == ()
    (tmp_path / "cache" / "text" / "up").symlink_to(tmp_path / "cache")
    assert [f.code for f in scan_paths(tmp_path).findings] == ["CD001"]


def test_a_drive_s_trash_and_system_folders_are_not_walked(tmp_path: Path) -> None:
    """A cache deleted to the trash (freedesktop, macOS, Windows) or fragments fsck left in
    lost+found are no caches a trainer reads: not walked. A broken entry of the cache beside
    them is still reported."""
    drive = tmp_path / "drive"
    corpus.build("bucketed", drive / "cache")
    for trash in (".Trash-1000/files/old-cache", ".Trashes/501", "$RECYCLE.BIN/S-1-5-21",
                  "lost+found", "System Volume Information"):
        (drive / trash).mkdir(parents=True, exist_ok=True)
        (drive / trash / "torn.pt").write_bytes(b"PK\x03\x04" + bytes(40))  # a cut zip
    assert scan_paths(drive).findings == ()
    (drive / "cache" / "torn.pt").write_bytes(b"PK\x03\x04" + bytes(40))
    assert [(f.code, Path(f.path).name) for f in scan_paths(drive).findings] == [
        ("CD101", "torn.pt")]
