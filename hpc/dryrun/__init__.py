"""``hpcx dryrun``: the real trainer construction for one rank, at the job's full world size, on one CPU.

The same code the job runs — spec, site, launch (``hpc.core.resolve``), the device mesh, the model
built on the meta device and ``parallelize``-d (``trainer.train.build_parallel_model``), the
optimizer (``trainer.optim.build_optimizer``) and the checkpoint state (``trainer.checkpoint``)
— runs in this process as rank R of a W-rank job on torch's fake process group (``hpc.dryrun.fake_pg``):
collectives return at once, nothing is allocated (every tensor is on the meta device), no GPU is
needed. What it reports is read off the real objects:

- the mesh: its dimensions, this rank's coordinate, and which nodes each group spans;
- the FSDP units (``trainer.parallelize.fsdp_units``) with their parameters and this rank's shard;
- the DTensor placements of every parameter (``placements``: names with the block index as ``*``,
  e.g. ``blocks.*.attn.wq.weight``; under ``parallel.tp`` a column-wise matrix is FSDP's strided
  shard over TP's ``Shard(0)``, a row-wise one ``Shard(0)`` × ``Shard(1)``); a parameter that is no
  DTensor under FSDP is a problem;
- bytes per rank of parameters, gradients and optimizer state: parameters from the sharded
  DTensors' storage (FSDP2 pads each shard to the first rank's chunk), gradients in the same
  layout (FSDP2 reduce-scatters into it; DDP's buckets are views of whole gradients), optimizer
  state from the real AdamW state after one step on meta tensors (fused AdamW has no meta kernel,
  so that one step runs unfused: same state tensors);
- the DCP local save plan of this rank (``torch.distributed.checkpoint``'s own planner);
- with ``data.packing = "document"``, the attention kernel of packed documents at the site and, for
  flex_attention's, its BlockMask of one micro-batch built by the models' own ``block_mask`` on meta,
  beside the planner's ``block_mask_bytes``;
- with ``checkpoint.init_from``, what this rank will read of it (``trainer.init_from.read_plan``:
  its shard's byte ranges of a safetensors source).

Before any of it, what would fail the job before its first step and every restart the same way
(``hpc.dryrun.startup``: a user model that does not import or build, ``model.blocks`` that is no
ModuleList, modules without ``reset_parameters()``, a forward whose output the loss cannot use) is
one line each, exit 2.

Beside them, ``hpcx plan``'s figures for the same layout (``hpc.plan.memory.model_states``); a
difference of more than 1% is a problem (``hpcx dryrun`` exits 1). The plan gives the fullest
rank; on a rank whose shards are shorter (dimensions that do not divide by the shard count),
only a measurement above the plan counts.

Unlike ``render`` and ``plan``, this module imports torch (and the trainer), and nothing that
needs a GPU.
"""

from __future__ import annotations

import math
import re
import resource
import time
import typing as tp
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from hpc.ckpt import formats
from hpc.ckpt.init_source import open_source
from hpc.compat import is_nf4_tensor, memoized_strided_shards
from hpc.core.lora import with_lora
from hpc.dryrun.fake_pg import fake_process_group
from hpc.core.models.decoder import FLEX, FLEX_BLOCK, block_mask_bytes, document_kernel
from hpc.plan.memory import Config, init_bytes, model_states, staging_bytes
from hpc.core.models import count_text, model_facts
from hpc.core.resolve import Launch, launch_parallel
from hpc.core.site import SiteProfile
from hpc.core.optim import state_bytes
from hpc.core.spec import JobSpec
from hpc.dryrun.startup import checked_model
from trainer.checkpoint import build_state
from trainer.init_from import read_plan
from trainer.models.decoder import block_mask
from trainer.optim import build_optimizer, build_scheduler
from trainer.parallelize import blocks_for, fsdp_units, mesh_groups, unit_reshard

TOLERANCE = 0.01
STATES = ("params", "grads", "optimizer")


@dataclass
class Unit:
    """One FSDP unit: its modules, parameters, this rank's shard and whether it reshards after forward."""

    modules: list[str]
    params: int
    shard_bytes: int
    reshard_after_forward: bool | None  # None: the root (FSDP2 keeps it gathered)


