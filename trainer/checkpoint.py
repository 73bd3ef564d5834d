"""Sharded checkpoints: ``RUN/checkpoints/step-NNNNNNN/`` written by torch.distributed.checkpoint.

One checkpoint holds, under these top-level keys of one DCP state dict:

- ``model``, ``optim``: from ``get_state_dict`` (FQN keys, any strategy), so a
  checkpoint loads at another world size and strategy (DCP reshards);
- ``scheduler``: the LR scheduler's ``state_dict()``;
- ``train``: the trainer's own dict (step, tokens seen, sampler position ...);
- ``rng.rank<R>``: each rank's RNG states under its own key — DCP keeps one
  copy of equal keys across ranks, so a shared key would restore rank 0's
  state everywhere;
- ``buffers.rank<R>`` (fsdp and hsdp at more than one rank): each rank's own
  copy of the model's plain buffers (BatchNorm's running statistics), see below;
- ``meta``: step, tokens seen, world size and strategy at save (for
  ``hpcx ckpt inspect``).

Buffers. A module buffer that is a plain tensor (BatchNorm's ``running_mean``, ``running_var``,
``num_batches_tracked``) is held whole by every rank, and the ranks' copies may differ: each rank
updates its running statistics from its own batches. DCP would keep one copy of each key, from
whichever rank its write balancing picks, so a checkpoint held a mix of ranks' statistics. Here
(``BufferPlanner``) the ``model`` entry of every buffer is written by the lowest rank that holds it:
rank 0 for a plain tensor, rank 0 of its replica group for a DTensor's chunk; that is "the" buffer
(what ``torch.save`` of rank 0's module gives, what an export and a load at another world size
take). Under ddp that is the whole truth: DDP broadcasts rank 0's buffers at the start of every
forward that synchronizes (``broadcast_buffers``), so a rank's own statistics last only until the
next step. Under fsdp and hsdp nothing synchronizes them, so each rank's own copy is saved too
(``buffers.rank<R>``) and restored at the same world size: a resumed run evaluates with the same
statistics on every rank as its uninterrupted twin. ``task.sync_batchnorm`` makes the ranks' copies
equal (``trainer.syncbn``).

Commit protocol: all ranks write into ``checkpoints/.step-NNNNNNN.partial``;
after DCP has written ``.metadata`` (which it does only when every rank's
shards are on disk and synced), rank 0 renames the folder to its final name.
A folder is never saved into twice: DCP would rewrite shards under the old
``.metadata`` and a torn rewrite would still look complete. ``latest_checkpoint``
trusts a folder only if its ``.metadata`` unpickles safely and every file it
references is there and long enough.

Saves go through a ``Checkpointer`` (one per run folder; the trainer's is
``trainer.resilience.Resilience.checkpointer``), which holds what a save leaves
running between calls. Async saves (``async_save=True``) run ``dcp.async_save``
on a gloo group of their own: on the default group, next to training
collectives, they deadlock. The state is copied to host memory in a background
thread while the loop runs the next forward and backward; the optimizer's next
``step`` waits for that copy (``Checkpointer.wait_staged``), then the write goes
on in the background. At most one save is in flight; the next save (and
``Checkpointer.wait``) waits.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import logging
import os
import random
import re
import shutil
import threading
import typing as tp
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch import nn
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType
from torch.distributed.tensor import DTensor
from torch.futures import Future as TorchFuture

from hpc import compat
from hpc.ckpt.dcp import DcpReader, dcp_problems, index_offsets
from hpc.ckpt.digests import write_digest
from hpc.ckpt.entries import unflatten
from hpc.ckpt.outputs import fsync_dir
from hpc.core.dims import ParallelDims, dims_from_mesh
from hpc.core.errors import CheckpointError, UserError
from trainer.dist import side_group
from trainer.lora import base_record, state_options

CHECKPOINTS = "checkpoints"
STEP_DIR = re.compile(r"^step-(\d{7})$")
FORMAT = "hpcx-dcp/1"

log = logging.getLogger("hpcx.trainer")


def step_dir(run_dir: str | Path, step: int) -> Path:
    """``RUN/checkpoints/step-NNNNNNN``."""
    return Path(run_dir) / CHECKPOINTS / f"step-{step:07d}"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


# ---------------------------------------------------------------- finding


def committed_steps(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, folder) of every ``step-NNNNNNN`` folder holding a ``.metadata``, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name))]
    return sorted((s, p) for s, p in found if (p / ".metadata").is_file())


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest committed checkpoint folder whose every referenced byte is on disk, or None."""
    for _, path in reversed(committed_steps(run_dir)):
        if not dcp_problems(path):
            return path
    return None


