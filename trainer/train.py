"""One rank, start to finish: read the run folder, join the job, build, train, leave cleanly.

``run_rank`` is what ``TrainTask`` (submitit) and ``python -m trainer`` (torchrun or a
single process) call. ``build_trainer`` + ``loop.train`` are the same thing with the
process group already up (tests run several configurations in one launch that way).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import typing as tp
from pathlib import Path

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from hpc.core.dims import ParallelDims
from hpc.core.models import family, model_facts
from hpc.core.models.tp_plan import tp_plan_of
from hpc.core.resolve import Launch, launch_parallel, refit
from hpc.core.spec import JobSpec, loader_workers
from hpc.core.workload import LMWorkload, TaskWorkload
from trainer.data import GlobalSampler, StreamSampler, build_loader, epoch_order, is_stream, order_words
from trainer.dist import (RankEnv, apply_job_env, apply_nccl_trace, check_world, detect_rank_env, device_for,
                          init_distributed, init_single, open_side_groups, shutdown, write_mesh, write_world)
from trainer.init_from import start_weights
from trainer.lora import apply_lora
from trainer.loop import Trainer, TrainState, set_determinism, train
from trainer.metrics import MetricsWriter, PhaseClock, flush_logging, setup_logging
from trainer.model import WeightInit, local_numel
from trainer.optim import build_optimizer, build_scheduler, open_host_groups
from trainer.parallelize import autocast_dtype, blocks_for, build_mesh, mesh_groups, parallelize, uses_rng
from trainer.preemption import PreemptionFlag
from trainer.preflight import check_start
from trainer.ranks import export_rank_variables
from trainer.resilience import report_unloadable, resilience_for
from trainer.run import Run, load_run
from trainer.tasks import LoopTask, task_for
from trainer.tokens import record_data
from trainer.watch import watch_for
from trainer.straggler import straggler_for
from trainer.syncbn import convert
from trainer.watchdog import paused, watchdog_for

log = logging.getLogger("hpcx.trainer")


def run_rank(run_dir: str, preemption: PreemptionFlag | None = None) -> dict[str, tp.Any] | None:
    """Train this rank of the run in ``run_dir``; the summary on rank 0, None elsewhere."""
    env = detect_rank_env()
    run = load_or_report(run_dir, env.rank)
    guard = resilience_for(run, env.rank, preemption)  # phase "load" until the job is joined
    trainer: Trainer | None = None
    try:
        setup_logging(run.logs_dir, env.rank)
        apply_job_env(run.site.nccl, run.spec.env.set)
        export_rank_variables(env)  # torchrun's RANK, LOCAL_RANK, WORLD_SIZE, … for the task's code
        set_determinism(run.spec.train.deterministic)  # before any CUDA work (cuBLAS reads its variable once)
        launch = fit_launch(run, env.world_size, env.local_world_size)
        set_cpu_threads(launch)
        log.info("rank %d/%d on %s via %s: %s, grad_accum=%d", env.rank, env.world_size, env.hostname,
                 env.launcher, launch.dims.describe(), launch.grad_accum)
        guard.phase = "join"
        device = join_job(run, env, launch)
        check_start(run, env.rank, env.hostname, device, guard)  # a failing node: PreflightFailed, requeued without it
        guard.phase = "build"
        trainer, state = build_trainer(dataclasses.replace(run, launch=launch), env.rank, device, preemption)
        trainer.resilience = guard
        guard.notes = data_notes(trainer.sampler)  # for this start's ledger line
        guard.phase = "resume"
        state = start_weights(trainer, resume(trainer, state), run.spec)
        if state.step == 0:  # no checkpoint of the run's own: a task's pretrained weights
            trainer.task.start_weights(trainer.model)
        guard.phase = "train"
        trainer.watchdog = guard.watchdog = watchdog_for(run, env.world_size, guard)
        trainer.straggler = straggler_for(run, env.world_size, guard, trainer.model, trainer.metrics)
        result = train(trainer, state)
    except BaseException as exc:
        stop_watchdog(trainer)
        log.exception("training failed on rank %d", env.rank)
        guard.failed(exc)  # rank 0: ledger line; one requeue unless cancelled or no progress
        flush_logging()
        raise
    # the teardown barrier waits on every rank: one stopped there is found by its neighbour's watchdog
    shutdown(run.spec.parallel.timeout_s, paused(trainer.watchdog))
    stop_watchdog(trainer)
    guard.stopped()  # rank 0: ledger line; after a preemption, the one requeue
    flush_logging()
    return result if env.is_rank0 else None


def stop_watchdog(trainer: Trainer | None) -> None:
    """The loop has failed, or every rank passed the teardown barrier: what follows (a failure's report, the
    stop line, a wait for the time limit) is no hang."""
    if trainer is not None and trainer.watchdog is not None:
        trainer.watchdog.stop()


def load_or_report(run_dir: str, rank: int) -> Run:
    """``load_run``; a run folder this trainer cannot read is reported (``hpc.requeue``) as a failure
    that would repeat, so that the check after srun does not requeue it."""
    try:
        return load_run(run_dir)
    except Exception as exc:
        report_unloadable(Path(run_dir), rank, exc)
        raise


def resume(trainer: Trainer, state: TrainState) -> TrainState:
    """When ``checkpoint.resume``: load the newest committed checkpoint of the run folder (all ranks)
    into the model, optimizer, scheduler, ``state`` and this rank's RNG (``trainer.resilience``);
    ``loop.train`` then repositions the sampler from ``state.sampler`` (global samples, so any world
    size continues exactly). Without a ``Resilience`` attached, ``state`` as it is. Each metrics line
    then carries this start's number (``start``: the ledger's ``restart``)."""
    if trainer.resilience is None:
        return state
    state = trainer.resilience.resume(trainer, state)
    trainer.metrics.start = trainer.resilience.restart
    return state


def set_cpu_threads(launch: Launch) -> None:
    """On CPU sites, one intra-op thread per CPU of the task (torch would take every core of the
    node in every rank); an explicit OMP_NUM_THREADS wins."""
    if launch.backend == "gloo" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, launch.cpus_per_task))


def join_job(run: Run, env: RankEnv, launch: Launch) -> torch.device:
    """Pick the device, start the process group (when needed), all-reduce a 1 (rank 0 writes world.json),
    then the gloo side groups (``dist.open_side_groups``)."""
    backend = launch.backend
    device = device_for(backend, env.local_rank, env.local_world_size)
    if backend == "nccl":
        apply_nccl_trace(run.run_dir)
    if env.world_size > 1:
        hosts = init_distributed(env, backend, run.spec.parallel.timeout_s, device)
    elif launch.dims.needs_process_group:
        hosts = init_single(backend, run.spec.parallel.timeout_s, device)
    else:
        hosts = [env.hostname]
    total = check_world(env, hosts, device)
    if env.is_rank0:
        write_world(run.run_dir, hosts, total, backend if dist_initialized(env, launch) else "none")
    if dist_initialized(env, launch):  # before the model and any step: a wrong gloo interface fails in seconds
        open_side_groups(run.spec.parallel.timeout_s, run.spec.checkpoint.async_save)
    return device


def dist_initialized(env: RankEnv, launch: Launch) -> bool:
    """Whether this rank joined a process group (several ranks, or DDP/FSDP at one rank)."""
    return env.world_size > 1 or launch.dims.needs_process_group


def fit_launch(run: Run, world_size: int, local_world: int) -> Launch:
    """The resolved launch, refitted when started at another world size (e.g. ``torchrun
    --nproc_per_node=4`` on a folder resolved for 2) by resolve's own checks (``hpc.core.resolve.refit``),
    which state the numbers when they do not fit."""
    launch = run.launch
    if world_size == launch.world_size:
        return launch
    fitted = refit(run.spec, run.site, launch, world_size, local_world)
    log.warning("run folder resolved for %d ranks, started with %d: %s, grad_accum=%d",
                launch.world_size, world_size, fitted.dims.describe(), fitted.grad_accum)
    return fitted


def build_trainer(run: Run, rank: int, device: torch.device,
                  preemption: PreemptionFlag | None = None) -> tuple[Trainer, TrainState]:
    """Model → parallelize (with the weights) → optimizer/schedule → data; the process group must be up."""
    spec, launch = run.spec, run.launch
    kind = launch.data_source  # decided once, at resolve (hpc.core.manifest.source_kind)
    assert kind is not None  # ``decided`` fills it for a resolved.json from before
    task = task_for(spec, kind)
    model, mesh = build_parallel_model(spec, launch, device, task=task)
    if mesh is not None and rank == 0:
        write_mesh(run.run_dir, mesh_groups(mesh))
    parallel = launch_parallel(spec, launch)  # decided once, at resolve (hpc.core.resolve.launch_for)
    if parallel.cpu_offload:
        open_host_groups(mesh)  # the norm of host gradients reduces on the host
    torch.manual_seed(spec.train.seed + rank)  # per-rank dropout masks
    scaler = _grad_scaler(parallel.mixed_precision, launch.dims, device)
    optimizer = build_optimizer(model, spec.train, sharded_scaler=scaler is not None and launch.dims.fsdp_enabled,
                                optim=spec.optim)
    dp_rank, dp_world = launch.dims.dp_rank(rank), launch.dims.dp_world  # a tp group shares its batches
    workers = loader_workers(spec.data.num_workers, device.type == "cuda", launch.cpus_per_task)
    sampler, loader = data_pipeline(task, spec, dp_rank, dp_world, device.type == "cuda", workers)
    if rank == 0 and isinstance(spec.workload, LMWorkload):  # a task's data is its own
        record_data(run.run_dir, spec.data, kind)
    trainer = Trainer(
        run_dir=run.run_dir, model=model, optimizer=optimizer, scheduler=build_scheduler(optimizer, spec.train, spec.optim),
        sampler=sampler, loader=loader,
        device=device, steps=spec.train.steps, grad_clip=spec.train.grad_clip, log_every=spec.train.log_every,
        tokens_per_step=spec.train.global_batch * task.tokens_per_sample, world_size=launch.world_size, dims=launch.dims,
        metrics=MetricsWriter(run.run_dir, enabled=rank == 0), task=task,
        flops_per_token=task.flops_per_token, peak_tflops=run.site.node.gpu_peak_tflops,
        amp_dtype=autocast_dtype(parallel, launch.dims),
        scaler=scaler,
        preemption=preemption, warmup_metrics_steps=spec.train.warmup_metrics_steps, gc_every=spec.train.gc_every,
        keep_gathered=launch.dims.fsdp_enabled and not parallel.reshard_after_forward,
        clock=PhaseClock(device), evaluator=task.evaluator(spec, dp_rank, dp_world), watch=watch_for(spec))
    if trainer.evaluator is not None:  # the training loader's settings (``data.num_workers``, pinned with a GPU)
        trainer.evaluator.workers, trainer.evaluator.pin_memory = workers, device.type == "cuda"
    return trainer, TrainState()


def data_pipeline(task: LoopTask, spec: JobSpec, dp_rank: int, dp_world: int, pin_memory: bool,
                  workers: int) -> tuple[GlobalSampler | StreamSampler, tp.Iterable]:
    """(sampler, loader) of the task's training set: an iterable dataset's stream (``StreamSampler``, read in
    this process), else hpcx's ``GlobalSampler`` over a map-style one (in the task's own sampler's order
    when it gives one: ``epoch_order``) through a DataLoader."""
    dataset = task.train_dataset()
    g, m = spec.train.global_batch, spec.train.micro_batch
    if is_stream(dataset):
        stream = StreamSampler(dataset, g, m, dp_rank, dp_world, task.collate)
        return stream, stream
    own = getattr(task, "own_sampler", lambda _: None)(dataset)
    order = epoch_order(own, spec.train.seed) if own is not None else None
    size = len(own if own is not None else dataset)  # type: ignore[arg-type]  # map-style: sized
    sampler = GlobalSampler(size, g, m, dp_rank, dp_world, spec.train.seed, task.shuffle(), order=order)
    return sampler, build_loader(dataset, sampler, spec.data, spec.train.seed, pin_memory, workers, collate=task.collate)


def data_notes(sampler: GlobalSampler | StreamSampler) -> dict[str, str]:
    """The ledger start line's ``data_resume`` (and one warning in the log) when a resume of this data may
    not be exact: an iterable dataset without state, a task's sampler that is not reproducible."""
    if isinstance(sampler, StreamSampler):
        words = sampler.resume_words()
    else:
        words = order_words(sampler.order) if sampler.order is not None else None
    if words is None:
        return {}
    log.warning("%s", words)
    return {"data_resume": words}


