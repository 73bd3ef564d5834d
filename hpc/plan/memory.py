"""Per-rank memory of one training configuration, from shapes alone (no torch).

What is modelled, and why (see docs/planner.md for the derivations):

- Model states (ZeRO accounting, AdamW): parameters are *stored* in fp32 under every
  strategy: DDP and ``none`` keep fp32 weights and get bf16/fp16 compute from autocast;
  FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)`` keeps the sharded parameters in fp32
  and casts each unit to bf16 when it all-gathers it. Those fp32 parameters are the master
  copy, so there is no separate master term: 4 (params) + 4 (fp32 grads) + 8 (two fp32
  Adam moments) = 16 bytes per parameter, divided by the shard degree. Another optimizer
  (``[optim]``) keeps its own number of fp32 copies (``hpc.core.optim.state_copies``: SGD with
  momentum one, without none; the Adam family two), ``Config.optimizer_bytes`` (resident after an
  optimizer step; at the step's peak FSDP rows with one micro-step count the gradients only
  where they outweigh the activations: ``peak_grads``). FSDP2 stores
  parameters sharded for every sharding; ``shard_grad_op`` pays for it in ``buffers``,
  where the whole unsharded compute copy is held from forward to backward.
- A LoRA run's frozen base is stored at ``lora.base_dtype`` (``stored_bytes``): bf16 (2 bytes; the
  default under bf16 compute) or NF4 (≈ 0.516 bytes with its block scales, the blocks' projections),
  with gradients and Adam state for the adapters only; autocast then copies only the trained matmul
  weights (``copied_matmuls``).
- Buffers: what exists only during a step (FSDP units gathered and prefetched, unsharded
  unit gradients before the reduce-scatter, DDP's gradient buckets, autocast's low-precision
  weight copies).
- Activations: each model family's own (``hpc.core.models``; the built-in GPT's is Korthikanti et
  al. 2022 accounting with fused SDPA attention, with and without per-block checkpointing).
- Packed documents (``data.packing = "document"``): what their attention kernel holds
  (``hpc.core.models.decoder.document_kernel``; ``document_bytes``). On a GPU flex_attention's BlockMask,
  O(seq²/128²) int32 per micro-batch, in ``buffers``; on a CPU (or with dropout) SDPA per document span,
  which keeps one more attention output per block (the spans' outputs and their concatenation) in
  ``activations``. No dense ``seq²`` mask on either.
- Start-up and checkpoint peaks (separate terms, beside the training total): ``init_bytes``
  while the trainer materializes the model (``trainer.model.WeightInit``), ``staging_bytes``
  for the host copy checkpoint saves keep.
"""

from __future__ import annotations

import math
import typing as tp
from dataclasses import dataclass

from hpc.core.dims import ParallelDims
from hpc.core import models
from hpc.core.lora import NF4_DEQUANT_BYTES, base_bytes
from hpc.core.models import ModelFacts, compute_bytes
from hpc.core.models.decoder import FLEX, block_mask_bytes, dense_mask_bytes, document_kernel

GB = 1e9
PARAM_BYTES = 4  # stored parameters: fp32 under every strategy (see module docstring)
GRAD_BYTES = 4  # gradients on the stored parameters: fp32
ADAM_BYTES = 8  # exp_avg + exp_avg_sq, fp32
REDUCE_BYTES = 4  # reduce_dtype = fp32 for every reduction
DDP_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb = 25
CONTEXT_GB = 2.0  # CUDA context (~0.5-1 GB) + NCCL communicator buffers (~1 GB), per GPU
FRAGMENTATION = 0.10  # caching-allocator fragmentation, as a fraction of the estimate
CPU_PROCESS_GB = 0.5  # a Python process with torch imported, per rank, on CPU sites
HOST_USABLE = 0.8  # share of a node's RAM the planner lets offloaded states use