# ---------------------------------------------------------------- saving


def infer_dims(model: nn.Module) -> ParallelDims:
    """The layout the module shows: a DDP wrapper, or its parameters' device mesh (``hpc.core.dims``
    names the dimensions; a (world, 1) mesh is fsdp no_shard), or neither."""
    ddp = isinstance(model, nn.parallel.DistributedDataParallel)
    for p in model.parameters():
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            return dims_from_mesh(mesh.mesh_dim_names, tuple(mesh.mesh.shape), ddp=False)
    return dims_from_mesh(None, (_world(),) if ddp else (), ddp=ddp)


def cuda_in_use() -> bool:
    """Whether this process drives a GPU: CUDA initialized, not merely present (a gloo job on a GPU
    node never initializes it, and asking for a GPU's RNG state or pinned memory would open a context)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def rng_state() -> dict[str, tp.Any]:
    """This process's RNG states: torch CPU, every visible GPU's (one row each, when the process drives
    one: ``dp`` draws dropout on all of them), Python ``random``, NumPy (if installed)."""
    state: dict[str, tp.Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if cuda_in_use():
        state["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    try:
        import numpy as np  # lazy: numpy
    except ImportError:
        return state
    _, keys, pos, has_gauss, cached = tp.cast(tuple, np.random.get_state())  # the legacy tuple, not the dict
    state["numpy"] = {"keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    return state


def set_rng_state(state: dict[str, tp.Any]) -> None:
    """Restore what ``rng_state`` captured."""
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuple(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        set_cuda_rng_states(state["cuda"])
    if "numpy" in state:
        import numpy as np  # lazy: numpy

        n = state["numpy"]
        np.random.set_state(("MT19937", n["keys"].numpy().astype("uint32"), n["pos"], n["has_gauss"],
                             n["cached_gaussian"]))


def set_cuda_rng_states(saved: torch.Tensor) -> None:
    """Restore the GPUs' RNG states, one row per device (an older checkpoint's single state: the current
    device's); rows beyond the visible devices are left out, devices beyond the rows keep theirs."""
    if saved.dim() == 1:
        torch.cuda.set_rng_state(saved)
        return
    for index, row in enumerate(saved[:torch.cuda.device_count()]):
        torch.cuda.set_rng_state(row.clone(), index)


def _as_tuple(value: tp.Any) -> tp.Any:
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value


def buffer_keys(model: nn.Module, msd: dict[str, tp.Any]) -> frozenset[str]:
    """The keys of ``msd`` (``get_state_dict``'s model state) that are the model's buffers."""
    names: set[str] = set()
    for name, _ in model.named_buffers():
        names |= compat.state_dict_fqns(model, name)
    return frozenset(k for k in msd if k in names)


def own_buffers(msd: dict[str, tp.Any], keys: frozenset[str], dims: ParallelDims) -> dict[str, torch.Tensor]:
    """This rank's copy of the plain buffers, where its strategy leaves them to the rank (fsdp and hsdp at
    more than one rank; DDP broadcasts rank 0's at every forward); cloned: DCP gets the ``model`` entry too."""
    if _world() < 2 or not dims.fsdp_enabled:
        return {}
    return {k: msd[k].detach().clone() for k in sorted(keys) if not isinstance(msd[k], DTensor)}


