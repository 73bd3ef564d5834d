"""The model, whatever its family: built by its family (``trainer.models``), its blocks, its FSDP
units; and how its weights are made.

Families: the built-in GPT (``trainer.models.gpt``), the Llama (``trainer.models.llama``) and a user's
``package.module:function`` (``trainer.models.user``).

Initial weights (``WeightInit``)
--------------------------------
The trainer builds the model on the ``meta`` device (no memory), parallelizes it there, then
``WeightInit.materialize`` allocates each rank's part (``to_empty``: under FSDP only the shard)
and initialises it module by module: every module that owns parameters or buffers gets its
``reset_parameters()`` called with the torch RNG seeded from ``(train.seed, the module's name)``,
on full-size tensors of that one module, and each rank keeps its own slice. The full state is
therefore the same under every strategy and world size (bit for bit on one device type), and a
rank never holds more than its shard plus one module's full tensors. See trainer/README.md.

User models
-----------
``model.arch = "pkg.mod:function"`` imports ``pkg.mod`` and calls
``function(**model.kwargs)`` (under ``torch.device("meta")`` in the trainer); it must return an
``nn.Module`` whose forward takes a ``LongTensor[batch, seq]`` of token ids and returns logits
``[batch, seq, vocab]``. ``model.blocks`` is the attribute path (dots, e.g.
``transformer.h``) of the ``nn.ModuleList`` whose children are the repeated
units: each is activation-checkpointed, compiled and ``fully_shard``-ed on its
own. Default path: ``blocks`` (what the built-in GPT uses). Every module that owns parameters or
buffers must define ``reset_parameters()`` that sets exactly those tensors (torch's layers do);
a model may define ``fsdp_units()`` (groups of modules outside the blocks to shard as units of
their own, in forward order; the built-in GPT returns its embeddings and its final norm + head).
"""

from __future__ import annotations

import contextlib
import hashlib
import typing as tp
from dataclasses import dataclass

import torch
from torch import nn

from hpc.compat import is_strided_shard, local_shape_and_offset, to_nf4
from hpc.core.errors import ConfigError, UserError
from hpc.core.spec import Model as ModelSpec
from trainer import models

if tp.TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.tensor import DTensor  # imported when a model is sharded

DEFAULT_BLOCKS = "blocks"


def build_model(spec: ModelSpec, device: str | torch.device) -> nn.Module:
    """The model of ``spec`` in fp32, built by its family (``trainer.models``) under
    ``torch.device(device)``: on ``meta`` nothing is allocated (the trainer; ``WeightInit``
    materializes it later), elsewhere each module's constructor initialises it from the current torch RNG."""
    with torch.device(device):
        model = models.family(spec.arch).build(spec)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"`model.arch` = {spec.arch!r} returned {type(model).__name__}, expected an nn.Module")
    return model


def model_blocks(model: nn.Module, path: str = "") -> nn.ModuleList:
    """The ModuleList at attribute path ``path`` (default ``blocks``): the units to shard and checkpoint."""
    path = path or DEFAULT_BLOCKS
    target: object = model
    for part in path.split("."):
        if not hasattr(target, part):
            children = ", ".join(n for n, _ in target.named_children()) if isinstance(target, nn.Module) else ""
            raise ConfigError(f"`model.blocks` = {path!r}: {type(target).__name__} has no attribute {part!r} "
                              f"(children: {children or 'none'})")
        target = getattr(target, part)
    if not isinstance(target, nn.ModuleList):
        raise ConfigError(f"`model.blocks` = {path!r} is a {type(target).__name__}, expected nn.ModuleList")
    return target


def outer_units(model: nn.Module) -> list[list[nn.Module]]:
    """Groups of modules outside the blocks that get an FSDP unit of their own (``model.fsdp_units()``,
    forward order); none when the model does not say (they stay in the root unit, with any tied weights)."""
    units = getattr(model, "fsdp_units", None)
    return [list(group) for group in units()] if callable(units) else []


