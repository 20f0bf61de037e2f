"""SimpleTuner: `config/config.json|toml|env` and the data backend config it names
(`multidatabackend.json`), as SimpleTuner 4.8.0 reads them (bghira/SimpleTuner at bc8e6ab7,
2026-08-22).

Paths: SimpleTuner resolves every relative path against its working directory, the project root
that holds `config/` (configuration/json_file.py looks for `config/config.json` there). So a
config at `<root>/config/config.json` or `<root>/config/<env>/config.json` resolves against
`<root>`; a config outside any `config/` folder resolves against its own folder.

What is read (simpletuner/helpers/data_backend/factory.py, configuration/env_file.py):
- main config keys with or without `--`; a string "false" drops a flag. `config.env` maps
  `TRAINING_NUM_PROCESSES`, `DATALOADER_CONFIG`, `OUTPUT_DIR`, `MODEL_FAMILY` and
  `TRAINER_EXTRA_ARGS`; with a JSON or TOML config, `config/config.env` and
  `config/<env>/config.env` are still sourced for `TRAINING_NUM_PROCESSES` (cli/train.py).
- each enabled `local` dataset: `instance_data_dir` (or `instance_data_root`), `cache_dir_vae`
  (default `<output_dir>/cache/vae/<model_family>/<id>`, output_dir default
  `<root>/.simpletuner_output`), `vae_cache_clear_each_epoch`, `vae_cache_ondemand`,
  `vae_cache_disable`, `compress_cache`, `crop_aspect`, `cache_file_suffix`;
  `text_embeds` datasets: `cache_dir` (default `--cache_dir_text`, itself `cache`); with none,
  SimpleTuner adds `<output_dir>/cache/text/<model_family>`. Remote datasets (aws, csv,
  huggingface, webshart) are not scanned.
- `{model_family}`, `{output_dir}`, `{id}` and `{env:VAR}` in dataset values
  (`fill_variables_in_config_paths`; an unset VAR becomes "" there, a CD409 here).
- bucket files in the image dir: `aspect_ratio_bucket_indices_<suffix>.json` (bucket ->
  absolute image paths) and `aspect_ratio_bucket_metadata_<suffix>.json` (path ->
  `target_size` [w, h]); suffix = `cache_file_suffix` (null: none) or the id. A latent's expected size is
  `target_size` over its model family's factor (`latent_factor`: 8, 16 or 32; unknown: none).

Naming (caching/vae.py `generate_vae_cache_filename`): `<cache_dir_vae>/<sub>/<sha256(stem)>.pt`
where `<sub>` is the image's folder with the configured `instance_data_dir` string removed
(`str.replace`, then leading `/` stripped: with a relative instance_data_dir this leaves a
fragment of the absolute path, as SimpleTuner does). Only the stem is hashed, so `a.png` and
`a.jpg` share one entry. Unhashed `<stem>.pt` files (before 2024-08, or `hash_filenames: false`
until 2025-12) are no longer read by SimpleTuner: they are orphans.

`dataset_type: "audio"` datasets (ACE-Step, MiniMax Music, ...) are not checked: no dataset is
made of them, so their caches are not walked through this config. Their latents are bucketed
by duration (`bucket_duration_seconds` in the bucket metadata), not by a `target_size` a VAE
factor turns into a latent size; their shape is the audio VAE's, one per model family; and
their default cache dir is `<output_dir>/cache/audio/vae/<model_family>/<id>`, not the image
one (data_backend/factory.py `_default_vae_cache_dir`, caching/vae.py). Comparing them as
image latents would raise alarms on healthy caches. Their cache dir given as a target is a
bare cache, checked as any other.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from cachedoctor.formats.meta import FileMeta
from cachedoctor.layouts.base import (
    ANY_DEVICE,
    CacheFacts,
    Dataset,
    DirectoryNaming,
    Layout,
    Naming,
    Origin,
    frozen,
)
from cachedoctor.layouts.bigfiles import BeyondLimit, NotAnObject, NotJson, object_items, read_whole
from cachedoctor.layouts.common import Problems, listdir, parent_named, typed, working_dir
from cachedoctor.layouts.entries import Changes, Entries, EntrySpec, Geometry, NoSpec, neighbour_format
from cachedoctor.layouts.paths import resolve, under
from cachedoctor.layouts.sources import ConfigFile, type_name
from cachedoctor.layouts.sources import load as load_config
from cachedoctor.remote import is_remote, join
from cachedoctor.remote.client import Endpoint, configure, read_object

NAME = "simpletuner"
TITLE = "SimpleTuner"
MAIN_NAMES = ("config.json", "config.toml", "config.env")
ENV_KEYS = {
    "TRAINING_NUM_PROCESSES": "num_processes",
    "DATALOADER_CONFIG": "data_backend_config",
    "OUTPUT_DIR": "output_dir",
    "MODEL_FAMILY": "model_family",
}
MAIN_KEYS = frozenset({"data_backend_config", "model_family", "output_dir", "num_processes",
                       "pretrained_model_name_or_path", "model_type", "cache_dir_vae"})
BACKEND_KEYS = frozenset({"instance_data_dir", "instance_data_root", "dataset_type",
                          "cache_dir_vae", "caption_strategy", "metadata_backend"})
IMAGE_TYPES = frozenset({"image", "video", "conditioning"})
# simpletuner/helpers/image_manipulation/load.py image_file_extensions (lower-cased match)
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".jxl", ".bmp", ".tif", ".tiff", ".avif")
VIDEO_EXTENSIONS = (".mp4", ".mov", ".avi", ".webm", ".mkv", ".gif")
SHA256_NAME = re.compile(r"^[0-9a-f]{64}$")
PLACEHOLDER = re.compile(r"\{([^{}]+)\}")
VAE_FACTOR = 8  # metadata/backends/base.py: vae_output_scaling_factor = 8
# A cached latent's spatial factor against its bucket's pixel target_size, by --model_family
# (simpletuner/helpers/models/<family>/model.py at bc8e6ab7). SimpleTuner's metadata assumes 8,
# but caching/vae.py saves what the model's post_vae_encode_transform_sample makes: FLUX.2,
# ERNIE and Ideogram patchify 2x2 before saving (VAE_SCALE_FACTOR = 16); Sana's DC-AE and the
# LTX-Video VAEs compress 32x, HunyuanVideo 1.5's, MageFlow's and MiniMax H3's 16x.
FACTORS = {"flux2": 16, "ernie": 16, "ideogram": 16, "hunyuanvideo": 16, "mageflow": 16,
           "minimaxh3": 16, "sana": 32, "ltxvideo": 32, "ltxvideo2": 32}
EIGHT = frozenset({  # AutoencoderKL, Qwen-Image's and Wan 2.1's VAEs, HunyuanVideo's (Kandinsky 5)
    "sd1x", "sd2x", "legacy", "sdxl", "kolors", "sd3", "flux", "chroma", "hidream", "pixart",
    "pixart_sigma", "smoldit", "auraflow", "lumina2", "omnigen", "qwen_image", "krea2", "anima",
    "z_image", "z_image_omni", "longcat_image", "kandinsky5_image", "boogu_image", "wan",
    "wan_s2v", "infinitetalk", "cosmos", "longcat_video", "kandinsky5_video", "kandinsky5-video",
    "unknown_model"})


# -- sniffing and discovery --------------------------------------------------------------------


def claims(config: ConfigFile) -> bool:
    data, name = config.data, os.path.basename(config.path).lower()
    if isinstance(data, list):
        return config.kind == "json" and (name.startswith("multidatabackend") or any(
            isinstance(d, dict) and BACKEND_KEYS.intersection(d) for d in data))
    if not isinstance(data, dict) or "__version" in data:
        return False
    if config.kind == "env":
        return name == "config.env" or bool(ENV_KEYS.keys() & data.keys())
    keys = {str(k).lstrip("-") for k in data}
    return "data_backend_config" in keys or (name in MAIN_NAMES and bool(MAIN_KEYS & keys))


def discover(folder: str) -> list[str]:
    """Main configs in `config/` and `config/<env>/` (json, then toml, then env, as SimpleTuner
    picks them); backend configs there only when no main config names one."""
    config_dir = os.path.join(folder, "config")
    if not os.path.isdir(config_dir):
        config_dir = folder if os.path.basename(os.path.abspath(folder)) == "config" else ""
    if not config_dir:
        return []
    dirs = [config_dir] + [os.path.join(config_dir, d) for d in listdir(config_dir)
                           if os.path.isdir(os.path.join(config_dir, d))]
    mains = []
    for directory in dirs:
        main = next((os.path.join(directory, n) for n in MAIN_NAMES
                     if os.path.isfile(os.path.join(directory, n))), None)
        if main:
            mains.append(main)
    if mains:
        return mains
    return [os.path.join(config_dir, n) for n in listdir(config_dir)
            if n.startswith("multidatabackend") and n.endswith(".json")]


def owner(config: ConfigFile) -> str | None:
    """For a backend config: the main config that names it, by SimpleTuner's conventions."""
    if not isinstance(config.data, list):
        return None
    root = project_root(config.path)
    target = os.path.realpath(config.path)
    for candidate in discover(root):
        if os.path.basename(candidate) not in MAIN_NAMES:
            continue
        try:
            main = load_config(candidate)
        except Exception:
            continue
        args, _ = main_args(main, Problems())
        named = args.get("data_backend_config")
        if isinstance(named, str) and os.path.realpath(backend_path(main, root, named)) == target:
            return candidate
    return None


