"""Spec + site -> Launch: every number the job runs with, checked. Pure.

The Launch is written to ``resolved.json`` in the run folder; each rank of
the trainer reads it back, so login node and job agree on one set of numbers.
"""

from __future__ import annotations

import dataclasses
import typing as tp
from dataclasses import asdict, dataclass, field

from hpc import schedulers
from hpc.core.config import ConfigError
from hpc.core.container import identity
from hpc.core.dims import ParallelDims, hsdp_shard_size, parallel_dims
from hpc.core.dims import tasks_per_node as strategy_tasks_per_node
from hpc.core.manifest import source_kind
from hpc.core.site import SiteProfile
from hpc.core.spec import JobSpec, Parallel, compute_precision
from hpc.core.tensor_parallel import batch_problems, check_tp
from hpc.core.validate import check_world

RESOLVED_VERSION = 2  # 2: the parallel layout is one ParallelDims (`launch.dims`)


@dataclass
class Launch:
    """The resolved shape of one run."""

    nodes: int
    tasks_per_node: int
    cpus_per_task: int
    gpus_per_node: int
    backend: str
    dims: ParallelDims
    grad_accum: int
    signal_lead_s: int
    partition: str | None
    account: str | None
    qos: str | None
    plan_reasons: list[str] = field(default_factory=list)
    # FSDP keeps its shards on the host: the spec's cpu_offload for an explicit strategy, the plan's
    # choice under auto (where cpu_offload = true allows it); None in resolved.json files from before
    cpu_offload: bool | None = None
    # the spec's [parallel] with its `auto` values decided (``launch_parallel``): what the trainer runs
    # with, never decided again; None in resolved.json files from before (``decided_parallel`` fills it)
    parallel: Parallel | None = None
    # what `data.source` names (``hpc.core.manifest.source_kind``: synthetic, prepared or tokens), decided at
    # resolve: the ranks read it, not the path; None in resolved.json files from before (``decided_data_source``)
    data_source: str | None = None
    # the bus bandwidth (GB/s) NCCL's tuning model gives the pre-flight check's all-reduce at this launch
    # (``hpc.plan.resolve.preflight_busbw``), decided at resolve so that the trainer needs no planner; None
    # without GPUs, for a script, with the check off, and in resolved.json files from before (only logged)
    preflight_busbw_gbs: float | None = None

    def __post_init__(self) -> None:
        if self.dims.world_size != self.world_size:
            raise ValueError(f"{self.dims.describe()} covers {self.dims.world_size} ranks, but the launch has "
                             f"nodes={self.nodes} × tasks_per_node={self.tasks_per_node} = {self.world_size}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node

    @property
    def strategy(self) -> str:
        return self.dims.strategy

    def to_dict(self) -> dict[str, tp.Any]:
        """What resolved.json holds; ``world_size`` and ``strategy`` are repeated there for readers."""
        return {**asdict(self), "world_size": self.world_size, "strategy": self.strategy}

    @classmethod
    def from_dict(cls, doc: dict[str, tp.Any]) -> "Launch":
        """Read a resolved.json launch (version 2, or version 1's flat strategy/sharding/shard fields)."""
        doc = dict(doc)
        if "dims" in doc:
            dims = ParallelDims.from_dict(doc.pop("dims"))
        else:  # version 1
            dims = parallel_dims(doc["strategy"], doc["sharding"], doc["world_size"], doc["tasks_per_node"],
                                 doc["shard"] if doc["strategy"] == "hsdp" else 0)
        parallel = doc.pop("parallel", None)
        parallel = Parallel(**parallel) if parallel else None
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(dims=dims, parallel=parallel, **{k: v for k, v in doc.items() if k in names and k != "dims"})


def tasks_per_node(spec: JobSpec, site: SiteProfile) -> int:
    """The spec's tasks per node, else one for none/dp, else the site's default (``hpc.core.dims``)."""
    return strategy_tasks_per_node(spec.parallel.strategy, spec.job.tasks_per_node, site.default_tasks_per_node())


def gpus_per_node(spec: JobSpec, site: SiteProfile) -> int:
    """GPUs the job takes on each node: one per task, except dp, whose one process drives them all."""
    if not site.node.gpus:
        return 0
    return site.node.gpus if spec.parallel.strategy == "dp" else tasks_per_node(spec, site)


def cross_check(spec: JobSpec, site: SiteProfile) -> list[str]:
    """Arithmetic checks between spec and site; each message states the numbers it used."""
    errors = []
    tpn = tasks_per_node(spec, site)
    world = spec.job.nodes * tpn
    errors += check_world(spec.job.nodes, tpn)
    if site.node.gpus and tpn > site.node.gpus:
        errors.append(f"`job.tasks_per_node` = {tpn} but site {site.name!r} has {site.node.gpus} GPUs per node "
                      "(one task per GPU)")
    if not site.multi_node and spec.job.nodes > 1:
        errors.append(f"`job.nodes` = {spec.job.nodes} but site {site.name!r} runs on this machine only: "
                      "expected 1 (or a Slurm site)")
    if site.scheduler.max_nodes and spec.job.nodes > site.scheduler.max_nodes:
        errors.append(f"`job.nodes` = {spec.job.nodes} but site {site.name!r} has at most "
                      f"{site.scheduler.max_nodes} nodes")
    if spec.workload.uses_trainer:  # a script's batches and layout are its own
        errors += check_tp(spec, site, tpn)
        errors += batch_problems(spec, site, tpn)  # data-parallel ranks: tp ranks share a batch
    if spec.job.cpus_per_task and spec.job.cpus_per_task * tpn > site.node.cpus:
        errors.append(f"`job.cpus_per_task` = {spec.job.cpus_per_task} × {tpn} tasks = "
                      f"{spec.job.cpus_per_task * tpn} CPUs but site {site.name!r} nodes have {site.node.cpus}")
    elif not spec.job.cpus_per_task and tpn > site.node.cpus and site.allocates_cpus:
        errors.append(f"{tpn} tasks per node need at least {tpn} CPUs, but site {site.name!r} nodes have "
                      f"{site.node.cpus} (`node.cpus`): expected at most {site.node.cpus} tasks per node")
    errors += _check_strategy(spec, site, world, tpn) if spec.workload.uses_trainer else []
    lead = spec.job.signal_lead_s or site.scheduler.signal_lead_s
    if lead >= spec.job.time_limit_min * 60:
        errors.append(f"signal lead {lead} s is not shorter than `job.time_limit_min` = "
                      f"{spec.job.time_limit_min} min = {spec.job.time_limit_min * 60} s")
    return errors


def _check_strategy(spec: JobSpec, site: SiteProfile, world: int, tpn: int) -> list[str]:
    """Every problem of ``[parallel]`` against the launch; none of them hides another. (fp16 on gloo is not
    one: FSDP2 and HSDP gather in fp16 and reduce in fp32 over gloo, as tests/trainer/test_equivalence.py
    runs it; the refusal under hsdp alone was dropped in issue 24.)"""
    p, errors = spec.parallel, []
    if p.strategy == "none" and world > 1:
        errors.append(f"`parallel.strategy` = 'none' runs one process, but nodes × tasks_per_node = "
                      f"{spec.job.nodes} × {tpn} = {world}: set job.tasks_per_node = 1 and job.nodes = 1, or use ddp/fsdp")
    if p.strategy == "dp":
        errors += _check_dp(spec, site, tpn)
    if p.strategy == "hsdp":
        tp_ = p.tp if not tpn % p.tp else 1
        errors += _check_hsdp(spec, world // tp_, tpn // tp_)
    if p.shard_size and p.strategy not in ("hsdp", "auto"):
        errors.append(f"`parallel.shard_size` = {p.shard_size} applies to hsdp only, but strategy = {p.strategy!r}")
    if p.cpu_offload and p.strategy not in ("fsdp", "hsdp", "auto"):
        errors.append(f"`parallel.cpu_offload` needs strategy fsdp or hsdp, not {p.strategy!r}")
    if not p.reshard_after_forward and (p.strategy not in ("fsdp", "hsdp", "auto") or p.sharding == "no_shard"):
        what = f"strategy {p.strategy!r}" if p.strategy not in ("fsdp", "hsdp", "auto") else "sharding 'no_shard'"
        errors.append(f"`parallel.reshard_after_forward` = false keeps sharded parameters gathered, but {what} "
                      "shards none: expected strategy fsdp or hsdp with full_shard or shard_grad_op (or leave it true)")
    return errors


def _check_hsdp(spec: JobSpec, world: int, tpn: int) -> list[str]:
    p, errors = spec.parallel, []
    shard = hsdp_shard_size(tpn, p.shard_size)
    if world % shard:
        errors.append(f"`parallel.shard_size` = {shard} does not divide the {world} ranks "
                      f"({spec.job.nodes} nodes × {tpn} tasks)")
    if p.sharding == "no_shard":
        errors.append("`parallel.sharding` = 'no_shard' with strategy 'hsdp' would shard nothing: expected "
                      "full_shard or shard_grad_op (or strategy fsdp/ddp to replicate)")
    return errors


def _check_dp(spec: JobSpec, site: SiteProfile, tpn: int) -> list[str]:
    """dp is one process per node driving all of that node's GPUs (nn.DataParallel splits each micro
    batch over them); several tasks per node would each wrap DataParallel over every GPU and collide."""
    errors = []
    if spec.job.nodes > 1:
        errors.append(f"`parallel.strategy` = 'dp' (nn.DataParallel) is single-process and cannot span "
                      f"{spec.job.nodes} nodes: use ddp")
    if tpn > 1:
        gpus = f"all {site.node.gpus} GPUs" if site.node.gpus else "the node"
        errors.append(f"`parallel.strategy` = 'dp' (nn.DataParallel) runs one process driving {gpus}, but "
                      f"`job.tasks_per_node` = {tpn}: set it to 1 (or leave it 0), or use ddp (one process per GPU)")
    if site.node.gpus > 1 and spec.parallel.compile:
        errors.append(f"`parallel.compile` = true with strategy 'dp' on {site.node.gpus} GPUs: torch.compile binds "
                      "to the original module, so DataParallel's replicas would run cuda:0's weights on the other "
                      "GPUs' inputs; use strategy 'ddp' (or compile = false)")
    if site.node.gpus > 1 and spec.train.micro_batch % site.node.gpus:
        errors.append(f"`parallel.strategy` = 'dp' splits each micro batch over the node's {site.node.gpus} GPUs, "
                      f"but `train.micro_batch` = {spec.train.micro_batch} is not divisible by {site.node.gpus}")
    return errors


def launch_for(spec: JobSpec, site: SiteProfile, dims: ParallelDims, cpu_offload: bool | None,
               reasons: list[str]) -> Launch:
    """The launch of a checked spec (``cross_check`` found nothing) with the layout the planner chose
    (``hpc.plan.resolve``); its ``parallel`` is decided here, once (``launch_parallel``)."""
    tpn = tasks_per_node(spec, site)
    launch = Launch(
        nodes=spec.job.nodes,
        tasks_per_node=tpn,
        cpus_per_task=spec.job.cpus_per_task or max(1, site.node.cpus // tpn),
        gpus_per_node=gpus_per_node(spec, site),
        backend=site.backend,
        dims=dims,
        # tp ranks share samples; a script's is unused (its batches are its own)
        grad_accum=max(1, spec.train.global_batch // (dims.dp_world * spec.train.micro_batch)),
        signal_lead_s=spec.job.signal_lead_s or site.scheduler.signal_lead_s,
        **schedulers.get(site.scheduler.kind).placement(spec, site),
        plan_reasons=reasons,
        cpu_offload=cpu_offload,
        data_source=source_kind(spec.data.source),
    )
    return dataclasses.replace(launch, parallel=launch_parallel(spec, launch))


SCRIPT_REASON = "`job.command`: your script runs on every rank and decides its own parallelism"


def script_launch(spec: JobSpec, site: SiteProfile) -> Launch:
    """The launch of a script-mode spec (``job.command``): its ranks, one per GPU (or the site's CPU
    tasks), recorded as a ddp-shaped layout of that many ranks; no planner, no batch arithmetic."""
    tpn = tasks_per_node(spec, site)
    dims = parallel_dims("ddp", "full_shard", spec.job.nodes * tpn, tpn)
    return launch_for(spec, site, dims, None, [SCRIPT_REASON])


def refit(spec: JobSpec, site: SiteProfile, launch: Launch, world_size: int, local_world: int) -> Launch:
    """``launch`` for a run folder started at another world size (``torchrun --nproc_per_node=4`` on a
    folder resolved for 2): ``cross_check`` at that size, then its layout and grad_accum. Raises
    ConfigError stating the numbers when they do not fit."""
    if world_size % local_world:
        raise ConfigError(f"{world_size} ranks do not divide into nodes of {local_world}")
    nodes = world_size // local_world
    resized = dataclasses.replace(spec, job=dataclasses.replace(spec.job, nodes=nodes, tasks_per_node=local_world))
    errors = cross_check(resized, site)
    if errors:
        raise ConfigError([f"{spec.source}: started with {world_size} ranks: {e}" for e in errors])
    dims = parallel_dims(launch.dims.strategy, launch.dims.sharding, world_size, local_world, spec.parallel.shard_size,
                         launch.dims.tp)
    return dataclasses.replace(launch, nodes=nodes, tasks_per_node=local_world, dims=dims,
                               grad_accum=spec.train.global_batch // (dims.dp_world * spec.train.micro_batch))


def resolved_document(spec: JobSpec, site: SiteProfile, launch: Launch, run_dir: str) -> dict[str, tp.Any]:
    """The content of resolved.json: everything a rank needs, and no secret values."""
    return {
        "version": RESOLVED_VERSION,
        "run_dir": run_dir,
        "spec": spec.to_dict(),
        "site": asdict(site),
        "launch": launch.to_dict(),
        **({"container": identity(site.container)} if site.container.enabled else {}),
    }


def launch_parallel(spec: JobSpec, launch: Launch) -> Parallel:
    """The spec's ``[parallel]`` with its `auto` values decided as the planner did (``decide_parallel``):
    ``cpu_offload`` by the resolved launch, ``mixed_precision`` by the site (bf16 where it has GPUs, i.e.
    runs NCCL). ``launch_for`` records it in ``launch.parallel``; ``decided_parallel`` reads it back."""
    if launch.parallel is not None:
        return launch.parallel
    return decide_parallel(spec.parallel, launch.backend == "nccl", launch.cpu_offload)


def decide_parallel(parallel: Parallel, gpus: bool, cpu_offload: bool | None = None) -> Parallel:
    """``parallel`` with its `auto` values decided: ``cpu_offload`` by the plan where it chose (None: the
    spec's), ``mixed_precision`` by ``compute_precision`` for a site with or without GPUs. The one
    decision; ``launch_parallel`` asks it for a launch, tests and benches without one ask it directly."""
    offload = parallel.cpu_offload if cpu_offload is None else cpu_offload
    precision = compute_precision(parallel.mixed_precision, gpus)
    return dataclasses.replace(parallel, cpu_offload=offload, mixed_precision=precision)


def undecided(parallel: Parallel) -> list[str]:
    """The `auto` values ``decide_parallel`` would still decide in ``parallel`` (``cpu_offload`` is a
    bool: a spec's value is indistinguishable from the plan's, so only precision can be told)."""
    return ["mixed_precision"] if parallel.mixed_precision == "auto" else []


def decided_data_source(spec: JobSpec, launch: Launch) -> Launch:
    """``launch`` with its ``data_source`` recorded (a resolved.json from before it was: decided now, by
    the same rule, on the path the login node checked)."""
    if launch.data_source is not None:
        return launch
    return dataclasses.replace(launch, data_source=source_kind(spec.data.source))


def decided(spec: JobSpec, launch: Launch) -> Launch:
    """``launch`` with everything decided at resolve recorded (``decided_parallel``, ``decided_data_source``):
    what the trainer reads its run folder into."""
    return decided_data_source(spec, decided_parallel(spec, launch))


def decided_parallel(spec: JobSpec, launch: Launch) -> Launch:
    """``launch`` with its ``parallel`` recorded (a resolved.json from before it was: decided now, the
    same way); what the trainer reads its run folder into."""
    if launch.parallel is not None:
        return launch
    return dataclasses.replace(launch, parallel=launch_parallel(spec, launch))