# ---------------------------------------------------------------- initial weights


@dataclass(frozen=True, eq=False)
class WeightInit:
    """How a model built on the meta device gets its weights; record it with ``WeightInit.of`` on the
    bare model, before ``parallelize`` wraps it (checkpoint_wrapper and DDP change module names, and
    the names key the seeds)."""

    seed: int
    names: dict[nn.Module, str]

    @classmethod
    def of(cls, model: nn.Module, seed: int) -> "WeightInit":
        return cls(seed, {module: name for name, module in model.named_modules()})

    def materialize(self, model: nn.Module, device: torch.device, param_device: torch.device | None = None) -> None:
        """Allocate every parameter and buffer (``to_empty``: under FSDP each rank allocates only its
        shard) on ``param_device`` (default ``device``; the CPU under FSDP offload), then initialise
        them, computing on ``device``; buffers end on ``device``."""
        with kept_ties(model):  # to_empty gives each module its own tensor, which would untie a tied head
            model.to_empty(device=param_device or device)
        self.initialise(model, device)
        if param_device is not None and param_device != device:
            _buffers_to(model, device)

    def initialise(self, model: nn.Module, device: torch.device) -> None:
        """Set every parameter and buffer of an allocated model, module by module (see the module docstring)."""
        for module in model.modules():
            if next(_own_tensors(module), None) is None:
                continue
            if module not in self.names:
                raise RuntimeError(f"{type(module).__name__} owns tensors but was not in the model WeightInit "
                                   "recorded (record it before parallelize)")
            init_module(module, self.names[module], self.seed, device)


@contextlib.contextmanager
def kept_ties(model: nn.Module) -> tp.Iterator[None]:
    """Parameters shared by several modules (a head tied to the token embedding) are shared again
    afterwards: each later holder gets the first holder's parameter back."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            holders.setdefault(id(param), []).append((module, name))
    yield
    for first, *others in (h for h in holders.values() if len(h) > 1):
        for module, name in others:
            setattr(module, name, getattr(first[0], first[1]))


def missing_resets(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every module ``WeightInit`` would refuse: it owns parameters or buffers and
    has no callable ``reset_parameters()`` (``hpcx dryrun`` reports them on the login node)."""
    return [(name, module) for name, module in model.named_modules()
            if next(_own_tensors(module), None) is not None and not callable(getattr(module, "reset_parameters", None))]


def _own_tensors(module: nn.Module) -> tp.Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(recurse=False)
    yield from module.named_buffers(recurse=False)


