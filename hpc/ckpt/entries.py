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
import typing as tp

import torch

from hpc.errors import CheckpointError

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


def default_paths(keys: tp.Iterable[str]) -> dict[str, Path_]:
    """Object paths for keys with no recorded ones: split on the first dot only."""
    return {k: tuple(k.split(".", 1)) if "." in k else (k,) for k in keys}


def unflatten(flat: dict[str, tp.Any], paths: dict[str, Path_]) -> dict[str, tp.Any]:
    """The nested state dict of ``flat`` along ``paths`` (int path parts become list indices)."""
    root: dict[str, tp.Any] = {}
    for key, value in flat.items():
        path = paths.get(key) or (key,)
        node: tp.Any = root
        for part, nxt in zip(path[:-1], path[1:]):
            empty: tp.Any = [] if isinstance(nxt, int) else {}
            if isinstance(node, list):
                node.extend([None] * (part + 1 - len(node)))
                node[part] = empty if node[part] is None else node[part]
            else:
                node.setdefault(part, empty)
            node = node[part]
        if isinstance(node, list):
            node.extend([None] * (path[-1] + 1 - len(node)))
        node[path[-1]] = value
    return root


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