def project_root(path: str) -> str:
    """The folder that holds config/; for an example shipped inside a source checkout's
    package (simpletuner/examples/ since d93abfee2), the checkout, which its
    `simpletuner/examples/...` and `datasets/...` paths are relative to."""
    if parent_named(path, "config") is None:
        examples = _shipped_examples(path)
        checkout = os.path.dirname(os.path.dirname(examples)) if examples is not None else ""
        if checkout and os.path.isfile(os.path.join(checkout, "pyproject.toml")):
            return checkout
    return working_dir(path, "config")


def _shipped_examples(path: str) -> str | None:
    """The `simpletuner/examples` folder (SimpleTuner's package's) that holds `path`, if one does."""
    examples = parent_named(path, "examples")
    if examples is None or os.path.basename(os.path.dirname(examples)) != "simpletuner":
        return None
    return examples


EXAMPLES = "config/examples/"  # SimpleTuner's examples folder before it moved into the package
PACKAGED = "simpletuner/examples/"  # the same folder named from a checkout's root


def backend_path(main: ConfigFile, root: str, named: str) -> str:
    """Where SimpleTuner finds the data_backend_config `named` of a config in its own package's
    examples/ folder. Since e2096b30d (2025-09-20) its config.json loader reads a
    `config/examples/<x>` value as the package's `simpletuner/examples/<x>` when that exists
    (helpers/configuration/json_file.py _resolve_example_path); newer examples name it
    `simpletuner/examples/<x>`, from the checkout's root where they are run. Any other value,
    or one whose file is not there, is relative to the working dir."""
    examples = _shipped_examples(main.path)
    if examples is not None:
        shipped = None
        if main.kind == "json" and named.startswith(EXAMPLES):
            shipped = resolve(examples, named[len(EXAMPLES):])
        elif named.startswith(PACKAGED):
            shipped = resolve(os.path.dirname(os.path.dirname(examples)), named)
        if shipped is not None and os.path.isfile(shipped):
            return shipped
    return resolve(root, named)


# -- the main config -----------------------------------------------------------------------------