def build_parallel_model(spec: JobSpec, launch: Launch, device: torch.device, materialize: bool = True,
                         model: nn.Module | None = None, task: LoopTask | None = None) -> tuple[nn.Module, DeviceMesh | None]:
    """(model, mesh): the model built on the meta device (or ``model``, a bare one already built there:
    ``hpcx dryrun`` checks it first) and parallelized there; with ``materialize`` each rank then allocates
    and initialises its part (``WeightInit``: the same full state under every layout), else it stays on
    meta (``hpcx dryrun``). The process group must be up (a fake one will do). ``task``: what builds the
    model and names its units (default: ``spec``'s, ``trainer.tasks.task_for``); ``[lora]``'s adapters are
    added to it (``trainer.lora``), ``task.sync_batchnorm`` converts its BatchNorms (``trainer.syncbn``)."""
    task = task_for(spec, launch.data_source) if task is None else task
    parallel = launch_parallel(spec, launch)
    model = apply_lora(task.meta_model() if model is None else model, spec, parallel.mixed_precision,
                       launch.dims.strategy)
    match spec.workload:
        case TaskWorkload(sync_batchnorm=True, target=target):  # refused at submit under none and dp (hpc.core.tasks)
            model = convert(model, target, device.type)
    blocks = blocks_for(task.blocks, model, parallel, launch.dims)
    init = WeightInit.of(model, spec.train.seed) if materialize else None
    mesh = build_mesh(launch.dims, "cpu" if device.type == "meta" else device.type)
    rng = uses_rng(spec.model.dropout, blocks, not model_facts(spec.model).builtin)  # a user model: unknown
    model = parallelize(model, blocks, parallel, launch.dims, mesh, device, init, rng,
                        tp_plan_of(family(spec.model.arch)))
    if materialize:
        local, total = local_numel(model)
        log.info("model built on meta, materialized on %s: %d of %d parameters on this rank (%.1f%%)",
                 device, local, total, 100.0 * local / max(1, total))
    return model, mesh



def _grad_scaler(mixed_precision: str, dims: ParallelDims, device: torch.device) -> torch.amp.GradScaler | None:
    """fp16 needs loss scaling; sharded gradients need the sharded scaler."""
    if mixed_precision != "fp16":
        return None
    if dims.fsdp_enabled:
        return ShardedGradScaler(device.type)
    return torch.amp.GradScaler(device.type)