def build_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, scheduler: tp.Any,
                step: int, train_state: dict, dims: ParallelDims | None) -> dict[str, tp.Any]:
    """The DCP state dict of one save (see the module docstring for its keys)."""
    msd, osd = get_state_dict(model, optimizer if optimizer is not None else [], options=state_options(model))
    # the Python objects are copied now: an async save stages (deep-copies) the state later
    state: dict[str, tp.Any] = {"model": msd, "train": copy.deepcopy(train_state),
                                "rng": {f"rank{_rank()}": rng_state()}}
    if optimizer is not None:
        state["optim"] = osd
    if scheduler is not None:
        state["scheduler"] = copy.deepcopy(scheduler.state_dict())
    dims = dims or infer_dims(model)
    own = own_buffers(msd, buffer_keys(model, msd), dims)
    if own:
        state["buffers"] = {f"rank{_rank()}": own}
    state["meta"] = {"format": FORMAT, "step": int(step), "tokens_seen": int(train_state.get("tokens_seen", 0)),
                     "world_size": _world(), "strategy": dims.strategy, "sharding": dims.sharding,
                     "mesh": [dims.dp_replicate, dims.dp_shard],
                     "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if base_record(model) is not None:  # a frozen base (LoRA) is not saved: named by its source and hash
        state["meta"]["base"] = base_record(model)
    return state


def _prepare(run_dir: Path, step: int) -> tuple[Path, Path]:
    """(partial, final) paths; rank 0 clears stale partial folders. Every rank refuses an existing final."""
    final = step_dir(run_dir, step)
    partial = final.parent / f".{final.name}.partial"
    if final.exists():
        raise FileExistsError(f"{final} already exists; a checkpoint is never saved into an existing folder")
    if _rank() == 0:
        final.parent.mkdir(parents=True, exist_ok=True)
        for stale in final.parent.glob(".step-*"):  # earlier crashes; no save is in flight here
            shutil.rmtree(stale, ignore_errors=True)
    _barrier()  # nobody creates the partial folder before rank 0 has cleared it
    return partial, final


def _commit(partial: Path, final: Path, keep: int, protected: frozenset[int] = frozenset()) -> Path:
    """Rank 0: publish ``partial`` as ``final`` (atomic rename), then drop all but the newest ``keep`` and
    the ``protected`` steps (the best checkpoint, ``checkpoint.keep_best``)."""
    os.rename(partial, final)
    fsync_dir(final.parent)
    for step, old in committed_steps(final.parent.parent)[:-keep]:
        if step in protected:
            continue
        trash = old.parent / f".{old.name}.trash"
        os.rename(old, trash)  # uncommit atomically first: a half-deleted folder never looks committed
        shutil.rmtree(trash, ignore_errors=True)
    return final


@dataclass
class _AsyncSave:
    """The async save in flight: DCP's futures, the folder it commits, and how rank 0's commit went."""

    future: Future  # the write (and, on rank 0, the commit in its done-callback)
    staged: Future | None  # the copy to host memory (None: staged before dcp.async_save returned)
    final: Path
    done: threading.Event = field(default_factory=threading.Event)  # set once the commit has run
    error: BaseException | None = None  # the commit's failure, raised by ``Checkpointer.wait``


class Checkpointer:
    """The saves of one run folder, and what they leave running between calls (torchtitan's
    ``CheckpointManager``): the async save in flight (at most one), the stager async saves share
    (its host buffers reused from one save to the next), the threads writing a sync save's digests,
    and the hooks that make an optimizer's ``step`` wait for staging.

    Every rank makes one with the same arguments and calls ``save`` collectively; ``wait`` before
    the process leaves (an unfinished async save stays uncommitted, never trusted), ``close`` when
    no save follows. ``process_group`` is the group async saves use (default: a gloo group of their
    own, ``trainer.dist.side_group("saves")``). Raises ValueError if ``keep`` < 2.
    """

    def __init__(self, run_dir: str | Path, *, keep: int = 2, async_save: bool = False,
                 process_group: tp.Any = None):
        if keep < 2:
            raise ValueError(f"keep={keep}: at least 2 checkpoints are kept (the newest may be in flight)")
        self.run_dir, self.keep, self.async_save = Path(run_dir), keep, async_save
        self.process_group = process_group
        self._pending: _AsyncSave | None = None
        self._stager: tp.Any = None  # created by the first async save (``_reused_stager``)
        self._digest_threads: list[threading.Thread] = []  # digests of the last sync save, being written
        self._hooks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> its step pre-hook
        self.protected: frozenset[int] = frozenset()  # steps pruning keeps beyond ``keep`` (the best one)

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None, scheduler: tp.Any,
             train_state: dict, *, dims: ParallelDims | None = None) -> Path:
        """Save ``RUN/checkpoints/step-NNNNNNN`` collectively (every rank calls this); returns its path.

        Waits for a save still in flight first. With ``async_save`` it returns at once: the state is
        copied to host memory in the background, and ``optimizer``'s next ``step`` waits for that
        copy (without an optimizer the copy is waited for here); until then do not change parameters
        in place by other means (or call ``wait_staged`` first). The folder appears when the
        background write commits (``wait`` waits for that).
        Raises FileExistsError if the step's folder already exists.
        """
        self.wait()
        partial, final = _prepare(self.run_dir, step)
        state = build_state(model, optimizer, scheduler, step, train_state, dims)
        writer = HpcxFileSystemWriter(partial, overwrite=False, digests_inline=self.async_save)
        planner = BufferPlanner({f"model.{k}" for k in buffer_keys(model, state["model"])})
        if not self.async_save:
            dcp.save(state, storage_writer=writer, planner=planner, process_group=self.process_group,
                     no_dist=not dist.is_initialized())
            if _rank() == 0:
                _commit(partial, final, self.keep, self.protected)
            _barrier()  # no rank runs ahead of the commit (a later latest_checkpoint sees it)
            self._start_digests(final, writer.written)
            return final
        self._start_async(state, writer, planner, partial, final)
        if optimizer is not None:
            self._wait_staged_before_step(optimizer)
        else:
            self.wait_staged()  # nothing tells us when the caller changes the state: stage before returning
        return final

    def _start_async(self, state: dict, writer: tp.Any, planner: tp.Any, partial: Path, final: Path) -> None:
        """Hand ``state`` to ``dcp.async_save`` (staging and writing in the background); rank 0 commits
        when the write is done. The job is ``_pending`` until ``wait``."""
        device_work_done()
        response = dcp.async_save(state, storage_writer=writer, planner=planner,
                                  process_group=self.process_group or _gloo_group(),
                                  async_stager=self._reused_stager(), no_dist=not dist.is_initialized())
        staged, future = ((None, response) if isinstance(response, Future)
                          else (response.staging_completion, response.upload_completion))
        job = _AsyncSave(future=future, staged=staged, final=final)
        keep, rank, protected = self.keep, _rank(), self.protected
        future.add_done_callback(lambda f: _commit_async(f, job, partial, keep, rank, protected))
        self._pending = job

    def wait_staged(self) -> None:
        """Block until the async save in flight has copied the state to host memory (its staging);
        from then on the model and optimizer may change. ``save`` makes the optimizer's next
        ``step`` call this, so staging overlaps the next forward and backward."""
        if self._pending is not None and self._pending.staged is not None:
            self._pending.staged.result()

    def _wait_staged_before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer.step`` wait for staging (once per optimizer; a public torch hook): nothing
        else in a training step changes parameters or optimizer state in place."""
        if optimizer not in self._hooks:
            self._hooks[optimizer] = optimizer.register_step_pre_hook(lambda *args: self.wait_staged())

    def _start_digests(self, folder: Path, names: list[str]) -> None:
        """After a sync save: this rank's shard digests, written into the committed folder by a
        background thread (off the critical path; joined by the next save and by ``wait``).
        A checkpoint is complete without them; ``hpcx ckpt verify`` reports a missing one as such."""
        def run() -> None:
            _yield_cpu_to_training()
            try:
                for name in names:
                    write_digest(folder / name)
            except OSError as exc:  # e.g. the folder was pruned meanwhile: the checkpoint is unaffected
                log.warning("checkpoint digests of %s not written: %s", folder, exc)

        thread = threading.Thread(target=run, name="hpcx-ckpt-digests", daemon=True)
        thread.start()
        self._digest_threads.append(thread)

    def _reused_stager(self) -> tp.Any:
        """The stager this checkpointer's async saves share: DCP's ``DefaultStager``, kept until ``close``.

        It stages into host buffers cached per source storage, so from the second save on staging
        is a copy into memory that is already there (a fresh allocation every save was most of the
        pause on a CPU run: page faults); a state whose layout changes gets new buffers for the new
        storages. Staging runs in a background thread (``use_async_staging``): the loop goes on
        with the next forward and backward while the state is copied, and the optimizer's next step
        waits for the copy (``wait_staged``). Safe because at most one save is in flight:
        ``save`` waits for the previous write before staging into the same buffers.
        """
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            gpu = cuda_in_use()  # pinned memory on a node whose GPUs this job leaves alone would open a context
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=gpu, use_shared_memory=False,
                                                        use_async_staging=True, use_non_blocking_copy=gpu))
        return self._stager

    def wait(self) -> Path | None:
        """Block until the async save in flight (if any) is written and committed; its path, or None.

        Call it before the process exits: an unfinished async save is left uncommitted (never trusted).
        Also waits for the digests a sync save is still writing.
        """
        while self._digest_threads:
            self._digest_threads.pop().join()
        job, self._pending = self._pending, None
        if job is None:
            return None
        job.future.result()
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.final

    def load(self, path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
             scheduler: tp.Any = None, *, restore_rng: bool = True) -> dict[str, tp.Any]:
        """``load_checkpoint``, once a save in flight has copied the state (loading changes it in place)."""
        self.wait_staged()
        return load_checkpoint(path, model, optimizer, scheduler, restore_rng=restore_rng)

    def close(self) -> None:
        """``wait``, then release the stager's host buffers and the optimizers' step hooks: no save
        follows (another ``save`` would start afresh)."""
        try:
            self.wait()
        finally:
            for handle in list(self._hooks.values()):
                handle.remove()
            self._hooks.clear()
            if self._stager is not None:
                self._stager.close()
                self._stager = None


class BufferPlanner(DefaultSavePlanner):
    """DCP's save planner, except that each item of ``buffers`` (flattened keys, ``model.<fqn>``) that
    several ranks hold is written by the lowest of them (rank 0, or rank 0 of a DTensor chunk's replica
    group) rather than by the least loaded: a buffer is one rank's, never a mix (the module docstring).
    Everything else is balanced across ranks as DCP does."""

    def __init__(self, buffers: tp.Iterable[str]):
        super().__init__()
        self.buffers = frozenset(buffers)

    def create_global_plan(self, all_plans: list[tp.Any]) -> tuple[list[tp.Any], tp.Any]:
        return super().create_global_plan(lowest_rank_buffers(all_plans, self.buffers))


def lowest_rank_buffers(plans: list[tp.Any], buffers: frozenset[str]) -> list[tp.Any]:
    """``plans`` (one per rank) with each write item of ``buffers`` left only in the first plan holding it."""
    holder: dict[tp.Any, int] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            if item.index.fqn in buffers:
                holder.setdefault(item.index, rank)
    return [dataclasses.replace(plan, items=[item for item in plan.items
                                             if item.index.fqn not in buffers or holder[item.index] == rank])
            for rank, plan in enumerate(plans)]


def device_work_done() -> None:
    """Wait for the work queued on this device's current stream (the optimizer step) before staging.

    DCP's stager copies on a CUDA stream of its own that never waits for the default stream; with a
    process group the barriers before a save synchronize, without one (strategy none or dp) nothing
    does, and the copy could read parameters the step is still writing. Nothing to wait for on CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()