def main_args(config: ConfigFile, problems: Problems) -> tuple[dict[str, Any], dict[str, Origin]]:
    """The arguments a main config sets (keys without `--`), and where each was set."""
    args: dict[str, Any] = {}
    origins: dict[str, Origin] = {}
    data = config.data if isinstance(config.data, dict) else {}
    if config.kind == "env":
        for var, key in ENV_KEYS.items():
            if var in data:
                args[key], origins[key] = data[var], config.origin(var)
        extra = data.get("TRAINER_EXTRA_ARGS", "")
        try:
            tokens = shlex.split(extra)
        except ValueError:
            tokens = extra.split()
        for token in tokens:
            if token.startswith("--"):
                key, _, value = token[2:].partition("=")
                args[key], origins[key] = (value or True), config.origin("TRAINER_EXTRA_ARGS")
        return args, origins
    for raw, value in data.items():
        key = str(raw).lstrip("-")
        if value == "false":
            continue  # SimpleTuner drops the flag
        args[key], origins[key] = value, config.origin(raw)
    return args, origins


def sourced_processes(config: ConfigFile, root: str) -> tuple[Any, Origin] | None:
    """TRAINING_NUM_PROCESSES from the config.env files SimpleTuner sources beside a JSON or
    TOML config (the environment's wins over the base one)."""
    found = None
    directory = os.path.dirname(config.path)
    candidates = [os.path.join(root, "config", "config.env")]
    if directory != os.path.join(root, "config"):
        candidates.append(os.path.join(directory, "config.env"))
    for path in candidates:
        if not os.path.isfile(path) or os.path.realpath(path) == os.path.realpath(config.path):
            continue
        try:
            env = load_config(path, "env")
        except Exception:
            continue
        if "TRAINING_NUM_PROCESSES" in env.data:
            found = env.data["TRAINING_NUM_PROCESSES"], env.origin("TRAINING_NUM_PROCESSES")
    return found


# -- the layout --------------------------------------------------------------------------------


def load(config: ConfigFile) -> Layout:
    if isinstance(config.data, list):
        main_path = owner(config)
        if main_path is not None:
            return load(load_config(main_path))
        return _layout(None, config, {}, {}, Problems())
    problems = Problems()
    args, origins = main_args(config, problems)
    root = project_root(config.path)
    named = args.get("data_backend_config")
    if named is None:
        return Layout(NAME, config.path, (), tuple(problems.items), (config.path,), root,
                      _reason(root))
    if not isinstance(named, str) or not named:
        problems.invalid(origins["data_backend_config"], "data_backend_config is "
                         f"{named!r}: expected the path of the data backend JSON file")
        return Layout(NAME, config.path, (), tuple(problems.items), (config.path,), root,
                      _reason(root))
    found = backend_path(config, root, named)
    if not os.path.isfile(found):
        problems.missing(origins["data_backend_config"], "data_backend_config", named,
                         found, _reason(root))
        return Layout(NAME, config.path, (), tuple(problems.items), (config.path,), root,
                      _reason(root))
    return _layout(config, load_config(found, "json"), args, origins, problems)


def _reason(root: str) -> str:
    return f"{root}, SimpleTuner's working dir (the folder that holds config/)"


@dataclass
class _Globals:
    """The settings of the main config that every backend entry shares."""

    root: str
    output_dir: str
    model_family: str
    processes: int
    origins: dict[str, Origin]
    args: dict[str, Any]
    factor: int | None = VAE_FACTOR  # of the cached latents; None: not known for the family


def latent_factor(family: str, flavour: str | None = None) -> int | None:
    """How many pixels of the bucket's target_size one cached latent cell covers; None for a
    family whose cached latents cachedoctor does not know (no size is then expected)."""
    if family == "wan" and flavour and "ti2v-5b" in flavour:
        return 16  # Wan 2.2 TI2V-5B's VAE (48 channels, 16x)
    return FACTORS.get(family, VAE_FACTOR if family in EIGHT else None)


def _globals(main: ConfigFile | None, backend: ConfigFile, args: dict[str, Any],
             origins: dict[str, Origin], problems: Problems) -> _Globals:
    root = project_root(main.path if main else backend.path)
    if main is not None and main.kind != "env" and "num_processes" not in args:
        sourced = sourced_processes(main, root)
        if sourced:
            args["num_processes"], origins["num_processes"] = sourced
    processes = 1
    if "num_processes" in args:
        raw = args["num_processes"]
        try:
            processes = int(str(raw).strip())
            if processes < 1:
                raise ValueError
        except ValueError:
            problems.invalid(origins["num_processes"], f"num_processes is {raw!r}: expected a "
                             "whole number of at least 1", key="num_processes")
            processes = 1
    family = args.get("model_family")
    family = family if isinstance(family, str) and family else "unknown_model"
    flavour = args.get("model_flavour")
    output = args.get("output_dir")
    output_dir = resolve(root, output) if isinstance(output, str) and output else os.path.join(
        root, ".simpletuner_output")
    return _Globals(root, output_dir, family, processes, origins, args,
                    latent_factor(family, flavour if isinstance(flavour, str) else None))


