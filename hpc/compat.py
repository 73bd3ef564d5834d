"""Every private torch and submitit API hpcx relies on, in one place.

A private name (a leading underscore, or a constant a library does not export)
can change in any release. Each one hpcx uses is reached through this module
only, and ``tests/test_compat.py`` checks each of them by name, so a torch or
submitit upgrade that breaks one fails in one obvious test that says what to do.
Where torch has a public API for the same job, hpcx uses that instead (the CRC32
switch below uses ``torch.serialization.set_crc32_options``).

Importable without torch or submitit: login-node commands (``render``) use
``make_sbatch_string``, so every import of torch, submitit or torchao happens inside the function that
needs it (hpcx's own torch-free modules are imported at the top).
"""

from __future__ import annotations

import importlib
import threading
import typing as tp
from contextlib import contextmanager, nullcontext

from hpc.core.errors import ConfigError
from hpc.core.lora import NF4_BLOCK, NF4_SCALER_BLOCK

# ---------------------------------------------------------------- submitit

#: The module submitit's sbatch script runs (``SlurmExecutor._submitit_command_str``).
SUBMITIT_SUBMIT_MODULE = "submitit.core._submit"


def make_sbatch_string(**params: tp.Any) -> str:
    """submitit's own sbatch script for ``params`` (``submitit.slurm.slurm._make_sbatch_string``)."""
    from submitit.slurm.slurm import _make_sbatch_string  # lazy: submitit

    return _make_sbatch_string(**params)


def local_requeue_exit_code() -> int:
    """The exit status after which submitit's local controller restarts the tasks
    (``submitit.local.local.LOCAL_REQUEUE_RETURN_CODE``, not exported)."""
    from submitit.local.local import LOCAL_REQUEUE_RETURN_CODE  # lazy: submitit

    return int(LOCAL_REQUEUE_RETURN_CODE)


#: What submitit's local controller exports to itself and every task: the time limit it counts down
#: from each start of the tasks (``submitit.local.local.start_controller``; ``Controller.timeout_s``).
LOCAL_TIMEOUT_ENV = "SUBMITIT_LOCAL_TIMEOUT_S"


def local_timeout_s(env: tp.Mapping[str, str]) -> float | None:
    """The local controller's time limit in seconds, as a task sees it in ``env``; None when unset."""
    try:
        return float(env[LOCAL_TIMEOUT_ENV])
    except (KeyError, ValueError):
        return None


class ExecutorHooks:
    """Mixed into submitit's executors: the two private hooks hpcx overrides, named here only.
    ``task_command_text`` is each task's command (submitit's ``_submitit_command_str``);
    ``submitting`` wraps the start of the job (``LocalExecutor._submit_command``, which starts the
    local controller). Subclasses override the public pair, never submitit's names."""

    def task_command_text(self) -> str:
        raise NotImplementedError

    def submitting(self) -> tp.ContextManager[None]:
        return nullcontext()

    @property
    def _submitit_command_str(self) -> str:
        return self.task_command_text()

    def _submit_command(self, command: str) -> tp.Any:
        with self.submitting():
            return super()._submit_command(command)  # type: ignore[misc]  # submitit's executor, next in the MRO


# ---------------------------------------------------------------- torch.distributed.checkpoint


def storage_info_type() -> type[tp.Any]:
    """``FileSystemWriter``'s per-item record in ``.metadata`` (``filesystem._StorageInfo``)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo  # lazy: torch

    return _StorageInfo


def storage_info(relative_path: str, offset: int, length: int) -> tp.Any:
    """A ``_StorageInfo`` for an item at ``[offset, offset+length)`` of ``relative_path``."""
    return storage_info_type()(relative_path, offset, length)


def flatten_state_dict(state: dict) -> tuple[dict, dict]:
    """DCP's flattening: (``{"a.b.c": leaf}``, ``{"a.b.c": ("a", "b", "c")}``)
    (``torch.distributed.checkpoint._nested_dict.flatten_state_dict``)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict as flatten  # lazy: torch

    return flatten(state)