@dataclass
class DryRun:
    """What ``hpcx dryrun`` found for one rank (bytes are per rank)."""

    job: str
    site: str
    model: str
    rank: int
    world_size: int
    tasks_per_node: int
    layout: str
    dims: dict[str, tp.Any]
    mesh: dict[str, tp.Any]
    units: list[Unit]
    n_params: int
    measured: dict[str, int]
    planned: dict[str, int] | None
    where: str
    short_shards: bool
    checkpoint: dict[str, tp.Any]
    plan_init: int | None
    plan_staging: int | None
    seconds: float = 0.0
    peak_rss_bytes: int = 0
    problems: list[str] = field(default_factory=list)
    init_from: dict[str, tp.Any] | None = None  # this rank's reads of checkpoint.init_from
    placements: dict[str, str] = field(default_factory=dict)  # parameter (blocks.* collapsed) -> its placements
    forward: str | None = None  # a user model's forward on a meta batch (hpc.dryrun.startup), None for built-ins
    mask: dict[str, tp.Any] | None = None  # data.packing = "document": its kernel, the mask's bytes built and planned

    def to_dict(self) -> dict[str, tp.Any]:
        return asdict(self)


def dryrun(spec: JobSpec, site: SiteProfile, launch: Launch, rank: int = 0) -> DryRun:
    """Build ``spec`` as rank ``rank`` of ``launch`` on the fake process group and measure it."""
    from trainer.tasks import task_for  # lazy: numpy
    from trainer.train import build_parallel_model  # lazy: numpy

    started = time.perf_counter()
    bare, forward = checked_model(spec, launch)  # what would fail before step 1: one line each, exit 2
    with fake_process_group(launch.world_size, rank), memoized_strided_shards():  # tp: FSDP over TP rows
        model, mesh = build_parallel_model(spec, launch, torch.device("meta"), materialize=False, model=bare)
        optimizer = build_optimizer(model, spec.train, optim=spec.optim)
        step_on_meta(model, optimizer)
        blocks = blocks_for(task_for(spec, launch.data_source).blocks, model, launch_parallel(spec, launch), launch.dims)
        units = unit_report(model, blocks, launch.dims.reshard_after_forward and spec.parallel.reshard_after_forward)
        measured, short = rank_bytes(model, optimizer)
        checkpoint = checkpoint_plan(model, optimizer, spec, launch, rank)
        mesh_doc = mesh_report(mesh, launch, rank)
        reads = init_reads(model, spec)
        placements, plain = placement_report(model)
    result = DryRun(job=spec.job.name, site=site.name, model=model_facts(spec.model).label, rank=rank,
                    world_size=launch.world_size, tasks_per_node=launch.tasks_per_node,
                    layout=launch.dims.describe(), dims=launch.dims.to_dict(), mesh=mesh_doc, units=units,
                    n_params=sum(p.numel() for p in model.parameters()), measured=measured,
                    planned=None, where=_where(spec, site, launch), short_shards=short, checkpoint=checkpoint,
                    plan_init=None, plan_staging=None)
    result.init_from, result.forward, result.placements = reads, forward, placements
    result.mask = mask_report(spec, site.node.gpus > 0)
    if launch.dims.fsdp_enabled and plain:
        result.problems.append(f"{len(plain)} parameters are no DTensor under FSDP: {', '.join(plain[:4])}")
    add_plan(result, spec, launch, site.node.gpus > 0)
    result.seconds = time.perf_counter() - started
    result.peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return result


# ---------------------------------------------------------------- measuring the real objects


def init_reads(model: nn.Module, spec: JobSpec) -> dict[str, tp.Any] | None:
    """What this rank reads of ``checkpoint.init_from`` (headers only; byte ranges for safetensors)."""
    if not spec.checkpoint.init_from:
        return None
    facts = model_facts(spec.model)
    source = open_source(spec.checkpoint.init_from, facts.family, facts.shape)
    planned = formats.get(source.kind).planned_reads  # its byte ranges are known from the headers
    reads = sum(r.length for r in read_plan(model, source)) if planned else None
    return {"path": str(source.step or source.path), "kind": source.kind, "bytes": reads,
            "source_bytes": source.nbytes}