def _layout(main: ConfigFile | None, backend: ConfigFile, args: dict[str, Any],
            origins: dict[str, Origin], problems: Problems) -> Layout:
    g = _globals(main, backend, args, origins, problems)
    read = (main.path if main else None, backend.path,
            origins["num_processes"].file if "num_processes" in origins else None)
    files = tuple(dict.fromkeys(p for p in read if p))
    source = main.path if main else backend.path
    if not isinstance(backend.data, list):
        problems.invalid(backend.origin(), "the data backend config is "
                         f"{type(backend.data).__name__}: expected a JSON list of datasets")
        return Layout(NAME, source, (), tuple(problems.items), files, g.root, _reason(g.root))
    entries = _entries(backend, g, problems)
    compression = {e.id: _compress(backend, problems, e, g) for e in entries}
    text = [e for e in entries if e.dataset_type == "text_embeds"]
    if not text:
        directory = os.path.join(g.output_dir, "cache", "text", g.model_family)
        text = [_Entry(-1, "text-embeds", "text_embeds", {"cache_dir": directory}, {},
                       default_text=True)]
    text_dirs = {e.id: _text_dir(e, g) for e in text}
    datasets: list[Dataset] = []
    for entry in entries:
        if entry.dataset_type in IMAGE_TYPES:
            made = _image_dataset(backend, entry, g, text_dirs, problems, compression)
            if made is not None:
                datasets.append(made)
    for entry in text:
        directory = text_dirs[entry.id]
        origin = (backend.origin(entry.index, "cache_dir") if entry.index >= 0
                  else Origin(backend.path, "cache_dir_text", None))
        compress, compress_origin = compression.get(entry.id) or _compress(
            backend, problems, entry, g)  # (the text dataset SimpleTuner adds: the global flag)
        origins = {"text_cache_dir": origin}
        if compress_origin is not None:
            origins["reads_gzip"] = compress_origin
        datasets.append(Dataset(
            entry.id, cache_dirs=(directory,), text_cache_dir=directory,
            model_family=g.model_family, processes=g.processes, expected_device=ANY_DEVICE,
            options=frozen({"suggest:text_cache_dir":
                            '"cache_dir": "{output_dir}/cache/text/{model_family}"',
                            "compress_cache": compress, "reads_gzip": compress}),
            origins=frozen(origins),
        ))
    return Layout(NAME, source, tuple(datasets), tuple(problems.items), files, g.root,
                  _reason(g.root))


@dataclass
class _Entry:
    """One entry of a multidatabackend.json, its placeholders filled."""

    index: int
    id: str
    dataset_type: str
    values: dict[str, Any]  # placeholders filled
    unset: dict[str, str] = field(default_factory=dict)  # key -> the {env:VAR} left unset
    default_text: bool = False
    bucket: str | None = None  # an `aws` backend's bucket: its paths are keys there


def _entries(backend: ConfigFile, g: _Globals, problems: Problems) -> list[_Entry]:
    entries: list[_Entry] = []
    raw_ids = []
    for index, raw in enumerate(backend.data):
        if not isinstance(raw, dict):
            problems.invalid(backend.origin(index), f"dataset #{index + 1} is "
                             f"{type(raw).__name__}: expected an object with an id")
            continue
        if raw.get("disabled") is True or raw.get("disable") is True:
            continue
        ident = raw.get("id")
        if not isinstance(ident, str) or not ident:
            problems.invalid(backend.origin(index, "id"), f"dataset #{index + 1} has no id: "
                             "expected a unique string", key="id")
            ident = f"#{index + 1}"
        elif ident in raw_ids:
            problems.invalid(backend.origin(index, "id"), f"dataset id '{ident}' is used twice: "
                             "SimpleTuner needs unique ids", ident, key="id")
        raw_ids.append(ident)
        kind = typed(backend, problems, (index,), raw, "dataset_type", str, "image", ident)
        if raw.get("type", "local") not in ("local", "aws"):
            continue  # csv, huggingface, webshart, memory: nothing on this disk or in S3
        unset: dict[str, str] = {}
        values = {key: _fill(value, key, ident, g, unset) for key, value in raw.items()}
        for key, var in unset.items():
            problems.invalid(backend.origin(index, key), f"{{env:{var}}} in {key} is not set: "
                             "SimpleTuner puts an empty string in its place", ident, key=key,
                             variable=var)
        bucket = None
        if raw.get("type") == "aws":
            bucket = _aws_bucket(backend, index, ident, values, problems)
            if bucket is None:
                continue
        entries.append(_Entry(index, ident, kind, values, unset, bucket=bucket))
    return entries


def _aws_bucket(backend: ConfigFile, index: int, ident: str, values: dict[str, Any],
                problems: Problems) -> str | None:
    """The bucket of an `aws` backend (data_backend/aws.py: `aws_bucket_name`; its endpoint,
    region and keys configure the client that reads it, and are never shown)."""
    bucket = values.get("aws_bucket_name")
    if not isinstance(bucket, str) or not bucket.strip() or "/" in bucket.strip():
        problems.invalid(backend.origin(index, "aws_bucket_name"), f"aws dataset '{ident}' has "
                         f"aws_bucket_name {bucket!r}: expected the name of its S3 bucket", ident,
                         key="aws_bucket_name")
        return None
    bucket = bucket.strip()

    def text(key: str) -> str | None:
        value = values.get(key)
        return value if isinstance(value, str) and value else None

    configure(bucket, Endpoint(text("aws_endpoint_url"), text("aws_region_name"),
                               text("aws_access_key_id"), text("aws_secret_access_key")))
    return bucket


def _key(value: str) -> str:
    """A path of an aws backend as the object key it names (aws.py strips a leading slash)."""
    return os.path.normpath(value).lstrip("/") if value.strip("/ .") else ""


def _fill(value: Any, key: str, ident: str, g: _Globals, unset: dict[str, str]) -> Any:
    if isinstance(value, str):
        def replace(match: re.Match[str]) -> str:
            token = match.group(1)
            if token.startswith("env:"):
                found = os.environ.get(token[4:])
                if found is None:
                    unset.setdefault(key, token[4:])
                return found or ""
            mapping = {"model_family": g.model_family, "output_dir": g.output_dir, "id": ident}
            return str(mapping[token]) if token in mapping else match.group(0)

        return PLACEHOLDER.sub(replace, value)
    if isinstance(value, list):
        return [_fill(v, key, ident, g, unset) for v in value]
    if isinstance(value, dict):
        return {k: _fill(v, key, ident, g, unset) for k, v in value.items()}
    return value


