"""The model: the built-in GPT, or a user's ``package.module:function``; and how its weights are made.

Built-in GPT, from ``hpc.models.gpt_shape`` so the planner's counts hold by
construction: token + learned position embeddings, ``n_layers`` pre-LN blocks
(LayerNorm → causal SDPA attention → LayerNorm → 4× GELU MLP), a final
LayerNorm and an output head (tied to the token embedding when the shape says
so). Linear layers have no bias; LayerNorms have weight and bias. GPT-2 initialisation: N(0, 0.02), the two residual
projections of each block N(0, 0.02/sqrt(2·layers)), LayerNorms ones/zeros.

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
import importlib
import math
import typing as tp
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hpc.errors import ConfigError, UserError
from hpc.models import GPTShape, model_facts
from hpc.spec import Model as ModelSpec

DEFAULT_BLOCKS = "blocks"
GPT2_STD = 0.02


class Linear(nn.Linear):
    """A bias-free linear layer initialised N(0, std) as GPT-2 does (torch's default is kaiming-uniform)."""

    def __init__(self, d_in: int, d_out: int, std: float = GPT2_STD):
        self.std = std  # set first: nn.Linear.__init__ calls reset_parameters
        super().__init__(d_in, d_out, bias=False)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)


class Embedding(nn.Embedding):
    """An embedding initialised N(0, 0.02) (torch's default is N(0, 1))."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=GPT2_STD)


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float, residual_std: float):
        super().__init__()
        self.n_heads = n_heads
        self.dropout = dropout
        self.qkv = Linear(d_model, 3 * d_model)
        self.proj = Linear(d_model, d_model, residual_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (t.view(b, s, self.n_heads, d // self.n_heads).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, d))


class MLP(nn.Module):
    def __init__(self, d_model: int, residual_std: float):
        super().__init__()
        self.fc = Linear(d_model, 4 * d_model)
        self.proj = Linear(4 * d_model, d_model, residual_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """One pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_heads: int, dropout: float, residual_std: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout, residual_std)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, residual_std)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """The built-in GPT; ``GPT(shape).num_params() == shape.n_params``."""

    def __init__(self, shape: GPTShape, dropout: float = 0.0):
        super().__init__()
        self.shape = shape
        residual_std = GPT2_STD / math.sqrt(2 * max(1, shape.n_layers))
        self.tok_emb = Embedding(shape.vocab_size, shape.d_model)
        self.pos_emb = Embedding(shape.seq_len, shape.d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(shape.d_model, shape.n_heads, dropout, residual_std)
                                    for _ in range(shape.n_layers))
        self.ln_f = nn.LayerNorm(shape.d_model)
        self.head = Linear(shape.d_model, shape.vocab_size)
        if shape.tied:  # one matrix for both; parameters() lists it once, under tok_emb
            self.head.weight = self.tok_emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.tok_emb(tokens) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def fsdp_units(self) -> list[list[nn.Module]]:
        """The modules outside the blocks, as FSDP units in forward order: embeddings, final norm + head.
        A tied head shares its matrix with the token embedding, which one parameter cannot be in two
        units: then they all stay in the root unit."""
        if self.shape.tied:
            return []
        return [[self.tok_emb, self.pos_emb], [self.ln_f, self.head]]

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def build_model(spec: ModelSpec, device: str | torch.device) -> nn.Module:
    """The model of ``spec`` in fp32, built under ``torch.device(device)``: on ``meta`` nothing is
    allocated (the trainer; ``WeightInit`` materializes it later), elsewhere each module's
    constructor initialises it from the current torch RNG."""
    facts = model_facts(spec)
    with torch.device(device):
        if facts.gpt is not None:
            return GPT(facts.gpt, spec.dropout)
        if facts.llama is not None:
            from trainer.llama import Llama

            return Llama(facts.llama)
        model = _user_function(spec.arch)(**spec.kwargs)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"`model.arch` = {spec.arch!r} returned {type(model).__name__}, expected an nn.Module")
    return model


def _user_function(arch: str) -> tp.Callable[..., tp.Any]:
    module_name, function_name = arch.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"`model.arch` = {arch!r}: cannot import {module_name!r} here: {exc}") from exc
    if not callable(getattr(module, function_name, None)):
        raise ConfigError(f"`model.arch` = {arch!r}: module {module_name!r} has no function {function_name!r}")
    return getattr(module, function_name)


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
    sharded = {k: p for k, p in module.named_parameters(recurse=False) if _is_dtensor(p)}
    full = {k: nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
            for k, p in sharded.items()}
    with torch.no_grad(), _seeded(module_seed(seed, name), device), _swapped(module, full) as values:
        reset()
    with torch.no_grad():
        for k, p in sharded.items():
            copy_shard(p, values[k])


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
    """The torch RNG (CPU, and ``device`` if CUDA) seeded with ``seed``, restored afterwards."""
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda, device_type="cuda"):
        torch.manual_seed(seed)
        yield


def copy_shard(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of ``full`` into the DTensor ``param``; no communication."""
    local = local_slice(full, param.device_mesh, param.placements)
    target = param.to_local()
    if local.shape != target.shape:
        raise RuntimeError(f"shard of {tuple(full.shape)}: computed {tuple(local.shape)}, the parameter holds "
                           f"{tuple(target.shape)}")
    target.copy_(local)


def local_slice(full: torch.Tensor, mesh: tp.Any, placements: tp.Sequence[tp.Any]) -> torch.Tensor:
    """This rank's view of ``full`` under ``placements`` on ``mesh``: ``torch.chunk`` along each sharded
    dimension, as DTensor and FSDP2 split it (later ranks get a shorter chunk, or none)."""
    coordinate = mesh.get_coordinate()
    out = full
    for mesh_dim, placement in enumerate(placements):
        if placement.is_shard():
            chunks = torch.chunk(out, mesh.size(mesh_dim), dim=placement.dim)
            index = coordinate[mesh_dim]
            out = chunks[index] if index < len(chunks) else out.narrow(placement.dim, 0, 0)
    return out


def _is_dtensor(t: torch.Tensor) -> bool:
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