@dataclass(frozen=True)
class Config:
    """One candidate's shape: how the states are split and what each step runs."""

    dims: ParallelDims  # how the ranks split the model
    offload: bool
    mixed_precision: str
    checkpointing: bool
    micro_batch: int
    dropout: float = 0.0
    async_save: bool = False  # checkpoint.async_save: saves keep a host copy of the states
    grad_accum: int = 1  # micro-steps per optimizer step: FSDP's gradients outlive a micro-step only when > 1
    document_mask: bool = False  # data.packing = "document": its attention kernel's holdings (document_bytes)
    gpu: bool = True  # a GPU site (the document kernel is flex_attention there, SDPA per span on CPUs)
    reshard_after_forward: bool = True  # parallel.reshard_after_forward: false keeps every unit gathered all step
    optimizer_bytes: int = ADAM_BYTES  # optimizer state per trained parameter (hpc.core.optim.state_bytes)

    @property
    def reshards(self) -> bool:
        """Whether FSDP frees each unit's gathered parameters after its forward (full_shard, and the spec's
        ``reshard_after_forward`` left true)."""
        return self.dims.reshard_after_forward and self.reshard_after_forward

    @property
    def keeps_gathered(self) -> bool:
        """Whether gathered units outlive a micro-batch (``reshard_after_forward`` = false under FSDP)."""
        return self.dims.fsdp_enabled and not self.reshard_after_forward


@dataclass
class Memory:
    """Bytes per rank, in GB. ``activations`` is None when unknown."""

    params: float
    grads: float
    optimizer: float
    buffers: float
    activations: float | None
    host_per_node: float = 0.0  # offloaded states on the host, all ranks of a node
    notes: tuple[str, ...] = ()
    init: float = 0.0  # start-up peak on the device while the weights are materialized (init_bytes)
    staging: float = 0.0  # host memory per rank that checkpoint saves keep (staging_bytes)
    staging_per_node: float = 0.0  # the same for all ranks of a node

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.buffers + (self.activations or 0.0)


def headroom_gb(total_gb: float, gpu: bool) -> float:
    """CUDA context and NCCL buffers (a process's own footprint on CPU sites) plus fragmentation."""
    return (CONTEXT_GB if gpu else CPU_PROCESS_GB) + FRAGMENTATION * total_gb


def sharded_numel(n_params: int, shard: int, shapes: tp.Sequence[tuple[int, ...]] = ()) -> int:
    """Parameter elements one rank stores when each tensor is split on dim 0 into ``shard`` chunks
    (FSDP2): every rank's storage is padded to the first chunk, ceil(dim0 / shard) rows, so a tensor
    whose dim 0 does not divide (a small model on many ranks) costs more than its share. Without
    ``shapes``, ceil(n_params / shard)."""
    if not shapes:
        return math.ceil(n_params / shard)
    return sum(math.ceil(s[0] / shard) * math.prod(s[1:]) for s in shapes if s)


def tp_shapes(shapes: tp.Sequence[tuple[int, ...]], split: tp.Sequence[int], degree: int) -> list[tuple[int, ...]]:
    """Each parameter's local shape on one rank of a tensor-parallel group of ``degree`` (DTensor
    ``Shard(dim)``: ceil(size / degree) on the fullest rank; -1 replicated). FSDP2 then shards the
    local tensor on dim 0 over the data-parallel shard group."""
    if degree <= 1:
        return list(shapes)
    out = []
    for shape, dim in zip(shapes, split):
        if dim < 0 or dim >= len(shape):
            out.append(tuple(shape))
        else:
            out.append(tuple(math.ceil(n / degree) if i == dim else n for i, n in enumerate(shape)))
    return out


def rank_numel(facts: ModelFacts, dims: ParallelDims) -> int:
    """Parameter elements one rank stores: its tensor-parallel slice of each tensor, FSDP-sharded."""
    n = facts.n_params or 0
    if dims.tp > 1 and not (facts.tp_split and facts.param_shapes):  # no TP plan: an even split, as a bound
        return math.ceil(n / (dims.dp_shard * dims.tp))
    return sharded_numel(n, dims.dp_shard, tp_shapes(facts.param_shapes, facts.tp_split, dims.tp))