def _text_dir(entry: _Entry, g: _Globals) -> str:
    if entry.bucket is not None:  # keys `<aws_data_prefix or cache_dir>/<md5>-<family>.pt`
        prefix = entry.values.get("aws_data_prefix") or entry.values.get("cache_dir") or ""
        return join(entry.bucket, _key(str(prefix)))
    directory = entry.values.get("cache_dir")
    if not isinstance(directory, str) or not directory:
        directory = g.args.get("cache_dir_text") or "cache"
    return resolve(g.root, str(directory))


def _flag(backend: ConfigFile, problems: Problems, entry: _Entry, key: str, default: Any) -> Any:
    return typed(backend, problems, (entry.index,), entry.values, key, bool, default, entry.id)


def _compress(backend: ConfigFile, problems: Problems, entry: _Entry,
              g: _Globals) -> tuple[bool, Origin | None]:
    """A backend's compress_cache (its own, else --compress_disk_cache, default on: the field
    registry's default_value) and where it was set. Its LocalDataBackend.torch_load gunzips
    only with it on (and then reads plain files too, _decompress_torch falling back to the
    bytes as they are); with it off, torch.load gets the gzip bytes and raises."""
    if entry.index >= 0 and entry.values.get("compress_cache") is not None:
        return (bool(_flag(backend, problems, entry, "compress_cache", True)),
                backend.origin(entry.index, "compress_cache"))
    return _global_flag(g, "compress_disk_cache", True), g.origins.get("compress_disk_cache")


def _global_flag(g: _Globals, key: str, default: bool) -> bool:
    value = g.args.get(key, default)
    if isinstance(value, str):
        return value.strip().lower() not in ("false", "0", "no", "")
    return bool(value)


def _image_dataset(backend: ConfigFile, entry: _Entry, g: _Globals, text_dirs: dict[str, str],
                   problems: Problems,
                   compression: Mapping[str, tuple[bool, Origin | None]]) -> Dataset | None:
    i, values, ident = entry.index, entry.values, entry.id
    key = "instance_data_dir" if "instance_data_dir" in values else "instance_data_root"
    if entry.bucket is not None:  # SimpleTuner's instance_data_dir is the aws_data_prefix
        key = "aws_data_prefix"
        values = {**values, key: join(entry.bucket, _key(str(values.get(key) or "")))}
    raw_dir = values.get(key)
    if key in entry.unset:
        return None  # reported as CD409; the path SimpleTuner would use is meaningless
    if not isinstance(raw_dir, str) or not raw_dir.strip():
        what = "has no instance_data_dir" if raw_dir is None else (
            f"has instance_data_dir {raw_dir!r}")
        problems.invalid(backend.origin(i, "instance_data_dir" if raw_dir is None else key),
                         f"local dataset '{ident}' {what}: expected the path of its image "
                         "folder (SimpleTuner refuses to start)", ident, key="instance_data_dir")
        return None
    configured = raw_dir.strip().rstrip("/")
    image_dir = configured if entry.bucket else resolve(g.root, configured)
    if not entry.bucket and not os.path.isdir(image_dir):
        problems.missing(backend.origin(i, key), key, raw_dir, image_dir, _reason(g.root), ident)
    vae = values.get("cache_dir_vae")
    vae_origin = backend.origin(i, "cache_dir_vae")
    if "cache_dir_vae" in entry.unset:
        vae = None
    elif vae is not None and not isinstance(vae, str):
        problems.invalid(vae_origin, f"cache_dir_vae is {vae!r}: expected a path", ident,
                         key="cache_dir_vae")
        vae = None
    if not vae:
        vae = g.args.get("cache_dir_vae") or os.path.join(g.output_dir, "cache", "vae",
                                                           g.model_family, ident)
        vae_origin = Origin(backend.path, "cache_dir_vae", backend.line(i))
    cache_dir = join(entry.bucket, _key(os.path.relpath(vae, g.root) if os.path.isabs(vae) and
                                        under(vae, g.root) else vae)) \
        if entry.bucket else resolve(g.root, vae)
    compress, _ = compression[entry.id]
    # its VAE cache is read by its own backend, or by the `image_embeds` dataset it names
    # (factory.py _get_image_embed_backend: VAECache(cache_data_backend=...)); one not in this
    # config (remote, or a typo SimpleTuner stops on) reads it as it may: no CD109
    embeds = values.get("image_embeds")
    reads_gzip, compress_origin = compression.get(embeds, (True, None)) if isinstance(
        embeds, str) else compression[entry.id]
    ondemand = _flag(backend, problems, entry, "vae_cache_ondemand",
                     _global_flag(g, "vae_cache_ondemand", False))
    disabled = _flag(backend, problems, entry, "vae_cache_disable",
                     _global_flag(g, "vae_cache_disable", False))
    options = {
        "vae_cache_clear_each_epoch": _flag(backend, problems, entry,
                                            "vae_cache_clear_each_epoch", False),
        "vae_cache_ondemand": ondemand,
        "vae_cache_disable": disabled,
        "compress_cache": compress,
        "reads_gzip": reads_gzip,  # whether the backend reading its VAE cache gunzips (CD109)
        "crop_aspect": values.get("crop_aspect"),
        "suggest:latent_cache_dir": f'"cache_dir_vae": "{{output_dir}}/cache/vae/{{model_family}}/{ident}"',
    }
    origins = {
        "image_dir": backend.origin(i, key),
        "latent_cache_dir": vae_origin,
        "dataset": backend.origin(i),
    }
    if compress_origin is not None:
        origins["reads_gzip"] = compress_origin
    for option in ("vae_cache_clear_each_epoch", "crop_aspect"):
        if option in values:
            origins[option] = backend.origin(i, option)
    if "num_processes" in g.origins:
        origins["processes"] = g.origins["num_processes"]
    text_id = values.get("text_embeds")
    text_dir = text_dirs.get(text_id) if isinstance(text_id, str) else None
    if text_dir is None and text_dirs:
        text_dir = next(iter(text_dirs.values()))
    # MetadataBackend: `<name>_<suffix>.json`, with no `_<suffix>` for a suffix set to null
    # (what SimpleTuner's 9b833d22f, which made the id the default, told users to set to keep
    # their old bucket files); factory.py: `backend.get("cache_file_suffix", id)`
    suffix = values.get("cache_file_suffix", ident)
    buckets = _bucket_files(backend, entry, image_dir, configured,
                            "" if suffix is None else f"_{suffix}", problems,
                            values.get("metadata_backend", "discovery"), g.factor)
    naming = SimpleTunerNaming(
        instance_dir=configured, image_root=image_dir, cache_root=cache_dir,
        buckets=frozen(buckets.by_key), listed=buckets.listed,
        expects_cache=not (ondemand or disabled), metadata_file=buckets.metadata_file,
        factor=g.factor,
    )
    return Dataset(
        ident, cache_dirs=(cache_dir,), image_dirs=(image_dir,), latent_cache_dir=cache_dir,
        text_cache_dir=text_dir, vae_factor=g.factor or VAE_FACTOR, model_family=g.model_family,
        processes=g.processes, options=frozen(options), origins=frozen(origins), naming=naming,
        listed_images=buckets.listed or frozenset(), listing=buckets.origin,
        expected_device=ANY_DEVICE,  # its data backends torch.load with map_location="cpu"
    )


