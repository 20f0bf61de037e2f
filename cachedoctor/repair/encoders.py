"""Encoders for `fix --reencode --encoder SPEC`: what turns a source image into a latent.

    reference          the harness encoder: TinyVAE (fixtures/latents.py), deterministic, seed 0
    module:callable    a function of yours: uint8 RGB image [3, H, W] (CPU) -> latent [C, h, w]
                       (or [1, C, h, w]), unscaled; optional attributes `scaling_factor` and
                       `shift_factor` on the function
    diffusers:PATH     a local diffusers AutoencoderKL (a dir with config.json, or a pipeline dir
                       with vae/); needs the optional extra: pip install 'cachedoctor[diffusers]'.
                       The latent is the distribution's mode, so the same image always gives
                       the same latent.

`resolve` checks a spec without importing torch or loading a model; `prepare` (called before a
run changes anything) imports and loads what the encoder needs.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cachedoctor.repair.errors import RepairError

if TYPE_CHECKING:
    import torch

CALLABLE_SPEC = re.compile(r"^([A-Za-z_][\w.]*):([A-Za-z_][\w.]*)$")


class EncoderError(RepairError):
    """A bad --encoder spec, or an encoder that cannot run here."""


class Encoder:
    """Image -> latent. Subclasses set `spec` and implement `_encode`."""

    spec = ""
    scaling_factor = 1.0
    shift_factor = 0.0

    def prepare(self) -> None:
        """Load what encoding needs (before a run changes anything)."""

    def encode(self, image: torch.Tensor, channels: int | None) -> torch.Tensor:
        """A float32 latent [C, h, w] of a uint8 RGB image [3, H, W]; EncoderError when the
        encoder gives something else, or not `channels` channels."""
        import torch

        latent = self._encode(image, channels)
        if not isinstance(latent, torch.Tensor):
            raise EncoderError(f"encoder {self.spec} returned {type(latent).__name__}, not a tensor")
        if latent.ndim == 4 and latent.shape[0] == 1:
            latent = latent[0]
        if latent.ndim != 3:
            raise EncoderError(f"encoder {self.spec} returned shape {tuple(latent.shape)}, not [C, h, w]")
        if channels is not None and latent.shape[0] != channels:
            raise EncoderError(f"encoder {self.spec} gives {latent.shape[0]} channels; the cache "
                               f"holds {channels}-channel latents (another VAE family)")
        return latent.detach().to("cpu", torch.float32)

    def _encode(self, image: torch.Tensor, channels: int | None) -> Any:
        raise NotImplementedError


class ReferenceEncoder(Encoder):
    spec = "reference"

    def __init__(self) -> None:
        self._vaes: dict[int, Any] = {}

    def _encode(self, image: torch.Tensor, channels: int | None) -> torch.Tensor:
        from cachedoctor.fixtures.latents import TinyVAE

        vae = self._vaes.setdefault(channels or 4, TinyVAE(channels or 4, seed=0))
        return vae.encode(image[None], "float32")[0]


class CallableEncoder(Encoder):
    def __init__(self, spec: str, function: Callable[[Any], Any]) -> None:
        self.spec = spec
        self.function = function
        self.scaling_factor = float(getattr(function, "scaling_factor", 1.0))
        self.shift_factor = float(getattr(function, "shift_factor", 0.0))

    def _encode(self, image: torch.Tensor, channels: int | None) -> Any:
        return self.function(image)


class DiffusersEncoder(Encoder):
    def __init__(self, spec: str, path: str, subfolder: str | None) -> None:
        self.spec = spec
        self.path = path
        self.subfolder = subfolder
        self.vae: Any = None

    def prepare(self) -> None:
        if self.vae is not None:
            return
        from diffusers import AutoencoderKL

        try:
            self.vae = AutoencoderKL.from_pretrained(self.path, subfolder=self.subfolder,
                                                     local_files_only=True).eval()
        except Exception as exc:
            raise EncoderError(f"cannot load an AutoencoderKL from {self.path}: {exc}") from None
        config = self.vae.config
        self.scaling_factor = float(getattr(config, "scaling_factor", None) or 1.0)
        self.shift_factor = float(getattr(config, "shift_factor", None) or 0.0)

    def _encode(self, image: torch.Tensor, channels: int | None) -> Any:
        import torch

        self.prepare()
        pixels = image.float()[None] / 127.5 - 1.0
        with torch.no_grad():
            return self.vae.encode(pixels.to(self.vae.dtype)).latent_dist.mode()


def resolve(spec: str) -> Encoder:
    """The encoder a --encoder spec names; EncoderError with a one-line reason if it cannot be."""
    if spec == "reference":
        return ReferenceEncoder()
    if spec.startswith("diffusers:"):
        return _diffusers(spec, spec.removeprefix("diffusers:"))
    found = user_callable("--encoder", spec, "diffusers:PATH, module:callable or reference (the "
                          "test harness's stand-in: never on a real cache)")
    return CallableEncoder(spec, found)


def user_callable(option: str, spec: str, expected: str) -> Callable[..., Any]:
    """The function a `module:callable` spec names; EncoderError with a one-line reason.
    `expected` lists the option's spec forms for the error about a spec of no known form."""
    match = CALLABLE_SPEC.match(spec)
    if match is None:
        raise EncoderError(f"unknown {option} {spec!r}: expected {expected}")
    module_name, attribute = match.groups()
    try:
        found: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise EncoderError(f"{option} {spec}: cannot import {module_name}: {exc}") from None
    for name in attribute.split("."):
        if not hasattr(found, name):
            raise EncoderError(f"{option} {spec}: {module_name} has no attribute {attribute}")
        found = getattr(found, name)
    if not callable(found):
        raise EncoderError(f"{option} {spec}: {attribute} is not callable")
    return found


def _diffusers(spec: str, path: str) -> Encoder:
    if importlib.util.find_spec("diffusers") is None:
        raise EncoderError(f"--encoder {spec} needs the diffusers package: "
                           "pip install 'cachedoctor[diffusers]'")
    if os.path.isfile(os.path.join(path, "config.json")):
        return DiffusersEncoder(spec, path, None)
    if os.path.isfile(os.path.join(path, "vae", "config.json")):
        return DiffusersEncoder(spec, path, "vae")
    raise EncoderError(f"--encoder {spec}: no config.json in {path} or {os.path.join(path, 'vae')} "
                       "(give a local AutoencoderKL or pipeline dir)")