def module_seed(seed: int, name: str) -> int:
    """The RNG seed of one module: a hash of the run's seed and the module's name (order-free)."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def init_module(module: nn.Module, name: str, seed: int, device: torch.device) -> None:
    """``module.reset_parameters()`` from ``module_seed(seed, name)``. Plain tensors are set in place;
    sharded ones (DTensors) are computed whole on ``device`` and each rank keeps its own slice, so
    the values do not depend on how the module is sharded."""
    reset = getattr(module, "reset_parameters", None)
    if not callable(reset):
        owned = ", ".join(k for k, _ in _own_tensors(module))
        raise UserError(f"module {name or '(root)'!r} ({type(module).__name__}) owns {owned} but has no "
                        "reset_parameters(): every module with parameters or buffers of its own must define one "
                        "(hpcx initialises models built on the meta device module by module; see trainer/README.md)")
    sharded = {k: p for k, p in module.named_parameters(recurse=False) if _is_dtensor(p) or _is_nf4(p)}
    full = {k: nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
            for k, p in sharded.items()}
    with torch.no_grad(), _seeded(module_seed(seed, name), device), _swapped(module, full) as values:
        reset()
    with torch.no_grad():
        for k, p in sharded.items():
            if _is_nf4(p):  # a frozen LoRA base in 4 bits: quantized whole, a new tensor (trainer.lora)
                setattr(module, k, nn.Parameter(to_nf4(values[k].to(p.dtype)), requires_grad=False))
            else:
                copy_shard(p, values[k])  # type: ignore[arg-type]  # a DTensor: _is_dtensor chose it


@contextlib.contextmanager
def _swapped(module: nn.Module, params: dict[str, nn.Parameter]) -> tp.Iterator[dict[str, torch.Tensor]]:
    """Put ``params`` in place of the module's own parameters; on leaving, put the originals back and
    fill the yielded dict with what the module held (``reset_parameters`` may assign new ones)."""
    originals = {k: getattr(module, k) for k in params}
    for k, p in params.items():
        setattr(module, k, p)
    values: dict[str, torch.Tensor] = {}
    try:
        yield values
    finally:
        for k, p in originals.items():
            values[k] = getattr(module, k)
            setattr(module, k, p)


@contextlib.contextmanager
def _seeded(seed: int, device: torch.device) -> tp.Iterator[None]:
    """The torch RNG (CPU, and on CUDA every visible GPU's) seeded with ``seed``, restored afterwards:
    ``manual_seed`` reseeds all GPUs, so restoring only ``device``'s would leave ``dp``'s replica GPUs
    reseeded."""
    cuda = list(range(torch.cuda.device_count())) if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda, device_type="cuda"):
        torch.manual_seed(seed)
        yield


def copy_shard(param: DTensor, full: torch.Tensor) -> None:
    """Copy this rank's part of ``full`` into the DTensor ``param``; no communication."""
    local = local_slice(full, param.device_mesh, param.placements)
    target = param.to_local()
    if local.shape != target.shape:
        raise RuntimeError(f"shard of {tuple(full.shape)}: computed {tuple(local.shape)}, the parameter holds "
                           f"{tuple(target.shape)}")
    target.copy_(local)


def local_slice(full: torch.Tensor, mesh: tp.Any, placements: tp.Sequence[tp.Any]) -> torch.Tensor:
    """This rank's view of ``full`` under ``placements`` on ``mesh``: ``torch.chunk`` along each sharded
    dimension, as DTensor and FSDP2 split it (later ranks get a shorter chunk, or none); FSDP2 over a
    tensor-parallel split of the same dimension (a strided shard) splits by TP first, one block still
    (``hpc.compat.local_shape_and_offset``)."""
    if any(is_strided_shard(p) for p in placements):
        shape, offset = local_shape_and_offset(full.shape, mesh, placements)
        out = full
        for dim, (start, size) in enumerate(zip(offset, shape)):
            out = out.narrow(dim, start, size) if size != full.shape[dim] else out
        return out
    coordinate = mesh.get_coordinate()
    out = full
    for mesh_dim, placement in enumerate(placements):
        if placement.is_shard():
            chunks = torch.chunk(out, mesh.size(mesh_dim), dim=placement.dim)
            index = coordinate[mesh_dim]
            out = chunks[index] if index < len(chunks) else out.narrow(placement.dim, 0, 0)
    return out


def _is_nf4(t: torch.Tensor) -> bool:
    """torchao's NF4Tensor (``lora.base_dtype = "nf4"``): ``to_empty`` leaves parts of it on meta, so
    ``init_module`` makes it anew, whole, like a sharded parameter's full tensor."""
    return type(t).__name__ == "NF4Tensor"


def _is_dtensor(t: torch.Tensor) -> tp.TypeGuard[DTensor]:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _buffers_to(model: nn.Module, device: torch.device) -> None:
    for module in model.modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf.device != device:
                setattr(module, name, buf.to(device))


def local_numel(model: nn.Module) -> tuple[int, int]:
    """(elements this rank holds, elements of the whole model) over the model's parameters."""
    local = total = 0
    for p in model.parameters():
        local += p.to_local().numel() if _is_dtensor(p) else p.numel()
        total += p.numel()
    return local, total