class HpcxFileSystemWriter(dcp.FileSystemWriter):
    """FileSystemWriter whose shard writes skip torch.save's per-record CRC32.

    The CRC32 was 45-60% of a save's time here, and nothing checks it: ``torch.load`` ignores it
    (a flipped data byte loads silently either way), and so does hpcx's reader. Torn and short
    files are caught by the commit protocol (``.metadata`` only after every shard is fsync'ed)
    and by ``dcp_problems``' size checks; see docs/checkpoints.md. ``thread_count`` stays 1, so
    every ``torch.save`` of the write runs inside ``write_data`` (in the caller for a sync save,
    in DCP's executor thread for an async one), inside torch's public CRC32 switch.
    """

    def __init__(self, *args: tp.Any, digests_inline: bool = True, **kwargs: tp.Any):
        super().__init__(*args, **kwargs)
        self.digests_inline = digests_inline
        self.written: list[str] = []

    def write_data(self, plan: tp.Any, planner: tp.Any) -> tp.Any:
        """Write this rank's shard files; with ``digests_inline`` (async saves, which run here in
        the background) also their SHA-256 digests, before ``.metadata`` commits them."""
        if threading.current_thread() is not threading.main_thread():  # an async save's writer
            _yield_cpu_to_training()
        with compat.crc32_off():
            future = super().write_data(plan, planner)
        self.written = sorted({result.storage_data.relative_path for result in future.value()})
        if self.digests_inline:
            for name in self.written:
                write_digest(Path(self.path) / name)
        return future


