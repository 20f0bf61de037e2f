"""Random objects of tensors for the torch reader tests, and what torch itself says about them.

Each object is built the way caches get built: latents sliced out of a batch (a view keeping
the batch's storage), transposed and strided views, tensors sharing a storage, parameters,
0-dim and 0-element tensors, in nested dicts, lists and tuples.
"""

from __future__ import annotations

import io
import random
from collections.abc import Iterator

import torch

# dtypes with a legacy typed storage (both formats) and the newer ones (zip format only)
TYPED_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int64,
                torch.int32, torch.int8, torch.uint8, torch.bool, torch.complex64]


def saveable(dtype: torch.dtype) -> bool:
    """Whether this torch can save the dtype at all (2.4 has uint16 and 2.1 float8, but neither
    saves them: "dtype ... is not recognized"); files of such dtypes come from newer torch."""
    try:
        torch.save(torch.zeros(1).to(dtype), io.BytesIO())
    except (KeyError, RuntimeError, TypeError):
        return False
    return True


# torch 2.1 has no uint16 at all
NEW_DTYPES = [getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "uint16")
              if hasattr(torch, name) and saveable(getattr(torch, name))]
FLOAT_DTYPES = {torch.float16, torch.bfloat16, torch.float32, torch.float64,
                torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64}


def random_tensor(rng: random.Random, dtypes: list[torch.dtype], nonfinite: bool = False
                  ) -> torch.Tensor:
    dtype = rng.choice(dtypes)
    shape = [rng.choice([0, 1, 2, 3, 5]) if rng.random() < 0.1 else rng.randint(1, 6)
             for _ in range(rng.randint(0, 4))]
    batch = rng.randint(1, 4)
    generator = torch.Generator().manual_seed(rng.randrange(2**31))
    base = torch.randn([batch, *shape], generator=generator) * 3
    if nonfinite and base.numel():
        flat = base.view(-1)
        for _ in range(rng.randint(1, 3)):
            flat[rng.randrange(flat.numel())] = rng.choice([float("nan"), float("inf"),
                                                            float("-inf")])
    if dtype == torch.bool:
        base = base > 0
    elif not dtype.is_floating_point and not dtype.is_complex:
        base = base.nan_to_num(0, 0, 0).abs().to(torch.int64).clamp(0, 100)
    base = base.to(dtype)
    tensor = base[rng.randrange(batch)]  # a slice of a batch: keeps the batch's storage
    choice = rng.random()
    if tensor.dim() >= 2 and choice < 0.25:
        tensor = tensor.transpose(0, -1)
    elif tensor.dim() >= 1 and tensor.shape[0] > 1 and choice < 0.45:
        tensor = tensor[::2]
    elif tensor.dim() >= 1 and choice < 0.55:
        tensor = tensor.narrow(0, tensor.shape[0] // 2, (tensor.shape[0] + 1) // 2)
    elif choice < 0.7:
        tensor = tensor.clone()
    return tensor


def random_object(rng: random.Random, dtypes: list[torch.dtype], nonfinite: bool = False,
                  depth: int = 0) -> object:
    """A tensor, or a dict / list / tuple of them (and of plain values), up to 3 levels."""
    pool: list[torch.Tensor] = []

    def leaf() -> object:
        roll = rng.random()
        if pool and roll < 0.15:  # a second view of a storage already saved
            other = rng.choice(pool)
            return other.reshape(-1)[: max(other.numel() // 2, 0)] if other.is_contiguous() \
                else other
        if roll < 0.25:
            return rng.choice([3, "caption", None, (512, 768), 1.5])
        tensor = random_tensor(rng, dtypes, nonfinite)
        if tensor.dtype in NEW_DTYPES:  # torch 2.13 cannot load those with requires_grad
            pass
        elif tensor.is_floating_point() and rng.random() < 0.15:
            tensor = torch.nn.Parameter(tensor.detach().clone(), requires_grad=rng.random() < 0.5)
        elif tensor.is_floating_point() and rng.random() < 0.1:
            tensor = tensor.detach().requires_grad_()
        pool.append(tensor)
        return tensor

    def build(level: int) -> object:
        if level >= 3 or rng.random() < 0.3:
            return leaf()
        kind = rng.choice(["dict", "list", "tuple"])
        items = [build(level + 1) for _ in range(rng.randint(0, 4))]
        if kind == "dict":
            return {f"k{i}": item for i, item in enumerate(items)}
        return items if kind == "list" else tuple(items)

    return build(depth)


def torch_tensors(obj: object, path: tuple = ()) -> Iterator[tuple[tuple, torch.Tensor]]:
    """The tensors of a loaded object, in the order and with the paths walk_tensors gives."""
    seen: set[int] = set()
    stack = [(path, obj)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, torch.Tensor):
            yield path, value
            continue
        if id(value) in seen:
            continue
        if isinstance(value, dict):
            children = list(value.items())
        elif isinstance(value, (list, tuple)):
            children = list(enumerate(value))
        else:
            continue
        seen.add(id(value))
        stack.extend(((*path, k), v) for k, v in reversed(children))


def expected_metas(loaded: object) -> list[tuple]:
    """What torch says about each tensor, in the shape our TensorMeta is compared with."""
    return [
        (path, str(t.dtype).removeprefix("torch."), tuple(t.shape), tuple(t.stride()),
         t.storage_offset(), t.untyped_storage().nbytes(), t.requires_grad)
        for path, t in torch_tensors(loaded)
    ]


def our_metas(meta) -> list[tuple]:
    return [(t.path, t.dtype, t.shape, t.stride, t.storage_offset, t.storage_bytes,
             t.requires_grad) for t in meta.tensors]


def nonfinite_counts(loaded: object) -> dict[tuple, int]:
    counts = {}
    for path, t in torch_tensors(loaded):
        if t.dtype in FLOAT_DTYPES and t.numel():
            values = t.detach()
            values = values if values.dtype.is_complex else values.to(torch.float32)
            bad = int((~torch.isfinite(values)).sum())
            if bad:
                counts[path] = bad
    return counts


def shares_storage_as_torch(meta, loaded: object) -> bool:
    """Tensors torch loads onto one storage have one storage key, and only those."""
    pairs = [(ours.storage_key, theirs.untyped_storage().data_ptr())
             for ours, (_, theirs) in zip(meta.tensors, torch_tensors(loaded), strict=True)
             if theirs.untyped_storage().nbytes()]  # empty storages all sit at address 0
    return all((a == b) == (c == d) for a, c in pairs for b, d in pairs)