def set_element(root: dict, path: tp.Sequence[tp.Any], value: tp.Any) -> None:
    """Set ``value`` at the object path ``path`` of ``root`` (``checkpoint._traverse.set_element``)."""
    from torch.distributed.checkpoint._traverse import set_element as set_  # lazy: torch

    set_(root, tuple(path), value)


def narrow_tensor_by_index(tensor: tp.Any, offsets: tp.Sequence[int], sizes: tp.Sequence[int]) -> tp.Any:
    """``tensor`` narrowed to the box at ``offsets`` of ``sizes``, as DCP's reader narrows it
    (``torch.distributed._shard._utils.narrow_tensor_by_index``)."""
    from torch.distributed._shard._utils import narrow_tensor_by_index as narrow  # lazy: torch

    return narrow(tensor, offsets, sizes)


# ---------------------------------------------------------------- torch serialization

#: The globals ``torch.save`` names in a ``data.pkl`` to rebuild tensors and parameters
#: (``torch._utils._rebuild_*``); hpcx's streaming reader recognises exactly these.
REBUILD_TENSOR_V2 = ("torch._utils", "_rebuild_tensor_v2")
REBUILD_TENSOR_V3 = ("torch._utils", "_rebuild_tensor_v3")
REBUILD_PARAMETER = ("torch._utils", "_rebuild_parameter")

def rebuild_function(name: tuple[str, str]) -> tp.Callable[..., tp.Any]:
    """The function ``REBUILD_TENSOR_V2``/``_V3`` names, for pickling a tensor as torch.save does."""
    return getattr(importlib.import_module(name[0]), name[1])


def torch_file_writer(f: tp.Any, crc32: bool, alignment: int) -> tp.Any:
    """torch.save's zip writer (``torch._C.PyTorchFileWriter``) on a path or an open binary file:
    ``write_record(name, data_or_pointer, size)`` and ``write_end_of_file()``."""
    import torch  # lazy: torch

    return torch._C.PyTorchFileWriter(f, crc32, alignment)


#: The global a pickled tensor layout names (DCP's ``.metadata`` holds ``torch.strided``).
GET_LAYOUT = ("torch.serialization", "_get_layout")
#: The enum of memory formats DCP's ``TensorProperties`` pickles (``metadata._MEM_FORMAT_ENCODING``).
MEM_FORMAT_ENCODING = ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING")
#: ``FileSystemWriter``'s per-item record class, as ``.metadata`` names it.
STORAGE_INFO = ("torch.distributed.checkpoint.filesystem", "_StorageInfo")


