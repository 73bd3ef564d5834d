"""``checkpoint.init_from``: a fresh run's model weights from a pretrained source, each rank its own shard.

Applied once, after the model is built and materialized (``WeightInit``) and after the resume
decision: only when the run starts at step 0 (no checkpoint of its own, or ``checkpoint.resume =
false``), so a requeued fine-tune resumes from its own newest step and never reads the pretrained
weights again. The optimizer and schedule stay fresh; the weights are copied in place (bf16 or fp16
files become the fp32 master weights by the copy; a tied matrix is one parameter and stays tied).

How each rank reads (``hpc.ckpt.init_source.InitSource`` says where every tensor is):

- safetensors (a Hugging Face folder or one file): a parameter sharded on dim 0 (FSDP2 / HSDP:
  ``Shard(0)`` on the shard dimension, ``Replicate`` across replicas) needs rows ``[a, b)`` of its
  tensor, which a row-major file holds as one contiguous byte range; the rank reads exactly that
  range (``read_plan``) into one reusable buffer and copies it into its local shard. Bytes read per
  rank ≈ model bytes / shard degree; memory ≈ its shard + one tensor's shard in the file's dtype.
  Whole replicas (ddp, none) read whole tensors, one at a time. Under tensor parallelism a
  row-wise matrix is also split by columns (``Shard(1)``): the rank reads columns ``[c, d)`` of each
  of its rows, one byte range per row, so bytes read per rank ≈ model bytes / (shard degree × tp).
- DCP (an hpcx run or step folder): torch's own DCP load of the ``model`` entries through hpc/ckpt's
  checked reader (``trainer.checkpoint``), which reads only the stored chunks each rank's shard overlaps.
- one ``torch.save`` file: as safetensors, this rank's rows of each tensor as one byte range of its
  record (``load_torch_file``), where the checked reader (hpc/ckpt/torch_zip.py) finds the tensor
  contiguous in an uncompressed record; otherwise (a transposed or other non-contiguous view, a
  deflated record, a legacy file) the tensor is read whole through that reader, then sliced. A
  column split (tp) reads its rows whole and keeps its columns.
"""

from __future__ import annotations

import logging
import math
import time
import typing as tp
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.tensor import DTensor

from hpc.ckpt import formats
from hpc.ckpt.dcp import DcpReader
from hpc.ckpt.entries import Scratch
from hpc.ckpt.init_source import InitSource, open_source
from hpc.ckpt.torch_zip import read_exact
from hpc.ckpt.peft import is_adapter_folder, read_adapters
from hpc.compat import local_shape_and_offset
from hpc.core.errors import ConfigError
from hpc.core.lora import is_adapter
from hpc.core.models import model_facts
from hpc.core.spec import JobSpec
from trainer.checkpoint import load_modules, step_dir
from trainer.lora import agreed_digest, base_record, check_base, copy_into, has_frozen, is_nf4_tensor, set_base_record

if tp.TYPE_CHECKING:  # pragma: no cover
    from trainer.loop import Trainer, TrainState

log = logging.getLogger("hpcx.trainer")


@dataclass(frozen=True)
class Read:
    """What a rank reads of parameter ``name``'s source tensor: rows ``[start, stop)``, all their columns
    (one byte range of ``length`` bytes at ``offset``) or columns ``cols`` of each (``stride`` bytes from
    one row's range to the next; ``length`` counts every byte read)."""

    name: str
    file: Path
    offset: int
    length: int
    start: int
    stop: int
    cols: tuple[int, int] | None = None
    stride: int = 0

    def ranges(self) -> list[tuple[int, int]]:
        """(offset, bytes) of each contiguous range, in file order."""
        if self.cols is None:
            return [(self.offset, self.length)] if self.length else []
        rows = self.stop - self.start
        each = self.length // rows if rows else 0
        return [(self.offset + i * self.stride, each) for i in range(rows)] if each else []


def clean_name(name: str) -> str:
    """A parameter's name in the bare model (activation checkpointing and DDP add segments)."""
    return name.replace("_checkpoint_wrapped_module.", "").removeprefix("module.")


def local_rows(param: torch.Tensor) -> tuple[int, int]:
    """Rows ``[start, stop)`` of dim 0 this rank holds (``local_block``)."""
    (start, stop), _ = local_block(param)
    return start, stop


