"""Text encoders for `verify --text-encoder SPEC`: what turns a caption into an embedding.

    transformers:PATH  a local transformers text encoder saved with save_pretrained (CLIPTextModel,
                       CLIPTextModelWithProjection, T5EncoderModel: whatever AutoModel loads) with
                       its tokenizer in the same dir, or a pipeline dir's `text_encoder/` and
                       `tokenizer/` (`transformers:PATH#2` for `text_encoder_2/`, `tokenizer_2/`);
                       needs transformers (pip install 'cachedoctor[text]'). Nothing is downloaded.
    module:callable    a function of yours: caption -> tensor [seq, dim] (or [1, seq, dim]), or a
                       dict of such tensors by output name; given `length=` when it takes it
    reference          the tests' stand-in: a seeded table of word vectors, no model at all

An encode gives named outputs: `hidden` (the last hidden state, [seq, dim]), `penultimate` (the
hidden state before it, what SDXL's trainers store) and `pooled` ([dim]) where the model has them.
Captions are tokenized to `length` tokens (the cached embedding's sequence length: padded and cut
as the trainer did), so a caption of another length is another embedding, not another shape.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from cachedoctor.repair.encoders import EncoderError, user_callable

if TYPE_CHECKING:
    import torch

Outputs = dict[str, "torch.Tensor"]
REFERENCE_DIM = 32
REFERENCE_LENGTH = 77


class TextEncoder:
    """Captions -> named embeddings. Subclasses set `spec` and implement `_encode`."""

    spec = ""

    def prepare(self, device: str = "cpu") -> None:
        """Load what encoding needs."""

    def encode(self, captions: Sequence[str], length: int | None) -> list[Outputs]:
        """Float32 CPU outputs per caption; EncoderError for anything that is not tensors."""
        import torch

        out = []
        for outputs in self._encode(captions, length):
            if isinstance(outputs, torch.Tensor):
                outputs = {"hidden": outputs}
            if not isinstance(outputs, dict) or not outputs:
                raise EncoderError(f"text encoder {self.spec} returned {type(outputs).__name__}, "
                                   "not a tensor or a dict of tensors")
            clean = {}
            for name, value in outputs.items():
                if not isinstance(value, torch.Tensor):
                    raise EncoderError(f"text encoder {self.spec} returned {type(value).__name__} "
                                       f"for {name!r}, not a tensor")
                if value.ndim == 3 and value.shape[0] == 1:
                    value = value[0]
                clean[str(name)] = value.detach().to("cpu", torch.float32)
            out.append(clean)
        return out

    def _encode(self, captions: Sequence[str], length: int | None) -> list[Any]:
        raise NotImplementedError


class ReferenceTextEncoder(TextEncoder):
    """Each word a fixed random vector (seeded by the word's md5), mixed with its predecessor's;
    padded with the end token's vector. Deterministic on any machine."""

    spec = "reference"

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def _word(self, word: str) -> torch.Tensor:
        import torch

        digest = hashlib.md5(f"{self.seed}:{word}".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
        return torch.randn(REFERENCE_DIM, generator=generator)

    def _encode(self, captions: Sequence[str], length: int | None) -> list[Any]:
        import torch

        size = length or REFERENCE_LENGTH
        out = []
        for caption in captions:
            words = ["<start>", *caption.lower().replace(",", " ,").split(), "<end>"][:size]
            vectors = [self._word(w) for w in words]
            vectors += [self._word("<end>")] * (size - len(vectors))
            hidden = torch.stack([v + 0.5 * p for v, p in zip(vectors, [vectors[0], *vectors], strict=False)])
            out.append({"hidden": hidden, "penultimate": torch.tanh(hidden), "pooled": hidden.mean(0)})
        return out


class CallableTextEncoder(TextEncoder):
    def __init__(self, spec: str, function: Callable[..., Any]) -> None:
        self.spec = spec
        self.function = function
        try:
            self.takes_length = "length" in inspect.signature(function).parameters
        except (TypeError, ValueError):
            self.takes_length = False

    def _encode(self, captions: Sequence[str], length: int | None) -> list[Any]:
        if self.takes_length:
            return [self.function(caption, length=length) for caption in captions]
        return [self.function(caption) for caption in captions]


class TransformersTextEncoder(TextEncoder):
    def __init__(self, spec: str, model_dir: str, tokenizer_dir: str) -> None:
        self.spec = spec
        self.model_dir, self.tokenizer_dir = model_dir, tokenizer_dir
        self.model: Any = None
        self.tokenizer: Any = None
        self.device = "cpu"

    def prepare(self, device: str = "cpu") -> None:
        if self.model is not None:
            return
        from transformers import AutoModel, AutoTokenizer

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_dir, local_files_only=True)
            self.model = AutoModel.from_pretrained(self.model_dir, local_files_only=True).eval()
        except Exception as exc:
            raise EncoderError(f"cannot load a text encoder and tokenizer from {self.model_dir}: "
                               f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
        self.device = device
        self.model.to(device)

    def _encode(self, captions: Sequence[str], length: int | None) -> list[Any]:
        import torch

        self.prepare(self.device)
        # a tokenizer saved without a limit reports a huge one: CLIP's 77 is the trainers' default
        limit = self.tokenizer.model_max_length
        size = length or (limit if limit <= 4096 else REFERENCE_LENGTH)
        tokens = self.tokenizer(list(captions), padding="max_length", max_length=size, truncation=True,
                                return_tensors="pt")
        with torch.no_grad():
            result = self.model(tokens.input_ids.to(self.device), output_hidden_states=True)
        out = []
        for i in range(len(captions)):
            outputs = {"hidden": result.last_hidden_state[i]}
            hidden_states = getattr(result, "hidden_states", None)
            if hidden_states is not None and len(hidden_states) >= 2:
                outputs["penultimate"] = hidden_states[-2][i]
            for name in ("pooler_output", "text_embeds"):
                pooled = getattr(result, name, None)
                if pooled is not None:
                    outputs["pooled"] = pooled[i]
                    break
            out.append(outputs)
        return out


def resolve(spec: str) -> TextEncoder:
    """The text encoder a --text-encoder spec names; EncoderError with a one-line reason."""
    if spec == "reference":
        return ReferenceTextEncoder()
    if spec.startswith("transformers:"):
        return _transformers(spec, spec.removeprefix("transformers:"))
    found = user_callable("--text-encoder", spec,
                          "transformers:PATH, module:callable or reference (the tests' stand-in)")
    return CallableTextEncoder(spec, found)


def _transformers(spec: str, path: str) -> TextEncoder:
    if importlib.util.find_spec("transformers") is None:
        raise EncoderError(f"--text-encoder {spec} needs the transformers package: "
                           "pip install 'cachedoctor[text]'")
    path, _, which = path.partition("#")
    suffix = f"_{which}" if which and which != "1" else ""
    if os.path.isfile(os.path.join(path, "config.json")):
        return TransformersTextEncoder(spec, path, path)
    model, tokenizer = os.path.join(path, f"text_encoder{suffix}"), os.path.join(path, f"tokenizer{suffix}")
    if os.path.isfile(os.path.join(model, "config.json")) and os.path.isdir(tokenizer):
        return TransformersTextEncoder(spec, model, tokenizer)
    raise EncoderError(f"--text-encoder {spec}: no config.json in {path} or {model} (give a local "
                       "text encoder saved with save_pretrained, its tokenizer beside it, or a "
                       "pipeline dir)")