def model_states(n_params: int, cfg: Config, shapes: tp.Sequence[tuple[int, ...]] = (),
                 facts: ModelFacts | None = None, trainable: int | None = None,
                 trainable_shapes: tp.Sequence[tuple[int, ...]] = ()) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes resident per rank after an optimizer step (on the fullest
    rank: with uneven dim-0 splits, later ranks hold shorter shards); under tensor parallelism
    (``facts`` with a TP plan) each tensor's TP slice is what FSDP shards. Gradients and optimizer state
    exist for the ``trainable`` parameters only (LoRA: ``ModelFacts.trainable_params``; None: all)."""
    if facts is not None and cfg.dims.tp > 1:
        per_rank = rank_numel(facts, cfg.dims)
    else:
        per_rank = sharded_numel(n_params, cfg.dims.dp_shard, shapes)
    trained = per_rank if trainable is None else sharded_numel(trainable, cfg.dims.dp_shard, trainable_shapes)
    return stored_bytes(per_rank, trained, cfg, facts), trained * GRAD_BYTES, trained * cfg.optimizer_bytes


def stored_bytes(per_rank: int, trained: int, cfg: Config, facts: ModelFacts | None) -> float:
    """Bytes of the rank's parameters: fp32, but a LoRA run's frozen base at ``lora.base_dtype``
    (``hpc.core.lora.base_bytes``: bf16 2 bytes, NF4 ≈ 0.516 bytes with its scales, held whole on
    each rank: nf4 runs are never sharded)."""
    if facts is None or facts.trainable_params is None:
        return per_rank * PARAM_BYTES
    rest, nf4 = base_bytes(facts.base_dtype, cfg.mixed_precision)
    frozen = per_rank - trained
    return trained * PARAM_BYTES + frozen * rest - min(facts.nf4_params, frozen) * (rest - nf4)


def trained_share(facts: ModelFacts) -> float:
    """The share of the parameters that trains (1 unless LoRA freezes the base): gradients, optimizer
    state and the gradient collectives (DDP buckets and FSDP2 reduces only parameters with
    ``requires_grad``; the all-gathers still carry every parameter) are for this share."""
    if facts.trainable_params is None or not facts.n_params:
        return 1.0
    return facts.trainable_params / facts.n_params


def buffer_bytes(facts: ModelFacts, cfg: Config) -> tuple[float, list[str]]:
    """Transient per-step memory on the device, with a note per term."""
    t = cfg.dims.tp  # under TP every gathered unit is the rank's TP slice (norms, a few kB, counted split too)
    n, unit, root = (facts.n_params or 0) / t, (facts.unit_params or 0) / t, (facts.root_params or 0) / t
    c = compute_bytes(cfg.mixed_precision)
    if not cfg.dims.fsdp_enabled:
        total, notes = _replica_buffers(copied_matmuls(facts, cfg), c, cfg)
        if facts.nf4_largest:
            notes.append("one NF4 projection dequantized at a time for its matmul")
            total += facts.nf4_largest * NF4_DEQUANT_BYTES
        return total, notes
    extra_reduce = REDUCE_BYTES if c != REDUCE_BYTES else 0
    grads = (unit * (c + extra_reduce) + root * c) * trained_share(facts)  # one unit's unsharded grads (+ fp32), the root's
    if cfg.reshards:
        gathered = root * c + 2 * unit * c  # root stays gathered; current unit + the prefetched next
        note = f"root + 2 blocks gathered in {_dtype(c)}"
    else:  # shard_grad_op / no_shard / reshard_after_forward = false: every unit unsharded from forward to backward
        gathered = n * c
        note = f"all parameters unsharded in {_dtype(c)} from forward to backward" + (
            " and across micro-batches (reshard_after_forward = false)" if cfg.keeps_gathered else "")
    return gathered + grads, [note, "one block's unsharded gradients before the reduce-scatter"]


def copied_matmuls(facts: ModelFacts, cfg: Config) -> int:
    """The matmul weights autocast copies to the compute dtype: all of them, but under a LoRA base
    stored in bf16 or NF4 only the trained ones (a bf16 weight is not cast again; torchao dequantizes
    an NF4 one per call, one projection at a time, and saves the 4-bit tensor for backward)."""
    matmul = facts.n_params or 0 if facts.matmul_params is None else facts.matmul_params
    if facts.trainable_params is None:
        return matmul
    return matmul if base_bytes(facts.base_dtype, cfg.mixed_precision)[0] == PARAM_BYTES else min(
        matmul, facts.trainable_params)


def _replica_buffers(matmul: int, c: int, cfg: Config) -> tuple[float, list[str]]:
    """Autocast's bf16/fp16 copies of the matmul weights (cached from forward to backward)."""
    total, notes = 0.0, []
    if c < PARAM_BYTES:
        total += matmul * c
        notes.append(f"autocast {_dtype(c)} weight copies held from forward to backward")
    if cfg.dims.ddp_enabled:
        # the trainer sets gradient_as_bucket_view=True: the buckets are the gradients, no second copy
        notes.append("DDP buckets are views of the gradients (gradient_as_bucket_view)")
    return total, notes