def mask_report(spec: JobSpec, gpu: bool) -> dict[str, tp.Any] | None:
    """Packed documents' attention kernel at the site (``hpc.core.models.decoder.document_kernel``) and
    what it holds per micro-batch: flex_attention's BlockMask as the models build it (on meta) beside
    the planner's count; the per-span kernel holds no mask (0 and 0)."""
    if spec.data.packing != "document":
        return None
    batch, seq = spec.train.micro_batch, model_facts(spec.model).seq_len
    kernel = document_kernel(gpu, spec.model.dropout)
    built = planned = 0
    if kernel == FLEX:
        mask = block_mask(torch.zeros(batch, seq, dtype=torch.long, device="meta"), 0)
        built = sum(t.numel() * t.element_size() for t in mask.as_tuple() if isinstance(t, torch.Tensor))
        planned = block_mask_bytes(batch, seq)
    return {"kernel": kernel, "micro_batch": batch, "seq_len": seq, "bytes": built, "planned": planned}


def placement_report(model: nn.Module) -> tuple[dict[str, str], list[str]]:
    """({parameter name, block index as ``*``: its mesh dimensions and placements}, names of plain
    tensors). Blocks whose placements differ keep their own names."""
    seen: dict[str, set[str]] = {}
    plain = []
    for name, p in model.named_parameters():
        name = name.replace("_checkpoint_wrapped_module.", "")
        if not isinstance(p, DTensor):
            plain.append(name)
            continue
        names = p.device_mesh.mesh_dim_names or ()
        text = ", ".join(f"{n}: {pl}" for n, pl in zip(names, p.placements))
        seen.setdefault(re.sub(r"\.\d+\.", ".*.", name, count=1), set()).add(text)
    out = {}
    for name, texts in seen.items():
        out.update({name: next(iter(texts))} if len(texts) == 1 else {f"{name} [{i}]": t for i, t in enumerate(sorted(texts))})
    return out, plain


def step_on_meta(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """One optimizer step on zero meta gradients, so the optimizer creates its state as it will in
    the job (AdamW creates it lazily, shaped like each parameter's local shard)."""
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    fused = [g for g in optimizer.param_groups if g.get("fused")]
    for group in fused:
        group["fused"] = False  # no meta kernel for fused AdamW; the state it creates is the same
    try:
        optimizer.step()
    finally:
        for group in fused:
            group["fused"] = True
        optimizer.zero_grad(set_to_none=True)


def local_bytes(t: torch.Tensor) -> tuple[int, int]:
    """(bytes this rank stores for ``t``, bytes of its visible local part). A DTensor's local shard
    is a view into FSDP2's padded storage, so the two differ on ranks with a shorter chunk."""
    if is_nf4_tensor(t):  # a QLoRA base: its 4-bit data and scales, not numel × the dtype it dequantizes to
        names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]  # a traceable tensor subclass
        n = sum(getattr(t, k).numel() * getattr(t, k).element_size() for k in names)
        return n, n
    if not isinstance(t, DTensor):
        n = t.numel() * t.element_size()
        return n, n
    local = t.to_local()
    visible = local.numel() * local.element_size()
    return max(visible, local.untyped_storage().nbytes()), visible


def rank_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, int], bool]:
    """({params, grads, optimizer: bytes on this rank}, whether some shard is shorter than its storage)."""
    params = grads = 0
    short = False
    with torch.no_grad():
        for p in model.parameters():
            stored, visible = local_bytes(p)
            params += stored
            grads += stored if p.requires_grad else 0
            short |= visible < stored
        states = sum(local_bytes(v)[0] for state in optimizer.state.values() for v in state.values()
                     if isinstance(v, torch.Tensor))
    return {"params": params, "grads": grads, "optimizer": states}, short