def local_block(param: torch.Tensor) -> tuple[tuple[int, int], tuple[int, int] | None]:
    """(rows ``[start, stop)``, columns ``[c, d)`` or None for all) of the tensor this rank holds: all of
    it for a plain tensor; for a DTensor, its block as DTensor and FSDP2 place it (Shard on dim 0 or 1,
    strided shards of FSDP over tensor parallelism included: ``hpc.compat.local_shape_and_offset``)."""
    rows = param.shape[0] if param.ndim else 1
    if not isinstance(param, DTensor):
        return (0, rows), None
    shape, offset = local_shape_and_offset(param.shape, param.device_mesh, param.placements)
    if not param.ndim:
        return (0, 1), None
    if any(size != param.shape[d] for d, size in enumerate(shape) if d >= 2):
        raise RuntimeError(f"init_from reads rows and columns; a parameter of shape {tuple(param.shape)} is "
                           f"split on a later dimension ({tuple(shape)} locally)")
    start = min(offset[0], rows)
    span = (start, start + shape[0])
    if param.ndim < 2 or shape[1] == param.shape[1]:
        return span, None
    return span, (offset[1], offset[1] + shape[1])


def named_params(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(bare-model name, parameter) of every parameter, each once (a tied matrix under its first name);
    LoRA's adapters are not the source's (``trainer.lora``)."""
    return [(clean_name(n), p) for n, p in model.named_parameters() if not is_adapter(clean_name(n))]


def read_plan(model: nn.Module, source: InitSource) -> list[Read]:
    """The byte ranges this rank reads from a safetensors source, one per parameter (meta models too:
    the plan depends only on shapes and this rank's mesh coordinate)."""
    plan = []
    for name, param in named_params(model):
        t = source.tensors[name]
        (start, stop), cols = local_block(param)
        row = t.dtype.itemsize * (math.prod(t.shape[1:]) if len(t.shape) > 1 else 1)
        assert t.file is not None  # a safetensors source names each tensor's file
        if cols is None:
            plan.append(Read(name, t.file, t.offset + start * row, (stop - start) * row, start, stop))
            continue
        width = (cols[1] - cols[0]) * t.dtype.itemsize  # a 2-D matrix split by columns (tensor parallelism)
        plan.append(Read(name, t.file, t.offset + start * row + cols[0] * t.dtype.itemsize,
                         (stop - start) * width, start, stop, cols, row))
    return plan



def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def load_safetensors(model: nn.Module, source: InitSource) -> int:
    """Each parameter's rows from its file's byte range (a format whose headers give offsets:
    safetensors); the bytes read."""
    files: dict[Path, tp.BinaryIO] = {}
    scratch, done = Scratch(), 0
    params = dict(named_params(model))
    try:
        for r in read_plan(model, source):
            local = _local(params[r.name])
            t = source.tensors[r.name]
            width = (r.cols[1] - r.cols[0],) if r.cols is not None else tuple(t.shape[1:])
            buf = scratch.view(t.dtype, (r.stop - r.start, *width) if t.shape else ())
            pieces = buf.view(torch.uint8).reshape(-1) if buf.ndim else buf.reshape(1).view(torch.uint8)
            done_here = 0
            for offset, nbytes in r.ranges():
                f = files.get(r.file) or files.setdefault(r.file, open(r.file, "rb", buffering=0))
                read_exact(f, offset, pieces[done_here:done_here + nbytes], str(r.file))
                done_here += nbytes
            copy_into(local, buf.view(local.shape))
            done += r.length
    finally:
        for f in files.values():
            f.close()
    return done


def load_torch_file(model: nn.Module, source: InitSource) -> int:
    """Each parameter's rows from a ``torch.save`` file (checked reader); the bytes read.

    A tensor stored contiguously in an uncompressed record is read as the one byte range of this
    rank's rows (``TorchReader.read_rows``, after the reader's own bounds checks); any other (a
    non-contiguous view such as a transposed tensor, a deflated record, a legacy or fallback-loaded
    file) is read whole and sliced (``_torch_rows``)."""
    reader, scratch, done = formats.get(source.kind).open(source.path), Scratch(), 0
    try:
        for name, param in named_params(model):
            t = source.tensors[name]
            ((start, stop), cols), local = local_block(param), _local(param)
            buf = scratch.view(t.dtype, (stop - start, *t.shape[1:]) if t.shape else ())
            if reader.read_rows(t.key, start, stop, buf):
                done += buf.numel() * buf.element_size()
            else:
                buf, whole = _torch_rows(reader, t.key, start, stop)
                done += whole
            if cols is not None:  # tensor parallelism's column split: whole rows read, this rank's columns kept
                buf = buf[:, cols[0]:cols[1]]
            copy_into(local, buf.reshape(local.shape))
    finally:
        reader.close()
    return done


def _torch_rows(reader: tp.Any, key: str, start: int, stop: int) -> tuple[torch.Tensor, int]:
    """The fallback: (rows ``[start, stop)`` of tensor ``key`` read whole, the bytes read)."""
    full = reader.read(key)
    return (full[start:stop] if full.ndim else full), full.numel() * full.element_size()


def load_dcp(model: nn.Module, source: InitSource) -> int:
    """The ``model`` entries of a DCP step through torch's planner (collective; resharded as needed)."""
    assert source.step is not None  # a dcp source names its step folder
    if any(is_nf4_tensor(p) for _, p in named_params(model)):
        raise ConfigError([f"`checkpoint.init_from` = {source.path}: a DCP checkpoint into an NF4 base "
                           "(`lora.base_dtype` = 'nf4'); export it first (hpcx ckpt convert --to hf) and start "
                           "from that folder"])
    reader = formats.get(source.kind).open(source.step)
    try:
        load_modules(reader, model, None, StateDictOptions(strict=False), skip=lambda k: is_adapter(clean_name(k)))
    finally:
        reader.close()
    return sum(_local(p).numel() * source.tensors[n].dtype.itemsize for n, p in named_params(model))


# how a rank reads each format, by the table's ``init_reads`` (``hpc.ckpt.formats``)
LOADERS = {formats.BYTE_RANGES: load_safetensors, formats.RECORDS: load_torch_file, formats.DCP_PLANNER: load_dcp}


def initial_weights(model: nn.Module, spec: JobSpec) -> dict[str, tp.Any] | None:
    """Load ``spec.checkpoint.init_from`` into ``model`` (every rank); what was read, or None when unset."""
    path = spec.checkpoint.init_from
    if not path:
        return None
    tic = time.perf_counter()
    facts = model_facts(spec.model)
    source = open_source(path, facts.family, facts.shape)  # a PEFT folder's base (``hpc.ckpt.peft``)
    read = LOADERS[formats.get(source.kind).init_reads](model, source)
    if has_frozen(model):  # LoRA: checkpoints name this base instead of holding it
        set_base_record(model, {"source": str(source.step or source.path), "sha256": agreed_digest(source)})
    if is_adapter_folder(path):
        read += load_adapters(model, Path(path), spec)
    total = source.nbytes
    if is_adapter_folder(path):  # the adapters' bytes are in bytes_read, so in the total too
        total += sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
    report: dict[str, tp.Any] = {"init_from": str(source.step or source.path), "kind": source.kind,
                                 "bytes_read": read, "source_bytes": total, "seconds": time.perf_counter() - tic}
    if is_adapter_folder(path):
        report["adapters"] = str(Path(path).resolve())
    log.info(init_line(report))
    return report


def init_line(report: dict[str, tp.Any]) -> str:
    """The log line of ``initial_weights``: the folder read (a run's step folder; a PEFT folder and the
    base it adapts), and the bytes this rank read of the source's total (adapters included)."""
    base, adapters = report["init_from"], report.get("adapters")
    where = f"{adapters} (PEFT adapters) of base {base}" if adapters else base
    return (f"init_from {where} ({report['kind']}): {report['bytes_read']:,} of {report['source_bytes']:,} bytes "
            f"read on this rank in {report['seconds']:.2f} s")


def start_weights(trainer: Trainer, state: TrainState, spec: JobSpec) -> TrainState:
    """After the resume decision: at step 0, the weights of ``checkpoint.init_from``; resumed with a frozen
    base (LoRA), that base again under the trained parameters the checkpoint restored, refused if it
    changed since (``trainer.lora.check_base``). ``state`` as it is."""
    if state.step == 0 and spec.checkpoint.init_from:
        trainer.init_report = initial_weights(trainer.model, spec)
    elif spec.checkpoint.init_from and has_frozen(trainer.model):
        trainer.init_report = reload_base(trainer, state.step, spec)
    return state


def reload_base(trainer: Trainer, step: int, spec: JobSpec) -> dict[str, tp.Any] | None:
    """The frozen base read again at a resume; the trained parameters (adapters, ``lora.trainable``) kept."""
    trained = [(p, _local(p).detach().clone()) for p in trainer.model.parameters() if p.requires_grad]
    report = initial_weights(trainer.model, spec)
    with torch.no_grad():
        for p, value in trained:
            _local(p).copy_(value)
    folder = step_dir(trainer.run_dir, step)
    reader = DcpReader(folder)
    try:  # DCP flattens the meta dict: {"base.source": …, "base.sha256": …}
        saved = {k.removeprefix("base."): v for k, v in reader.meta.items() if k.startswith("base.")} or None
    finally:
        reader.close()
    record = base_record(trainer.model)
    assert record is not None  # initial_weights records it for a model with a frozen base
    check_base(saved, record, folder)
    return report


def load_adapters(model: nn.Module, folder: Path, spec: JobSpec) -> int:
    """A PEFT folder's adapters into ``model``'s (each rank its rows); the bytes copied."""
    facts = model_facts(spec.model)
    values = read_adapters(folder, spec, facts.family, facts.shape)
    done = 0
    for name, param in ((clean_name(n), p) for n, p in model.named_parameters()):
        if name in values:
            start, stop = local_rows(param)
            with torch.no_grad():
                _local(param).copy_(values[name][start:stop].to(param.dtype))
            done += values[name][start:stop].numel() * values[name].element_size()
    return done