def _dtype(c: int) -> str:
    return "fp32" if c == 4 else "bf16/fp16"


def activation_bytes(facts: ModelFacts, cfg: Config) -> float | None:
    """Activation bytes of one micro-batch at its peak, from the model's family (``hpc.core.models``);
    None when unknown."""
    return models.activation_bytes(facts, cfg.micro_batch, cfg.checkpointing, cfg.mixed_precision, cfg.dropout,
                                   autocast=not cfg.dims.fsdp_enabled, tp=cfg.dims.tp)


def estimate(facts: ModelFacts, cfg: Config, tasks_per_node: int) -> Memory | None:
    """Per-rank memory of ``cfg``; None when the parameter count is unknown."""
    if facts.n_params is None:
        return None
    params, grads, opt = model_states(facts.n_params, cfg, facts.param_shapes, facts, facts.trainable_params,
                                      facts.trainable_shapes)
    init, staging = init_bytes(facts, cfg), staging_bytes(facts, cfg)
    buffers, notes = buffer_bytes(facts, cfg)
    act = activation_bytes(facts, cfg)
    if cfg.document_mask:
        held, kept, note = document_bytes(facts, cfg)
        buffers += held
        act = None if act is None else act + kept
        notes.append(note)
    if cfg.dims.fsdp_enabled and not cfg.offload and cfg.grad_accum == 1 and act is not None:
        grads = peak_grads(grads, act)
        notes.append("gradients: none at the loss backward (freed after every step); counted where "
                     "all of them outweigh the activations they replace")
    host = 0.0
    if cfg.offload:
        host = (params + grads + opt) * tasks_per_node / GB
        params = grads = opt = 0.0
        notes.append("parameters, gradients and optimizer state on the host; the optimizer steps on the CPU")
    if act is None:
        notes.append("activations unknown: set model.activation_gb (measured GB per sample)")
    return Memory(params / GB, grads / GB, opt / GB, buffers / GB, None if act is None else act / GB,
                  host_per_node=host, notes=tuple(notes), init=init / GB, staging=staging / GB,
                  staging_per_node=staging * tasks_per_node / GB)


def document_bytes(facts: ModelFacts, cfg: Config) -> tuple[float, float, str]:
    """(buffer bytes, activation bytes, note) of packed documents' attention at ``cfg``'s kernel
    (``trainer.models.decoder.DocumentAttention``): flex_attention's BlockMask of one micro-batch, shared
    by the layers; or, SDPA per document span, the spans' outputs each block keeps beside their
    concatenation (one [tokens, q_dim] tensor per block; one block's under activation checkpointing)."""
    b, s = cfg.micro_batch, facts.seq_len
    if document_kernel(cfg.gpu, cfg.dropout) == FLEX:
        held = block_mask_bytes(b, s)
        return held, 0.0, f"document BlockMask (flex_attention): {held / 2**20:.1f} MiB per micro-batch, O(seq²/128²)"
    shape = facts.shape
    q_dim = getattr(shape, "q_dim", getattr(shape, "d_model", 0))
    blocks = 1 if cfg.checkpointing else getattr(shape, "n_layers", 0)
    kept = blocks * b * s * q_dim * compute_bytes(cfg.mixed_precision) / cfg.dims.tp
    return 0.0, kept, "documents attend by SDPA per span (no mask): one more attention output per block"