# -- bucket metadata ---------------------------------------------------------------------------


@dataclass
class _Buckets:
    """What a backend's aspect bucket files say: each image's bucket and size."""

    by_key: dict[str, tuple[str, tuple[int, int] | None]] = field(default_factory=dict)
    listed: frozenset[str] | None = None
    origin: Origin | None = None
    metadata_file: str | None = None  # aspect_ratio_bucket_metadata_<suffix>.json, when read


def _bucket_files(backend: ConfigFile, entry: _Entry, image_dir: str, configured: str,
                  suffix: str, problems: Problems, metadata_backend: Any,
                  factor: int | None = VAE_FACTOR) -> _Buckets:
    """The bucket files `aspect_ratio_bucket_{indices,metadata}<suffix>.json` as SimpleTuner
    reads them (metadata/backends/discovery.py `reload_cache`): `cache_data.get(
    "aspect_ratio_bucket_indices", {})`, its keys made floats with `.items()`. A JSON object
    without that key (the files of June-August 2023, which held the mapping itself, or a
    caption dataset's `ordered_ids`) loads as no buckets, and SimpleTuner buckets every image
    again and rewrites the file: not an error, and nothing to take buckets from. What stops
    SimpleTuner is a file that is no JSON object (`cache_data.get` raises) or a key that
    holds something `.items()` fails on."""
    out = _Buckets()
    if metadata_backend not in (None, "discovery", "json"):
        return out  # parquet / huggingface metadata: not bucket JSON files
    indices_path = os.path.join(image_dir, f"aspect_ratio_bucket_indices{suffix}.json")
    metadata_path = os.path.join(image_dir, f"aspect_ratio_bucket_metadata{suffix}.json")
    indices = _read_json(indices_path, entry.id, problems)
    targets = _read_metadata(metadata_path, entry.id, problems, _target(factor))
    if indices is None:
        return out
    origin = Origin(indices_path, "aspect_ratio_bucket_indices", None)
    if not isinstance(indices, dict):
        problems.invalid(origin, f"the bucket file holds {type_name(indices)}: expected a JSON "
                         "object (SimpleTuner stops in reload_cache: "
                         f"'{type(indices).__name__}' object has no attribute 'get')", entry.id)
        return out
    raw = indices.get("aspect_ratio_bucket_indices")
    if not raw and not isinstance(raw, dict):
        return out  # absent or null: no buckets, SimpleTuner buckets the images again
    if not isinstance(raw, dict):
        problems.invalid(origin, f"aspect_ratio_bucket_indices is {type_name(raw)}: expected "
                         "{bucket: [image paths]} (SimpleTuner stops in reload_cache: "
                         f"'{type(raw).__name__}' object has no attribute 'items')", entry.id)
        return out
    out.origin = origin
    out.metadata_file = metadata_path if targets is not None else None
    listed: set[str] = set()
    targets = targets or {}
    for bucket, paths in raw.items():
        if not isinstance(paths, list):
            continue
        for path in paths:
            if not isinstance(path, str):
                continue
            absolute = join(image_dir.split("/")[2], path.lstrip("/")) if is_remote(image_dir) \
                else resolve(image_dir, path)  # an aws backend lists keys in its bucket
            listed.add(absolute)
            key = vae_key(configured, absolute)
            out.by_key.setdefault(key, (str(bucket), targets.get(path)))
    out.listed = frozenset(listed)
    return out


def _target(factor: int | None) -> Callable[[Any], tuple[int, int] | None]:
    """An image's metadata -> the (h, w) its latent has: target_size over the VAE's factor."""
    def target(meta: Any) -> tuple[int, int] | None:
        size = meta.get("target_size") if isinstance(meta, dict) else None
        if factor and isinstance(size, list) and len(size) == 2 and all(
                isinstance(v, int) and v > 0 for v in size):
            return size[1] // factor, size[0] // factor
        return None
    return target


# SimpleTuner writes both files with json.dumps, no indent (discovery.py save_cache,
# save_image_metadata). The indices hold each image's path once (~100 bytes with quotes and
# comma; ~100 MB a million images) and are parsed whole, as their buckets are kept whole; the
# metadata holds ~250 bytes an image (original_size, crop_coordinates, target_size,
# intermediary_size, aspect_ratio; more with bbox_entities) and is streamed. Past these limits,
# far beyond millions of images, a file is a CD409 warning: not checked.
MAX_BUCKET_FILE = 2**30
MAX_METADATA_FILE = 16 * 2**30
_INVALID_JSON = "SimpleTuner logs 'Error loading aspect bucket cache' and rebuilds it"