def _yield_cpu_to_training() -> None:
    """Lower this background thread's CPU priority (nice 10), so that where cores are short the
    training threads run first: on a 2-core machine a compute-bound step ran 2.9x slower while a
    save was written at the same priority, 1.0x at nice 10 (``bench/checkpoint/step_impact.py``).
    Linux schedules threads one by one; the setting stays with DCP's writer thread."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):  # not Linux, or not permitted: only the priority is lost
        pass


def _commit_async(future: Future, job: _AsyncSave, partial: Path, keep: int, rank: int,
                  protected: frozenset[int] = frozenset()) -> None:
    """Done-callback of an async save: rank 0 commits as soon as the write is complete."""
    try:
        if future.exception() is None and rank == 0:
            _commit(partial, job.final, keep, protected)
    except Exception as exc:  # noqa: BLE001  (surfaced by Checkpointer.wait)
        job.error = exc
    finally:
        job.done.set()


def _gloo_group() -> tp.Any:
    """The gloo group async saves use (``trainer.dist.side_group("saves")``), or None without a group."""
    if not dist.is_initialized():
        return None
    return side_group("saves")


# ---------------------------------------------------------------- loading


class SafeFileSystemReader(dcp.FileSystemReader):
    """FileSystemReader that reads through hpcx's ``DcpReader``: ``.metadata`` through the allow-list
    unpickler, checked, and each tensor straight from its zip record into the destination tensor.

    DCP's own ``read_data`` ``torch.load``s every stored tensor into a fresh buffer and then
    copies it into the model (two copies, a page-faulted allocation and the pure-Python
    weights-only unpickler per item), and trusts the blob's shape. Here each tensor blob is
    parsed with ``TorchZip`` (an allow-list unpickler, no data read), refused unless its dtype
    and shape are its chunk's, and, when the request covers the whole stored chunk and the
    destination is contiguous with the same dtype, its bytes are ``readinto`` the destination
    directly; otherwise read into a fresh tensor, narrowed and copied as DCP does. Blobs in a
    layout ``TorchZip`` does not handle go through ``torch.load(weights_only=True)``.
    """

    def __init__(self, reader: DcpReader):
        super().__init__(reader.path)
        self.reader = reader

    def read_metadata(self, *args: tp.Any, **kwargs: tp.Any) -> tp.Any:
        metadata = self.reader.metadata
        if metadata.storage_meta is None:  # a .metadata from before torch recorded one (as torch's own reader)
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: tp.Any, planner: tp.Any) -> tp.Any:
        def place(req: tp.Any) -> tuple[str, int]:  # read each file front to back
            info = self.reader.storage[(req.storage_index.fqn, index_offsets(req.storage_index))]
            return info.relative_path, info.offset

        for req in sorted(plan.items, key=place):
            key, chunk = req.storage_index.fqn, index_offsets(req.storage_index)
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, self.reader.read(key))
                continue
            target = planner.resolve_tensor(req).detach()
            assert chunk is not None  # a tensor item has offsets
            self.reader.read_request(key, chunk, req.storage_offsets, req.lengths, target)
            planner.commit_tensor(req, target)
        fut: tp.Any = TorchFuture()
        fut.set_result(None)
        return fut


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose non-tensor items come already loaded (``weights_only=True``) by
    ``SafeFileSystemReader``."""

    def load_bytes(self, read_item: tp.Any, value: tp.Any) -> None:
        if self.flatten_state_dict:
            compat.set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], value)
        else:
            self.state_dict[read_item.dest_index.fqn] = value


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    scheduler: tp.Any = None, *, restore_rng: bool = True) -> dict[str, tp.Any]:
    """Load a checkpoint folder into ``model`` (+ optimizer, scheduler) at any world size/strategy.

    Every rank calls it; no save of ``model`` may still be staging (``Checkpointer.load`` waits for its
    own). Returns the saved train state, plus ``meta`` (what ``build_state`` recorded)
    and ``rng_restored`` (True when this rank's RNG states were in the checkpoint and restored —
    false after a change of world size, where the trainer reseeds).
    Raises CheckpointError if the folder is incomplete or holds anything but plain data.
    """
    path = Path(path)
    reader = DcpReader(path)  # validates first: a torn checkpoint is refused before any collective
    try:
        own = saved_own_buffers(reader)
        load_modules(reader, model, optimizer, own_buffers=own)
        extra = _read_prefix(reader, ("train.", "scheduler.", f"rng.rank{_rank()}."))
    finally:
        reader.close()
    if scheduler is not None:
        if "scheduler" not in extra:
            raise CheckpointError([f"{path}: holds no scheduler state, but a scheduler was given"])
        scheduler.load_state_dict(extra["scheduler"])
    rng = extra.get("rng", {}).get(f"rank{_rank()}")
    if rng is not None and restore_rng:
        set_rng_state(rng)
    return {**extra.get("train", {}), "meta": reader.meta, "rng_restored": rng is not None and restore_rng}