def mask_bytes(micro_batch: int, seq_len: int) -> int:
    """The dense boolean document mask of one micro-batch (the ``mask`` kernel: ``hpcx dryrun``'s meta
    build, never a training step's): ``[micro_batch, 1, seq_len, seq_len]``."""
    return dense_mask_bytes(micro_batch, seq_len)


def peak_grads(grads: float, activations: float) -> float:
    """The gradient bytes an FSDP2 rank adds to its peak, with one micro-step per optimizer step. The
    trainer drops the gradients after every step (``zero_grad(set_to_none=True)``), so at the loss
    backward, where every activation is alive, there are none; backward then frees activations as it
    makes sharded gradients, and after it all gradients and no activations are held. The step's peak
    is the larger of the two ends: the activations' total, or the gradients' where those outweigh
    it. (With several micro-steps the earlier ones' gradients are all there at the last one's peak;
    DDP's buckets and ``none``'s gradients are still counted whole.)"""
    return max(0.0, grads - activations)


# ---- start-up and checkpoint peaks (kept apart from the training terms above; docs/planner.md)


def init_bytes(facts: ModelFacts, cfg: Config) -> float:
    """Device bytes per rank while the trainer materializes a model built on the meta device
    (``trainer.model.WeightInit``): the rank's fp32 parameters (its shard under FSDP, on the host
    under offload) plus, under FSDP, the largest module's full fp32 tensors, which are computed
    whole and sliced (whole replicas are initialised in place). Gradients and optimizer state do
    not exist yet."""
    per_rank = rank_numel(facts, cfg.dims)
    trained = per_rank if facts.trainable_params is None else sharded_numel(
        facts.trainable_params, cfg.dims.dp_shard, facts.trainable_shapes)
    params = 0 if cfg.offload else stored_bytes(per_rank, trained, cfg, facts)
    module = (facts.largest_module_params or 0) if cfg.dims.fsdp_enabled else 0
    # (an NF4 weight is also computed whole before it is quantized, one projection at a time: ≤ 0.12 GB at 8B)
    return params + module * PARAM_BYTES


def staging_bytes(facts: ModelFacts, cfg: Config) -> float:
    """Host bytes per rank that checkpoint saves hold. Async saves copy the rank's parameters and
    optimizer state into host buffers kept from one save to the next (``ReusedStager``, pinned on
    CUDA); a synchronous save copies one tensor at a time to the host (about the largest module's
    share)."""
    per_rank = rank_numel(facts, cfg.dims)
    if cfg.async_save:  # a frozen base is not saved: LoRA's checkpoints hold the trainable part only
        return per_rank * (PARAM_BYTES + cfg.optimizer_bytes) * trained_share(facts)
    return math.ceil((facts.largest_module_params or 0) / (cfg.dims.dp_shard * cfg.dims.tp)) * PARAM_BYTES


def peaks_note(facts: ModelFacts, async_save: bool, gpu: bool) -> str:
    """One line for ``hpcx plan`` saying what the init and staging figures count."""
    module = f"{facts.largest_module_params:,}" if facts.largest_module_params else "?"
    staging = ("async checkpoint saves keep a host copy of each rank's params + optimizer state"
               if async_save else "synchronous saves copy one tensor at a time to the host")
    where = "host/node (with offloaded states)" if gpu else "+headroom (host memory is the rank's memory)"
    return (f"init = the rank's fp32 parameters (+ under fsdp/hsdp the largest module's full fp32 tensors, "
            f"{module} params) while the weights are materialized; +headroom covers the larger of total and init; "
            f"{staging}, counted in {where}")