def _read_json(path: str, dataset: str, problems: Problems) -> Any:
    try:
        # an aws backend's file is in its bucket; a local one is in the cache dir, which may
        # come from someone else: a FIFO there must not hang the scan, nor /dev/zero fill memory
        raw = read_object(path, MAX_BUCKET_FILE) if is_remote(path) \
            else read_whole(path, MAX_BUCKET_FILE)
        return None if raw is None else json.loads(raw)
    except FileNotFoundError:
        return None
    except (OSError, BeyondLimit) as exc:
        _unread(path, dataset, problems, exc, MAX_BUCKET_FILE)
    except (ValueError, RecursionError) as exc:
        problems.invalid(Origin(path, os.path.basename(path), getattr(exc, "lineno", None)),
                         f"not valid JSON ({str(exc).splitlines()[0][:120]}): {_INVALID_JSON}",
                         dataset)
    return None


def _read_metadata(path: str, dataset: str, problems: Problems,
                   keep: Callable[[Any], Any]) -> dict[str, Any] | None:
    """{image path as written: keep(its metadata)} of a bucket metadata file, where keep gives
    something; None when the file is absent or cannot be read (reported). Streamed: a million
    images' metadata is never built whole."""
    if is_remote(path):
        data = _read_json(path, dataset, problems)
        if not isinstance(data, dict):
            return None
        items: Iterable[tuple[str, Any]] = data.items()
    else:
        items = object_items(path, MAX_METADATA_FILE)
    out: dict[str, Any] = {}
    try:
        for key, meta in items:
            if (kept := keep(meta)) is not None:
                out[key] = kept
    except FileNotFoundError:
        return None
    except (OSError, BeyondLimit) as exc:
        _unread(path, dataset, problems, exc, MAX_METADATA_FILE)
        return None
    except NotAnObject:
        return None  # JSON, but no {path: metadata}: nothing to take sizes from
    except NotJson as exc:
        text = str(exc).removeprefix("not valid JSON: ")
        line = re.search(r"\(line (\d+),", text)
        problems.invalid(Origin(path, os.path.basename(path), int(line.group(1)) if line else None),
                         f"not valid JSON ({text[:120]}): {_INVALID_JSON}", dataset)
        return None
    return out


def _unread(path: str, dataset: str, problems: Problems, exc: Exception, limit: int) -> None:
    """CD409 for a bucket file that cannot be read; a warning (reading_limit) when it is only
    larger than cachedoctor reads (read_object says so in its text)."""
    origin = Origin(path, os.path.basename(path))
    if isinstance(exc, BeyondLimit) or str(exc).startswith("larger than"):
        problems.invalid(origin, f"not read: {str(exc).removeprefix('the file ')}"
                         + ("" if isinstance(exc, BeyondLimit) else ": not checked")
                         + "; the buckets and sizes it holds are not compared", dataset,
                         reading_limit=limit)
        return
    text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    problems.invalid(origin, f"cannot read: {text.removeprefix('cannot read: ')}", dataset)


# -- naming ------------------------------------------------------------------------------------


def vae_key(configured: str, image: str) -> str:
    """The coverage key of an image: its cache sub-folder and the sha256 of its stem."""
    folder = os.path.dirname(image).replace(configured, "").lstrip(os.sep) if configured else ""
    stem = os.path.splitext(os.path.basename(image))[0]
    return _join(folder, _sha256(stem))


def _sha256(text: str) -> str:
    import hashlib  # here, not at the top: OpenSSL's import is 3 ms of every scan's start

    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()


def _join(folder: str, name: str) -> str:
    folder = os.path.normpath(folder) if folder else ""
    return name if folder in ("", ".") else f"{folder}/{name}"


@dataclass(frozen=True)
class SimpleTunerNaming(Naming):
    """SimpleTuner's cache naming: `<cache_dir_vae>/<sub>/<sha256(stem)>.pt`, `<sub>` the
    image's folder with the configured instance_data_dir removed."""

    instance_dir: str  # as configured: SimpleTuner removes this string from image folders
    image_root: str
    cache_root: str
    buckets: Mapping[str, tuple[str, tuple[int, int] | None]]
    listed: frozenset[str] | None  # images in the bucket file; None when there is none
    expects_cache: bool
    metadata_file: str | None = None  # the bucket metadata (sizes and crops), for --reencode
    factor: int | None = VAE_FACTOR  # the cached latents' spatial factor (latent_factor)

    stem_collisions = True

    def entries(self, dataset: Dataset, changes: Changes) -> Entries:
        return _Entries(self, changes)

    def directory(self, path: str, bucket: str | None, area: str) -> DirectoryNaming:
        return _Directory(self, path)

    def expected_entry(self, image: str) -> str:
        return f"{os.path.basename(vae_key(self.instance_dir, image))}.pt"

    def missing_text(self, image: str, cache_dir: str) -> str:
        key = vae_key(self.instance_dir, image)
        text = f"expected {key}.pt in {cache_dir}"
        if os.path.dirname(key) and self.instance_dir and not os.path.isabs(self.instance_dir):
            # vae.py removes the configured string from the image's absolute folder: the rest
            # of that folder becomes the entry's sub-folder
            text += (f' (SimpleTuner removes the relative instance_data_dir '
                     f'"{self.instance_dir}" from the image\'s absolute folder and keeps the rest)')
        return text


