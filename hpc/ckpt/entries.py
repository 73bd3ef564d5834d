"""The flat view every format shares: entries keyed like DCP's flattened state dict.

Every entry has a *key* in DCP's flattened form (``model.blocks.0.attn.qkv.weight``,
``optim.state.head.weight.exp_avg``, ``optim.param_groups.0.lr``) and a value that is a
tensor or a small Python object. A reader's ``paths`` maps each key to its object path in
the nested state dict (what DCP records as ``planner_data``), so a nested dict can be
rebuilt. A *model-only* file (a plain ``model.state_dict()``) appears under ``model.``
keys, so any two checkpoints compare key by key.
"""

from __future__ import annotations

import dataclasses
import math
import typing as tp

import torch

from hpc.core.errors import CheckpointError

Path_ = tuple  # object path: tuple of str keys and int list indices
Progress = tp.Callable[[int], None]
MAX_LISTED = 8  # problems listed before "... and N more"


@dataclasses.dataclass(frozen=True)
class Entry:
    """One key of a checkpoint: a tensor (dtype and shape set) or a Python object."""

    key: str
    dtype: torch.dtype | None
    shape: tuple[int, ...] | None
    nbytes: int

    @property
    def is_tensor(self) -> bool:
        return self.dtype is not None


def tensor_entry(key: str, dtype: torch.dtype, shape: tp.Sequence[int]) -> Entry:
    """The entry of a tensor of ``dtype`` and ``shape``."""
    numel = 1
    for s in shape:
        numel *= int(s)
    return Entry(key, dtype, tuple(int(s) for s in shape), numel * dtype.itemsize)


class Reader(tp.Protocol):
    """What every format reader offers."""

    format: str
    entries: dict[str, Entry]
    paths: dict[str, Path_]
    meta: dict[str, tp.Any]

    def read(self, key: str) -> tp.Any: ...

    def close(self) -> None: ...


def owned(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous tensor that owns exactly its bytes (torch.save writes whole storages)."""
    t = t.detach().cpu().contiguous()
    if t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


class Scratch:
    """One reusable buffer, grown to the largest tensor a conversion copies.

    Every tensor is read into (and written from) a view of it, so a conversion allocates its
    memory once instead of once per tensor: no page faults of fresh buffers, and peak memory
    stays at the largest tensor.
    """

    def __init__(self) -> None:
        self.buf = torch.empty(0, dtype=torch.uint8)

    def view(self, dtype: torch.dtype, shape: tp.Sequence[int]) -> torch.Tensor:
        """A contiguous tensor of ``dtype`` and ``shape`` at the start of the buffer (contents undefined)."""
        nbytes = math.prod(shape) * dtype.itemsize
        if self.buf.numel() < nbytes:
            self.buf = torch.empty(0, dtype=torch.uint8)  # free the old one before allocating
            self.buf = torch.empty(nbytes, dtype=torch.uint8)
        return self.buf[:nbytes].view(dtype).view(tuple(shape))


def dims(values: tp.Any) -> tuple[int, ...] | None:
    """``values`` as a tuple of non-negative integers (a shape, offsets), or None if it is not one."""
    if not isinstance(values, (list, tuple)):
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        return None
    return tuple(int(v) for v in values)


MAX_LIST_INDEX = 1 << 20  # object paths index small lists (param_groups); refuse absurd ones


def checked_paths(paths: tp.Any, source: str) -> dict[str, Path_]:
    """Recorded object paths (key -> tuple of str keys and int list indices), checked."""
    if paths is None:
        return {}
    if not isinstance(paths, dict):
        raise CheckpointError([f"{source}: is a {type(paths).__name__}, expected a mapping of keys to object paths"])
    out = {}
    for key, path in paths.items():
        ok = isinstance(key, str) and isinstance(path, (list, tuple)) and len(path) > 0 and all(
            isinstance(p, str) or (isinstance(p, int) and not isinstance(p, bool) and 0 <= p < MAX_LIST_INDEX)
            for p in path)
        if not ok:
            raise CheckpointError([f"{source}: object path of {key!r} is {path!r}, expected a list of keys "
                                   "and list indices"])
        out[key] = tuple(path)
    return out


def default_paths(keys: tp.Iterable[str]) -> dict[str, Path_]:
    """Object paths for keys with no recorded ones: split on the first dot only."""
    return {k: tuple(k.split(".", 1)) if "." in k else (k,) for k in keys}


def unflatten(flat: dict[str, tp.Any], paths: dict[str, Path_], source: str = "checkpoint") -> dict[str, tp.Any]:
    """The nested state dict of ``flat`` along ``paths`` (int path parts become list indices);
    CheckpointError naming ``source`` when two paths disagree (one says list, one says dict)."""
    root: dict[str, tp.Any] = {}
    for key, value in flat.items():
        path = paths.get(key) or (key,)
        try:
            _place(root, path, value)
        except (TypeError, KeyError, IndexError):
            raise CheckpointError([f"{source}: the object path of {key!r} ({list(path)}) conflicts with "
                                   "another entry's"]) from None
    return root


def _place(root: dict, path: Path_, value: tp.Any) -> None:
    node: tp.Any = root
    for part, nxt in zip(path[:-1], path[1:]):
        empty: tp.Any = [] if isinstance(nxt, int) else {}
        if isinstance(node, list):
            node.extend([None] * (part + 1 - len(node)))
            node[part] = empty if node[part] is None else node[part]
        else:
            node.setdefault(part, empty)
        node = node[part]
        if not isinstance(node, (list, dict)) or isinstance(node, list) != isinstance(nxt, int):
            raise TypeError("path conflict")
    if isinstance(node, list):
        node.extend([None] * (path[-1] + 1 - len(node)))
    elif isinstance(path[-1], int):
        raise TypeError("path conflict")
    node[path[-1]] = value


def raise_problems(problems: list[str]) -> None:
    """Raise one CheckpointError listing the first ``MAX_LISTED`` problems, if there are any."""
    if problems:
        more = [f"... and {len(problems) - MAX_LISTED} more problems"] if len(problems) > MAX_LISTED else []
        raise CheckpointError(problems[:MAX_LISTED] + more)


def jsonable(value: tp.Any) -> tp.Any:
    """``value`` with tensors turned into lists and other unknowns into strings, for JSON output."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.tolist() if value.numel() <= 16 else f"<tensor {tuple(value.shape)} {value.dtype}>"
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def load_error(exc: BaseException) -> str:
    """The reason in an exception from ``torch.load(weights_only=True)``, on one line: torch's own
    message starts with advice to load without ``weights_only``, which is never the answer here."""
    text = str(exc)
    if "WeightsUnpickler error:" in text:
        reason = text.split("WeightsUnpickler error:", 1)[1].strip().split("\n")[0].split(". Please")[0].strip()
        return f"weights-only unpickler: {reason or 'rejected'}"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