def saved_own_buffers(reader: DcpReader) -> dict[str, torch.Tensor]:
    """This rank's own copy of the plain buffers (``buffers.rank<R>``), when the checkpoint was saved at
    this world size and holds one; else {} (every rank takes the ``model`` entry's: rank 0's)."""
    if reader.meta.get("world_size") != _world():
        return {}
    return _read_prefix(reader, (f"buffers.rank{_rank()}.",)).get("buffers", {}).get(f"rank{_rank()}", {})


def load_modules(reader: DcpReader, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 options: tp.Any = None, skip: tp.Callable[[str], bool] | None = None,
                 own_buffers: dict[str, torch.Tensor] | None = None) -> None:
    """DCP's load of the ``model`` (and ``optim``) entries; ``options`` default to the checkpoint's
    (``trainer.lora.state_options``); ``skip`` leaves parameters out by name (``init_from`` into a LoRA model);
    ``own_buffers`` replace the loaded buffers of those names (``saved_own_buffers``)."""
    options = state_options(model) if options is None else options
    msd, osd = get_state_dict(model, optimizer if optimizer is not None else [], options=options)
    msd = {k: v for k, v in msd.items() if skip is None or not skip(k)}
    state = {"model": msd, "optim": osd} if optimizer is not None else {"model": msd}
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(reader), planner=SafeLoadPlanner(),
                 no_dist=not dist.is_initialized())
    except CheckpointException as exc:  # DCP wraps what every rank raised; a user error stays one
        errors = [e for e, _ in exc.failures.values() if isinstance(e, UserError)]
        if not errors:
            raise
        raise type(errors[0])(list(dict.fromkeys(m for e in errors for m in e.messages))) from None
    for key, value in (own_buffers or {}).items():
        loaded = msd.get(key)
        if isinstance(loaded, torch.Tensor):
            msd[key] = value.to(loaded.device)
    set_state_dict(model, optimizer if optimizer is not None else [], model_state_dict=msd,
                   optim_state_dict=osd if optimizer is not None else {}, options=options)


def _read_prefix(reader: DcpReader, prefixes: tuple[str, ...]) -> dict[str, tp.Any]:
    """The entries under ``prefixes``, read directly (no collective) and nested again."""
    flat = {k: reader.read(k) for k in reader.entries if k.startswith(prefixes)}
    return unflatten(flat, reader.paths, str(reader.path))