class _Directory(DirectoryNaming):
    def __init__(self, naming: SimpleTunerNaming, path: str) -> None:
        super().__init__()
        self.naming, self.path = naming, path
        self.in_images = under(path, naming.image_root)
        self.in_cache = under(path, naming.cache_root)
        folder = path.replace(naming.instance_dir, "").lstrip(os.sep) if naming.instance_dir else ""
        self.image_folder = folder
        self.cache_folder = os.path.relpath(path, naming.cache_root) if self.in_cache else ""

    def image(self, name: str) -> tuple[str, bool] | None:
        if not self.in_images or not name.lower().endswith(IMAGE_EXTENSIONS + VIDEO_EXTENSIONS):
            return None
        stem = os.path.splitext(name)[0]
        key = _join(self.image_folder, _sha256(stem))
        naming = self.naming
        expected = naming.expects_cache and (
            naming.listed is None or os.path.join(self.path, name) in naming.listed)
        return key, expected

    def cache(self, name: str, meta: FileMeta) -> CacheFacts:
        if not self.in_cache or not name.endswith(".pt"):
            return CacheFacts()
        stem = name[:-3]
        if not SHA256_NAME.match(stem):
            return CacheFacts(key="unhashed:" + _join(self.cache_folder, stem), naming="unhashed")
        key = _join(self.cache_folder, stem)
        found = self.naming.buckets.get(key)
        if found is None:
            return CacheFacts(key=key)
        return CacheFacts(key=key, bucket=found[0], expected=found[1])



# -- entries (fix --reencode) ------------------------------------------------------------------


class _Entries(Entries):
    """SimpleTuner's VAE cache entries: `<sub>/<sha256(stem)>.pt`, a bare tensor in the VAE's
    dtype, scaled, in the container of the healthy entries beside it; the image resized to its
    bucket metadata's `intermediary_size` and cropped at `crop_coordinates` (top, left) to its
    `target_size` (image_manipulation/training_sample.py, cropping.py)."""

    def __init__(self, naming: SimpleTunerNaming, changes: Changes) -> None:
        super().__init__(changes)
        self.naming = naming
        self._images: dict[str, list[str]] | None = None
        self._metadata: dict[str, Any] | None = None

    def source(self, entry: str) -> str:
        naming = self.naming
        if not under(entry, naming.cache_root) or not entry.endswith(".pt"):
            raise NoSpec("not an entry of the dataset's VAE cache")
        rel = os.path.relpath(entry, naming.cache_root)[:-3]
        if not SHA256_NAME.match(os.path.basename(rel)):
            raise NoSpec("an unhashed name, which SimpleTuner no longer reads")
        found = self._by_key().get(_join(os.path.dirname(rel), os.path.basename(rel)), [])
        if len(found) != 1:
            raise NoSpec("no image of the dataset hashes to its name" if not found else
                         f"{len(found)} images share its name (CD407): rename one")
        return found[0]

    def spec(self, image: str, replacing: str | None = None) -> EntrySpec:
        from cachedoctor import images

        naming = self.naming
        if image.lower().endswith(VIDEO_EXTENSIONS):
            raise NoSpec("a video: cachedoctor encodes images only")
        if naming.factor != VAE_FACTOR:  # patchified or a 16x/32x VAE: not a plain /8 encode
            raise NoSpec("its model family's cached latents are not a plain 8x VAE encode")
        path = os.path.join(naming.cache_root, vae_key(naming.instance_dir, image) + ".pt")
        meta = self._metadata_of().get(image)
        sizes = _sizes(meta)
        if sizes is None:
            raise NoSpec("SimpleTuner's bucket metadata gives no size for it: let its aspect "
                         "bucket scan run first")
        original, intermediary, (top, left), target = sizes
        size = images.size(image, oriented=True)  # TrainingSample exif_transposes it
        if size != original:
            raise NoSpec(f"it is {size[0]}x{size[1]} now, {original[0]}x{original[1]} in "
                         "SimpleTuner's bucket metadata: let its aspect bucket scan run first")
        try:
            fmt = self.once(os.path.dirname(path), lambda: neighbour_format(path, self.unlike))
        except NoSpec:  # a sub-folder with no healthy entry yet: the cache's own format
            root = os.path.join(naming.cache_root, "new.pt")
            fmt = self.once(naming.cache_root, lambda: neighbour_format(root, self.unlike))
        geometry = Geometry(size, intermediary, (left, top, *target), "bicubic", oriented=True)
        return EntrySpec(image, path, replace(fmt, scaled=True), geometry,
                         geometry.latent_size(VAE_FACTOR))

    def _by_key(self) -> dict[str, list[str]]:
        if self._images is None:
            naming = self.naming
            listed = naming.listed
            if listed is None:
                listed = frozenset(
                    os.path.join(parent, name) for parent, _, names in os.walk(naming.image_root)
                    for name in names if name.lower().endswith(IMAGE_EXTENSIONS))
            self._images = {}
            for image in sorted(listed):
                self._images.setdefault(vae_key(naming.instance_dir, image), []).append(image)
        return self._images

    def _metadata_of(self) -> dict[str, Any]:
        if self._metadata is None:
            self._metadata = {}
            file = self.naming.metadata_file
            if file is not None:
                data = _read_metadata(file, "", Problems(),
                                      lambda meta: meta if _sizes(meta) is not None else None)
                if data is not None:
                    self._metadata = {resolve(self.naming.image_root, str(k)): v
                                      for k, v in data.items()}
        return self._metadata


def _sizes(meta: Any) -> tuple[tuple[int, int], ...] | None:
    """(original_size, intermediary_size, crop_coordinates (top, left), target_size) of an
    image's bucket metadata; None unless all four are pairs of whole numbers."""
    if not isinstance(meta, dict):
        return None
    out = []
    for key in ("original_size", "intermediary_size", "crop_coordinates", "target_size"):
        value = meta.get(key)
        if not (isinstance(value, list) and len(value) == 2 and all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)):
            return None
        out.append((value[0], value[1]))
    return tuple(out)