def mem_format_encoding() -> type:
    """DCP's memory-format enum (``torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING``)."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING  # lazy: torch

    return _MEM_FORMAT_ENCODING


def get_layout() -> tp.Callable[[str], tp.Any]:
    """The function that maps ``"torch.strided"`` to the layout (``torch.serialization._get_layout``)."""
    import torch.serialization  # lazy: torch

    return torch.serialization._get_layout


_crc_lock = threading.RLock()  # process-wide: torch's CRC32 switch is process-wide in older torch


@contextmanager
def crc32_off() -> tp.Iterator[None]:
    """``torch.save`` calls inside this block write no CRC32 per zip record.

    Uses torch's public switch, ``torch.serialization.set_crc32_options``. In torch 2.13 its
    setting is per thread (a context variable), so a ``torch.save`` in another thread keeps
    CRC32; where it is process-wide (older torch), such a save skips it too (harmless:
    ``torch.load`` never checks it). Blocks in different threads run one at a time, so the
    setting from before a block always comes back (hpcx never overlaps two saves anyway).
    """
    import torch.serialization as ts  # lazy: torch

    with _crc_lock:
        before = ts.get_crc32_options()
        ts.set_crc32_options(False)
        try:
            yield
        finally:
            ts.set_crc32_options(before)


# ---------------------------------------------------------------- torch: training


def foreach_norm(tensors: list) -> list:
    """The 2-norm of each tensor in one fused pass per device and dtype, as ``clip_grad_norm_``
    computes it (``torch._foreach_norm``)."""
    import torch  # lazy: torch

    return list(torch._foreach_norm(tensors))


def foreach_mul_(tensors: list, scalar: tp.Any) -> None:
    """Multiply each tensor in place by ``scalar`` (a 0-d tensor on their device) in one fused launch
    per call, as ``clip_grad_norm_`` scales gradients (``torch._foreach_mul_``)."""
    import torch  # lazy: torch

    torch._foreach_mul_(tensors, scalar)


def dump_flight_recorder() -> tuple[str, bytes]:
    """(which recorder, its buffer as a pickle), on demand (torch has no public call for it): NCCL's
    (``"nccl"``: ``torch._C._distributed_c10d._dump_nccl_trace``, in CUDA builds) where there is one,
    else the generic recorder of CPU backends (``"generic"``: ``_dump_fr_trace``), which holds no NCCL
    collectives: a caller on CUDA must say which it got."""
    from torch._C import _distributed_c10d as c10d  # lazy: torch

    nccl = getattr(c10d, "_dump_nccl_trace", None)
    return ("nccl", nccl()) if nccl is not None else ("generic", getattr(c10d, "_dump_fr_trace")())  # not in torch._C stubs


def checkpoint_wrapper() -> tp.Callable[..., tp.Any]:
    """Activation checkpointing's module wrapper
    (``torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper``)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as wrapper  # lazy: torch

    return wrapper


def set_pg_timeout(group: tp.Any, seconds: float) -> None:
    """The timeout of collectives issued from now on in an existing process group; torch has no
    public switch for it (``torch.distributed.distributed_c10d._set_pg_timeout``)."""
    from datetime import timedelta  # lazy: startup

    from torch.distributed.distributed_c10d import _set_pg_timeout  # lazy: torch

    _set_pg_timeout(timedelta(seconds=seconds), group)


def default_store() -> tp.Any:
    """The store of the default process group (the job's rendezvous store, prefixed), for exchanges that
    must outlive a broken collective (``torch.distributed.distributed_c10d._get_default_store``)."""
    from torch.distributed.distributed_c10d import _get_default_store  # lazy: torch

    return _get_default_store()


# ---------------------------------------------------------------- torch: the fake process group