def unit_report(model: nn.Module, blocks: nn.ModuleList, reshard_after_forward: bool) -> list[Unit]:
    """The FSDP units ``apply_fsdp`` made, in its order (none when the layout is not FSDP)."""
    if not isinstance(model, FSDPModule):
        return []
    names = {m: n for n, m in model.named_modules()}
    groups = fsdp_units(model, blocks)
    flags = unit_reshard(len(blocks), len(groups) - 1, reshard_after_forward) + [None]
    claimed: set[int] = set()
    units = []
    for group, flag in zip(groups, flags):
        own = [p for m in group for p in m.parameters() if id(p) not in claimed]
        claimed |= {id(p) for p in own}
        units.append(Unit([names[m] or "(root)" for m in group], sum(p.numel() for p in own),
                          sum(local_bytes(p)[0] for p in own), flag))
    return units


def checkpoint_plan(model: nn.Module, optimizer: torch.optim.Optimizer, spec: JobSpec, launch: Launch,
                    rank: int) -> dict[str, tp.Any]:
    """This rank's DCP local save plan for the trainer's checkpoint state: tensors, shards, bytes."""
    state = build_state(model, optimizer, build_scheduler(optimizer, spec.train, spec.optim), 0, {"step": 0}, launch.dims)
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, None, is_coordinator=rank == 0)
    items = planner.create_local_plan().items
    tensors = [i for i in items if i.tensor_data is not None]
    nbytes = sum(math.prod(d.chunk.sizes) * d.properties.dtype.itemsize for i in tensors if (d := i.tensor_data))
    return {"tensors": len(tensors), "shards": sum(i.type.name == "SHARD" for i in tensors),
            "bytes": nbytes, "other_items": len(items) - len(tensors)}



