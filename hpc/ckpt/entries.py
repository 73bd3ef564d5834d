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
import reprlib
import typing as tp

import torch

from hpc.core.errors import CheckpointError

Path_ = tuple  # object path: tuple of str keys and int list indices
Progress = tp.Callable[[int], None]
MAX_LISTED = 8  # problems listed before "... and N more"


@dataclasses.dataclass(frozen=True, slots=True)
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
    shape = shape if type(shape) is tuple else tuple(int(s) for s in shape)  # share a checked tuple
    return Entry(key, dtype, shape, math.prod(shape) * dtype.itemsize)


class Reader(tp.Protocol):
    """What every format reader offers."""

    format: str
    entries: dict[str, Entry]
    paths: dict[str, Path_]
    meta: dict[str, tp.Any]

    def read(self, key: str) -> tp.Any: ...

    def read_into(self, key: str, out: torch.Tensor) -> None: ...

    def close(self) -> None: ...


def owned(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous tensor that owns exactly its bytes (torch.save writes whole storages)."""
    t = t.detach().cpu().contiguous()
    if t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


def allocate(shape: tp.Sequence[int], dtype: torch.dtype, what: str = "a tensor") -> torch.Tensor:
    """``torch.empty(shape, dtype)``; CheckpointError (one line, naming ``what``) when the memory is not
    there: a tensor the file does hold (a sparse file, a huge checkpoint) may still not fit in RAM."""
    try:
        return torch.empty(tuple(shape), dtype=dtype)
    except RuntimeError:
        nbytes = math.prod(shape) * dtype.itemsize
        raise CheckpointError([f"{what}: cannot allocate the {nbytes} bytes it takes; not enough memory"]) from None


class Scratch:
    """One reusable buffer, grown to the largest tensor a conversion copies.

    Every tensor is read into (and written from) a view of it, so a conversion allocates its
    memory once instead of once per tensor: no page faults of fresh buffers, and peak memory
    stays at the largest tensor.
    """

    def __init__(self) -> None:
        self.buf = torch.empty(0, dtype=torch.uint8)

    def view(self, dtype: torch.dtype, shape: tp.Sequence[int], what: str = "a tensor") -> torch.Tensor:
        """A contiguous tensor of ``dtype`` and ``shape`` at the start of the buffer (contents undefined);
        CheckpointError naming ``what`` when it cannot grow that far."""
        nbytes = math.prod(shape) * dtype.itemsize
        if self.buf.numel() < nbytes:
            self.buf = torch.empty(0, dtype=torch.uint8)  # free the old one before allocating
            self.buf = allocate((nbytes,), torch.uint8, what)
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
    if len(paths) > MAX_VALUES:
        raise CheckpointError([f"{source}: {len(paths)} object paths, more than the {MAX_VALUES} hpcx reads"])
    out = {}
    for key, path in paths.items():
        ok = isinstance(key, str) and isinstance(path, (list, tuple)) and len(path) > 0 and all(
            isinstance(p, str) or (isinstance(p, int) and not isinstance(p, bool) and 0 <= p < MAX_LIST_INDEX)
            for p in path)
        if not ok:
            raise CheckpointError([f"{source}: object path of {short_repr(key)} is {short_repr(path)}, expected a "
                                   "list of keys "
                                   "and list indices"])
        out[key] = tuple(path)
    return out


class Paths(dict[str, Path_]):
    """Recorded object paths; a key without one gets the default, split on its first dot only
    (computed when asked for, so a million entries cost no million tuples)."""

    def __missing__(self, key: str) -> Path_:
        return tuple(key.split(".", 1)) if "." in key else (key,)

    def get(self, key: str, default: tp.Any = None) -> tp.Any:
        return self[key] if isinstance(key, str) else default


def default_paths(recorded: dict[str, Path_] | None = None) -> Paths:
    """Object paths: the ``recorded`` ones, else (for any other key) split on the first dot only."""
    return Paths(recorded or {})


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


MAX_DEPTH = 64  # containers in a state dict nest a few levels; DCP's flattening recurses per level
MAX_VALUES = 1 << 20  # values of an object counted along every path (a shared container once per path)
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlist, _SHORT.maxdict = 3, 60, 60, 6, 6


def short_repr(value: tp.Any) -> str:
    """``repr`` bounded in depth and length: safe on a value nested 200,000 deep or containing itself."""
    try:
        return _SHORT.repr(value)
    except Exception:  # noqa: BLE001  (a hostile __repr__ of an allow-listed type)
        return f"<{type(value).__name__}>"


def _children(node: tp.Any) -> tp.Iterator[tuple[tp.Any, tp.Any]] | None:
    """(label, child) pairs of a container, None for a leaf."""
    if isinstance(node, dict):
        return iter(node.items())
    if isinstance(node, (list, tuple, set, frozenset)):
        return enumerate(node)
    return None


def graph_problem(obj: tp.Any, max_depth: int = MAX_DEPTH, max_values: int = MAX_VALUES) -> str | None:
    """Why the object graph ``obj`` is no state dict, or None: a container that contains itself,
    nesting deeper than ``max_depth``, or more than ``max_values`` values counted along every path
    (what flattening, printing or comparing it would visit). Work is bounded by the distinct
    containers (each is walked once; a shared one adds its memoized count), never by paths."""
    if _children(obj) is None:
        return None
    done: dict[int, int] = {}
    stack: list[list[tp.Any]] = [[obj, _children(obj), 1, "<root>"]]
    on_path = {id(obj)}
    while stack:
        frame = stack[-1]
        label, child = next(frame[1], (None, _END))
        if child is _END:
            stack.pop()
            on_path.discard(id(frame[0]))
            done[id(frame[0])] = frame[2]
            if stack:
                stack[-1][2] += frame[2]
            if frame[2] > max_values:
                return f"holds more than {max_values} values counted along every path (shared containers)"
            continue
        found = _visit(child, label, stack, on_path, done, max_depth)
        if isinstance(found, str):
            return found
        frame[2] += found
    return None


_END = object()


def _visit(child: tp.Any, label: tp.Any, stack: list, on_path: set, done: dict, max_depth: int) -> int | str:
    """One edge of ``graph_problem``'s walk: the count it adds now, or the problem it found."""
    it = _children(child)
    if it is None:
        return 1
    if id(child) in on_path:
        return f"contains itself at {_where(stack, label)}"
    if id(child) in done:
        return done[id(child)]
    if len(stack) >= max_depth:
        return f"nests deeper than {max_depth} levels (at {_where(stack, label)})"
    on_path.add(id(child))
    stack.append([child, it, 1, label])
    return 0


def _where(stack: list, label: tp.Any) -> str:
    parts = [str(f[3])[:40] for f in stack[1:]] + [str(label)[:40]]
    return ".".join(parts if len(parts) <= 6 else parts[:3] + ["..."] + parts[-2:])


def checked_object(value: tp.Any, where: str) -> tp.Any:
    """``value`` when its object graph is a bounded tree (``graph_problem``), else CheckpointError."""
    problem = graph_problem(value)
    if problem:
        raise CheckpointError([f"{where}: the stored object {problem}; refused"])
    return value


def load_error(exc: BaseException) -> str:
    """The reason in an exception from ``torch.load(weights_only=True)``, on one line: torch's own
    message starts with advice to load without ``weights_only``, which is never the answer here."""
    text = str(exc)
    if "WeightsUnpickler error:" in text:
        reason = text.split("WeightsUnpickler error:", 1)[1].strip().split("\n")[0].split(". Please")[0].strip()
        return f"weights-only unpickler: {reason or 'rejected'}"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