def fake_store() -> tp.Any:
    """A store for torch's fake backend, used by ``hpcx dryrun``
    (``torch.testing._internal.distributed.fake_pg.FakeStore``)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # lazy: torch

    return FakeStore()


def clear_sharding_cache() -> None:
    """Forget DTensor's cached sharding decisions between two simulated worlds
    (``torch.distributed.tensor.debug._clear_sharding_prop_cache``, torch's recommended way)."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache  # lazy: torch

    _clear_sharding_prop_cache()


def is_strided_shard(placement: tp.Any) -> bool:
    """Whether a DTensor placement is ``_StridedShard`` (``torch.distributed.tensor.placement_types``): FSDP2
    over a tensor-parallel ``Shard`` of the same dimension; it is not a ``Shard`` and ``is_shard()`` is False."""
    from torch.distributed.tensor.placement_types import _StridedShard  # lazy: torch

    return isinstance(placement, _StridedShard)


def local_shape_and_offset(global_shape: tp.Sequence[int], mesh: tp.Any,
                           placements: tp.Sequence[tp.Any]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's block of a DTensor of ``global_shape``: (local shape, offset of its first element in
    the global tensor), strided shards included (``torch.distributed.tensor._utils.
    compute_local_shape_and_global_offset``, what DCP plans its reads with)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # lazy: torch

    return compute_local_shape_and_global_offset(tuple(global_shape), mesh, placements)


@contextmanager
def memoized_strided_shards() -> tp.Iterator[None]:
    """``_StridedShard.local_shard_size_and_offset`` remembered per (placement, size, chunks, rank) while
    inside: torch computes it by materializing index tensors the length of the dimension (``torch.arange``)
    for every DTensor each time, which at 405B (126 identical blocks, ~1900 strided parameters, DCP's
    planner and AdamW's state) costs ``hpcx dryrun`` a minute for a few distinct answers."""
    from torch.distributed.tensor.placement_types import _StridedShard  # lazy: torch

    original: tp.Callable[..., tp.Any] = _StridedShard.local_shard_size_and_offset
    cache: dict[tuple, tp.Any] = {}

    def remembered(self: tp.Any, curr_local_size: tp.Any, num_chunks: int, rank: tp.Any,
                   offset_mode: tp.Any = None) -> tp.Any:
        args = (curr_local_size, num_chunks, rank) + (() if offset_mode is None else (offset_mode,))
        if not all(type(a) is int for a in (curr_local_size, num_chunks, rank)):
            return original(self, *args)
        key = (self.dim, self.split_factor, *args)
        if key not in cache:
            cache[key] = original(self, *args)
        size, offset = cache[key]
        return size, (list(offset) if isinstance(offset, list) else offset)

    _StridedShard.local_shard_size_and_offset = remembered  # type: ignore[method-assign]
    try:
        yield
    finally:
        _StridedShard.local_shard_size_and_offset = original  # type: ignore[method-assign]


# ---------------------------------------------------------------- torchao (the `qlora` extra)


def to_nf4(value: tp.Any) -> tp.Any:
    """torchao's NF4 of ``value`` at QLoRA's block sizes (``hpc.core.lora.NF4_BLOCK``): public as
    ``torchao.quantization.to_nf4`` since torchao 0.13, ``torchao.dtypes.nf4tensor.to_nf4`` before (the
    path torchtune imports). A projection NF4 cannot block, or torchao missing, is one line."""
    try:
        from torchao.quantization import to_nf4 as quantize  # lazy: torchao
    except ImportError:
        try:
            from torchao.dtypes.nf4tensor import to_nf4 as quantize  # lazy: torchao
        except ImportError:
            raise ConfigError(["`lora.base_dtype` = 'nf4' needs torchao (pip install 'hpcx[qlora]')"]) from None
    if value.numel() % (NF4_BLOCK * NF4_SCALER_BLOCK):
        raise ConfigError([f"`lora.base_dtype` = 'nf4': a projection of shape {tuple(value.shape)} has "
                           f"{value.numel()} weights, not a multiple of {NF4_BLOCK * NF4_SCALER_BLOCK} "
                           f"(NF4 blocks of {NF4_BLOCK} weights, scales in blocks of {NF4_SCALER_BLOCK})"])
    return quantize(value, block_size=NF4_BLOCK, scaler_block_size=NF4_SCALER_BLOCK)


def is_nf4_tensor(t: tp.Any) -> bool:
    """Whether ``t`` is torchao's NF4Tensor, told by its class name so torchao is imported only by a run
    that quantizes."""
    return type(t).__name__ == "NF4Tensor"
def state_dict_fqns(model: tp.Any, name: str) -> set[str]:
    """The state-dict keys ``get_state_dict`` gives the module attribute ``name`` of ``model`` (the
    wrappers' prefixes of DDP, FSDP, compile and activation checkpointing left out)."""
    from torch.distributed.checkpoint.state_dict import _get_fqns  # lazy: torch

    return set(_get_fqns(model, name))


def dedup_save_plans(plans: list, lowest_rank: bool) -> list:
    """DCP's removal of items several ranks would write (each kept by one rank)."""
    from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans as dedup  # lazy: torch

    return dedup(plans, lowest_rank)