def mesh_report(mesh: tp.Any, launch: Launch, rank: int) -> dict[str, tp.Any]:
    """The mesh's dimensions, this rank's coordinate, and for each dimension its groups' spread over nodes."""
    tpn = launch.tasks_per_node
    doc: dict[str, tp.Any] = {"node": rank // tpn, "local_rank": rank % tpn, "shape": None, "names": None,
                              "coordinate": None, "dims": {}}
    if mesh is None:
        return doc
    doc.update(shape=list(mesh.mesh.shape), names=list(mesh.mesh_dim_names), coordinate=list(mesh.get_coordinate()))
    for name, groups in mesh_groups(mesh).items():
        mine = next(g for g in groups if rank in g)
        doc["dims"][name] = {"groups": len(groups), "size": len(mine), "mine": mine,
                             "nodes_of_mine": sorted({r // tpn for r in mine}),
                             "max_nodes_per_group": max(len({r // tpn for r in g}) for g in groups)}
    return doc


def _where(spec: JobSpec, site: SiteProfile, launch: Launch) -> str:
    if launch.dims.fsdp_enabled and launch_parallel(spec, launch).cpu_offload:
        return "host (cpu_offload)"
    return "GPU" if site.node.gpus else "host (CPU site)"


# ---------------------------------------------------------------- beside the plan


def add_plan(result: DryRun, spec: JobSpec, launch: Launch, gpu: bool = True) -> None:
    """``hpcx plan``'s figures for this layout, and every difference over TOLERANCE as a problem."""
    facts = with_lora(model_facts(spec.model), spec)
    if facts.n_params is None:
        return  # a user model: the planner cannot count it without torch; nothing to compare
    parallel = launch_parallel(spec, launch)
    offload = launch.dims.fsdp_enabled and parallel.cpu_offload
    cfg = Config(launch.dims, offload, parallel.mixed_precision, parallel.activation_checkpointing,
                 spec.train.micro_batch, spec.model.dropout, spec.checkpoint.async_save,
                 document_mask=spec.data.packing == "document", gpu=gpu, optimizer_bytes=state_bytes(spec))
    states = model_states(facts.n_params, cfg, facts.param_shapes, facts, facts.trainable_params,
                          facts.trainable_shapes)
    result.planned = {k: int(v) for k, v in zip(STATES, states)}
    result.plan_init, result.plan_staging = int(init_bytes(facts, cfg)), int(staging_bytes(facts, cfg))
    if result.n_params != facts.n_params:
        result.problems.append(f"the built model has {result.n_params:,} parameters, the planner counts "
                               f"{facts.n_params:,}")
    for what in STATES:
        got, want = result.measured[what], result.planned[what]
        off = (got - want) / want if want else float(got != 0)
        if abs(off) > TOLERANCE and not (result.short_shards and off < 0):
            result.problems.append(f"{what}: dryrun {_gb(got)} vs plan {_gb(want)} per rank ({off:+.1%})")


# ---------------------------------------------------------------- words


def _gb(n: float) -> str:
    return f"{n / 1e9:.3f} GB" if n < 1e10 else f"{n / 1e9:.1f} GB"


def _count(n: int) -> str:
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def model_text(label: str, n_params: int) -> str:
    """The model once, with its parameter count once: the label already carries the planner's count
    ("gpt 70b (65.3B params)"); the built count is added only where the label has none or differs."""
    unknown = " (parameters unknown)"
    if label.endswith(unknown):
        return f"{label[:-len(unknown)]} ({_count(n_params)} params built)"
    if f"({count_text(n_params)} params" in label:
        return label
    return f"{label}; {_count(n_params)} params built"


def format_dryrun(r: DryRun) -> str:
    """The report as text: who, mesh, units, bytes beside the plan, checkpoint, cost."""
    lines = [f"dryrun {r.job}: {model_text(r.model, r.n_params)} on {r.site} as rank {r.rank} of "
             f"{r.world_size} (node {r.mesh['node']}, local rank {r.mesh['local_rank']}); one CPU process on "
             "torch's fake process group, every tensor on the meta device",
             f"layout: {r.layout}"]
    lines += _mesh_lines(r) + _unit_lines(r) + _placement_lines(r) + _bytes_lines(r)
    c = r.checkpoint
    lines.append(f"checkpoint (DCP local plan of this rank): {c['tensors']} tensors ({c['shards']} DTensor shards), "
                 f"{_gb(c['bytes'])}, {c['other_items']} other items; replicated items are written by one rank "
                 "(DCP's global plan)")
    if r.init_from is not None:
        i = r.init_from
        reads = (f"this rank reads {_gb(i['bytes'])} of {_gb(i['source_bytes'])} "
                 f"({i['bytes'] / max(1, i['source_bytes']):.1%}), its shard's byte ranges" if i["bytes"] is not None
                 else "read through DCP's load planner (the stored chunks this rank's shard overlaps)")
        lines.append(f"init_from {i['path']} ({i['kind']}): {reads}")
    if r.forward is not None:
        lines.append(f"forward (user model, on the meta device): {r.forward}")
    if r.mask is not None:
        m = r.mask
        lines.append(mask_line(m))
    lines.append(f"took {r.seconds:.1f} s, peak RSS {r.peak_rss_bytes / 2**30:.2f} GiB")
    if r.problems:
        lines += ["", f"dryrun and plan differ by more than {TOLERANCE:.0%}:"] + [f"  {p}" for p in r.problems]
    return "\n".join(lines)


def mask_line(m: dict[str, tp.Any]) -> str:
    """The document attention line of ``format_dryrun``."""
    if m["kernel"] != "flex":
        return ("document attention (data.packing = document): SDPA per document span, no mask; the plan keeps "
                "one more attention output per block in the activations")
    n = -(-m["seq_len"] // FLEX_BLOCK)
    return (f"document attention (data.packing = document): flex_attention, BlockMask [{m['micro_batch']}, 1, {n}, {n}] "
            f"int32 ×4 and counts per micro-batch, {m['bytes']:,} bytes built on meta; plan {m['planned']:,}, in buffers")


def _mesh_lines(r: DryRun) -> list[str]:
    m, tpn = r.mesh, r.tasks_per_node
    nodes = [f"nodes: {r.world_size // tpn} × {tpn} ranks (node k holds ranks {tpn}k..{tpn}k+{tpn - 1}); this "
             f"rank's node {m['node']} holds {_ranks(list(range(m['node'] * tpn, (m['node'] + 1) * tpn)))}"]
    if m["shape"] is None:
        group = "the default group of all ranks" if r.world_size > 1 else "no process group in the job"
        return nodes + [f"mesh: none ({r.dims['strategy']} uses {group})"]
    dims = " × ".join(f"{n}={s}" for n, s in zip(m["names"], m["shape"]))
    lines = nodes + [f"mesh: ({dims}); this rank's coordinate {tuple(m['coordinate'])}"]
    for name, d in m["dims"].items():
        spread = "each inside one node" if d["max_nodes_per_group"] == 1 else \
            f"each across up to {d['max_nodes_per_group']} nodes"
        groups = f"{d['groups']} group{'s' if d['groups'] > 1 else ''}"
        lines.append(f"  {name}: {groups} of {d['size']} ranks, {spread}; this rank's: "
                     f"{_ranks(d['mine'])} on node(s) {_ranks(d['nodes_of_mine'])}")
    return lines


def _ranks(xs: list[int]) -> str:
    if len(xs) > 2 and xs == list(range(xs[0], xs[-1] + 1)):
        return f"{xs[0]}..{xs[-1]}"
    return ", ".join(map(str, xs)) if len(xs) <= 8 else f"{', '.join(map(str, xs[:4]))}, ... {xs[-1]} ({len(xs)})"


def _unit_lines(r: DryRun) -> list[str]:
    if not r.units:
        return [f"FSDP units: none ({r.dims['strategy']}: every rank holds the whole model"
                + ("; the DDP wrapper needs real tensors and is not built in a dry run)" if r.dims["strategy"] == "ddp"
                   else ")")]
    lines = [f"FSDP units: {len(r.units)} (parameters; this rank's shard, fp32; reshard after forward)"]
    i = 0
    while i < len(r.units):
        j = i
        while j + 1 < len(r.units) and _same_kind(r.units[i], r.units[j + 1]):
            j += 1
        u = r.units[i]
        name = ", ".join(u.modules) if i == j else f"{u.modules[0]} … {r.units[j].modules[0]} ({j - i + 1} units, each)"
        flag = "root: kept gathered" if u.reshard_after_forward is None else \
            ("yes" if u.reshard_after_forward else "no")
        lines.append(f"  {name}: {_count(u.params)} params; {_gb(u.shard_bytes)}; {flag}")
        i = j + 1
    return lines


def _placement_lines(r: DryRun) -> list[str]:
    """Placements of each parameter kind, shown under tensor parallelism (where they differ by matrix)."""
    if r.dims.get("tp", 1) == 1 or not r.placements:
        return []
    return ["placements (mesh dimension: placement; _S(d, k): FSDP's strided shard over a TP split of dim d):"] + \
        [f"  {name}: {text}" for name, text in r.placements.items()]


def _same_kind(a: Unit, b: Unit) -> bool:
    return (len(a.modules) == len(b.modules) == 1 and (a.params, a.shard_bytes, a.reshard_after_forward) ==
            (b.params, b.shard_bytes, b.reshard_after_forward) and a.modules[0].rsplit(".", 1)[0] ==
            b.modules[0].rsplit(".", 1)[0])


def _bytes_lines(r: DryRun) -> list[str]:
    head = f"per rank, on the {r.where}"
    if r.planned is None:
        return [f"{head} (hpcx plan cannot count a user model's parameters: nothing to compare)"] + \
            [f"  {what:<12}{_gb(r.measured[what]):>12}" for what in STATES]
    lines = [head, f"  {'':<12}{'dryrun':>12}{'plan':>12}{'diff':>9}"]
    for what in STATES:
        got, want = r.measured[what], r.planned[what]
        off = (got - want) / want if want else 0.0
        lines.append(f"  {what:<12}{_gb(got):>12}{_gb(want):>12}{off:>+9.2%}")
    if r.short_shards:
        lines.append("  (this rank holds shorter shards than the first ranks; the plan gives the fullest rank)")
    lines.append(f"  plan's start-up peak (init) {_gb(r.plan_init or 0)}; checkpoint staging on the host "
                 f"{_gb(r.plan_staging or 0)} per rank")
    return lines
