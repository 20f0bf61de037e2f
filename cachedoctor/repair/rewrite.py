"""compact (CD201) and to-cpu (CD501, CD502): lossless rewrites of a torch file (imports torch).

Both load the file on the CPU and save the same object in the same container (zip, gzip
around zip, legacy) with the same keys, non-tensor values, container types, dtypes, shapes and
strides. `compact` also cuts each storage down to the bytes its tensors reach, keeping storages
that tensors share shared; `to-cpu` keeps every storage as it was. Either way every tensor is
then stored on the CPU: a rewrite cannot tag a storage with a device this host may not have.

`verify` reads the written bytes back with the scan's reader and with torch and demands every
tensor bit-identical to the original (raw bytes, dtype, shape, stride, requires_grad), the same
storage sharing, no tensor off the CPU, and for `compact` no CD201 left.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cachedoctor.checks import retained_batch_storage
from cachedoctor.repair import torch_io
from cachedoctor.repair.errors import RepairError
from cachedoctor.rule import RuleContext

if TYPE_CHECKING:
    import torch

Path = tuple[Any, ...]  # where a value sits in the saved object: ("latent",), (1, 0)


class Mismatch(RepairError):
    """What was written is not what was read."""


def rewrite(data: bytes, path: str, compact: bool) -> tuple[bytes, Any, str]:
    """(the rewritten file's bytes, the original object as loaded, the container). Raises
    Unloadable."""
    meta = torch_io.checked(data, path)
    original = torch_io.load(data, meta)
    new = _compacted(original) if compact else original
    kind = torch_io.container(meta)
    return torch_io.dumps(new, kind), original, kind


def verify(original: Any, written: bytes, path: str, kind: str, compact: bool) -> None:
    """Raise Mismatch (or Unloadable) unless `written` holds `original`, losslessly, as a file of
    container `kind` with every tensor on the CPU."""
    meta = torch_io.checked(written, path)
    if torch_io.container(meta) != kind:
        raise Mismatch(f"written as {torch_io.container(meta)}, not {kind}")
    if meta.locations not in ((), ("cpu",)):
        raise Mismatch(f"tensors stored on {', '.join(meta.locations)}, not only the CPU")
    if compact and retained_batch_storage.check(meta, RuleContext()) is not None:
        raise Mismatch("the rewritten file still stores more than its tensors need")
    problem = difference(original, torch_io.load(written, meta), same_storages=not compact)
    if problem:
        raise Mismatch(problem)


def difference(a: Any, b: Any, *, same_storages: bool) -> str | None:
    """Why object `b` is not a lossless copy of `a` (None when it is). `same_storages` also asks
    for equal storage sizes and offsets, not only equal tensors."""
    ta: list[tuple[Path, torch.Tensor]] = []
    tb: list[tuple[Path, torch.Tensor]] = []
    problem = _structure(a, b, (), ta, tb)
    if problem:
        return problem
    for (where, x), (_, y) in zip(ta, tb, strict=True):
        problem = _tensor_difference(x, y, same_storages)
        if problem:
            return f"{_show(where)}: {problem}"
    if _sharing([t for _, t in ta]) != _sharing([t for _, t in tb]):
        return "tensors that shared a storage no longer do, or the reverse"
    return None


def _structure(a: Any, b: Any, where: Path, ta: list, tb: list) -> str | None:
    import torch

    if isinstance(a, torch.Tensor):
        if type(a) is not type(b):
            return f"{_show(where)}: {type(a).__name__} became {type(b).__name__}"
        ta.append((where, a))
        tb.append((where, b))
        return None
    if type(a) is not type(b):
        return f"{_show(where)}: {type(a).__name__} became {type(b).__name__}"
    if isinstance(a, dict):
        if list(a) != list(b):
            return f"{_show(where)}: keys {list(a)!r} became {list(b)!r}"
        pairs = [((*where, k), a[k], b[k]) for k in a]
    elif isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{_show(where)}: {len(a)} items became {len(b)}"
        pairs = [((*where, i), x, y) for i, (x, y) in enumerate(zip(a, b, strict=True))]
    else:
        if a != b and repr(a) != repr(b):  # repr: NaN != NaN
            return f"{_show(where)}: {a!r} became {b!r}"
        return None
    for sub, x, y in pairs:
        problem = _structure(x, y, sub, ta, tb)
        if problem:
            return problem
    return None


def _tensor_difference(x: torch.Tensor, y: torch.Tensor, same_storages: bool) -> str | None:
    import torch

    for what, before, after in (
        ("dtype", x.dtype, y.dtype),
        ("shape", tuple(x.shape), tuple(y.shape)),
        ("stride", x.stride(), y.stride()),
        ("requires_grad", x.requires_grad, y.requires_grad),
        ("device", "cpu", y.device.type),
    ):
        if before != after:
            return f"{what} {before} became {after}"
    if same_storages:
        if x.storage_offset() != y.storage_offset():
            return f"storage offset {x.storage_offset()} became {y.storage_offset()}"
        if x.untyped_storage().nbytes() != y.untyped_storage().nbytes():
            return (f"storage of {x.untyped_storage().nbytes():,} B became "
                    f"{y.untyped_storage().nbytes():,} B")
    if not torch.equal(_raw(x), _raw(y)):
        return "tensor bytes differ"
    return None


def _raw(t: torch.Tensor) -> torch.Tensor:
    """A tensor's values as bytes (so NaN equals NaN, and -0.0 differs from 0.0)."""
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _sharing(tensors: list[torch.Tensor]) -> list[int]:
    """For each tensor, the index of the first tensor on the same storage (its own if none)."""
    first: dict[int, int] = {}
    out = []
    for i, t in enumerate(tensors):
        storage = t.untyped_storage()
        key = storage.data_ptr() if storage.nbytes() else -1 - i  # empty storages share nothing
        out.append(first.setdefault(key, i))
    return out


def _show(where: Path) -> str:
    return "".join(f"[{p!r}]" for p in where) or "<root>"


def _compacted(obj: Any) -> Any:
    """`obj` with every storage cut to the byte range its tensors reach. Tensors of one storage
    stay on one (smaller) storage; empty ones sit at its start."""
    import torch

    tensors: dict[int, torch.Tensor] = {}
    _collect(obj, tensors)
    groups: dict[int, list[torch.Tensor]] = {}
    for key, t in tensors.items():
        storage = t.untyped_storage()
        groups.setdefault(storage.data_ptr() if storage.nbytes() else -key, []).append(t)
    new: dict[int, torch.Tensor] = {}
    for views in groups.values():
        storage = views[0].untyped_storage()
        align = max(t.element_size() for t in views)
        used = [t for t in views if t.numel()]
        if used:
            low = min(t.storage_offset() * t.element_size() for t in used) // align * align
            high = max(_end(t) for t in used)
        else:  # only empty views: keep a sliver, so that views sharing it still share
            low, high = 0, min(align, storage.nbytes())
        raw = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),))
        compact = raw[low:high].clone().untyped_storage()
        for t in views:
            offset = (t.storage_offset() * t.element_size() - low) // t.element_size() if t.numel() else 0
            new[id(t)] = _like(t, torch.empty(0, dtype=t.dtype).set_(compact, offset, t.shape, t.stride()))
    return _replaced(obj, new)


def _end(t: torch.Tensor) -> int:
    last = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return (last + 1) * t.element_size()


def _like(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    import torch

    if isinstance(old, torch.nn.Parameter):
        return torch.nn.Parameter(new, requires_grad=old.requires_grad)
    return new.requires_grad_(old.requires_grad)


def _collect(obj: Any, out: dict[int, torch.Tensor]) -> None:
    import torch

    if isinstance(obj, torch.Tensor):
        out[id(obj)] = obj
    elif isinstance(obj, dict):
        for value in obj.values():
            _collect(value, out)
    elif type(obj) in (list, tuple):
        for value in obj:
            _collect(value, out)


def _replaced(obj: Any, new: dict[int, torch.Tensor]) -> Any:
    """`obj` rebuilt with tensors swapped by id (a tensor saved twice stays one tensor)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return new[id(obj)]
    if isinstance(obj, dict):
        return type(obj)((k, _replaced(v, new)) for k, v in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(_replaced(v, new) for v in obj)
    return obj
