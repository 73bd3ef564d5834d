"""LoRA in the trainer: adapters beside the frozen weights of the targets (``hpc.core.lora``).

``apply_lora`` runs on the bare model (on the meta device, before ``WeightInit`` records the
names and before ``parallelize``): each target linear layer gets two children, ``lora_A`` (rank ×
in; ``nn.Linear``'s own init, kaiming-uniform with ``a = sqrt(5)``, as PEFT's) and ``lora_B`` (out ×
rank; zeros), a ``lora_dropout``, and a forward hook adding ``scaling · B A dropout(x)`` to the
layer's output. The base weight keeps its name (``blocks.0.attn.wq.weight``), so ``init_from``, the
Hugging Face names and the export are unchanged; the adapters are ``….wq.lora_A.weight``, which map
to PEFT's ``….q_proj.lora_A.weight``. Then every parameter but the adapters and ``lora.trainable``
is frozen (``requires_grad = False``): the optimizer and gradient clipping take the trainable ones
only (``trainer.optim``), FSDP2 shards frozen and trainable parameters of a unit together and
reduce-scatters only the gradients there are, and checkpoints leave the frozen base out
(``state_options``), recording where it came from (``base_record``) instead.

The frozen base then takes ``lora.base_dtype`` (``keep_base``, still on the meta device, so ``to_empty``
allocates it at that size): bf16 tensors, and under `nf4` torchao's ``NF4Tensor`` for the blocks'
projections (``hpc.core.lora.is_nf4``), which ``nn.Linear`` runs through torchao's ``F.linear`` (the
weight dequantized to the input's dtype for the matmul, never stored dequantized). ``WeightInit``
initialises an NF4 weight whole in its dtype and quantizes it (``trainer.model.init_module``);
``init_from`` copies each tensor in, quantized as it lands (``copy_into``).
"""

from __future__ import annotations

import hashlib
import typing as tp
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions

from hpc.ckpt.digests import file_digest
from hpc.compat import is_nf4_tensor, to_nf4
from hpc.core.errors import CheckpointError, ConfigError
from hpc.core.lora import Lora, base_dtype_problems, is_adapter, is_nf4, rest_dtype, resolved_targets, trains_in_full

if tp.TYPE_CHECKING:  # pragma: no cover
    from hpc.ckpt.init_source import InitSource
    from hpc.core.spec import JobSpec


class LoraA(nn.Linear):
    """The down projection A (rank × in): ``nn.Linear``'s init (kaiming-uniform, a = sqrt(5)), as PEFT's."""

    def __init__(self, d_in: int, rank: int):
        super().__init__(d_in, rank, bias=False)


class LoraB(nn.Linear):
    """The up projection B (out × rank), zeros: the adapted layer starts as the base layer."""

    def __init__(self, rank: int, d_out: int):
        super().__init__(rank, d_out, bias=False)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)


def _adapter_hook(module: tp.Any, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor:
    """``out`` + scaling · B A dropout(x) (the hook of each target)."""
    return out + module.lora_B(module.lora_A(module.lora_dropout(args[0]))) * module.lora_scaling


def add_adapters(linear: nn.Linear, lora: Lora) -> None:
    """Give ``linear`` its adapters, dropout and hook (under the caller's ``torch.device``)."""
    linear.lora_A = LoraA(linear.in_features, lora.rank)
    linear.lora_B = LoraB(lora.rank, linear.out_features)
    linear.lora_dropout = nn.Dropout(lora.dropout) if lora.dropout else nn.Identity()
    object.__setattr__(linear, "lora_scaling", lora.scaling)  # a plain float, not a module or tensor
    linear.register_forward_hook(_adapter_hook)


def apply_lora(model: nn.Module, spec: JobSpec, mixed_precision: str = "none", strategy: str = "none") -> nn.Module:
    """Adapters on every target of ``spec.lora``, on the device the model is on; every other parameter
    frozen but ``lora.trainable``, and kept at ``lora.base_dtype`` for a run computing in
    ``mixed_precision`` with ``strategy`` (both decided; ``keep_base``). The model as it was when LoRA is off."""
    lora = spec.lora
    if not lora.enabled:
        return model
    targets = set(resolved_targets(lora, spec.model.arch))
    chosen = [m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in targets and isinstance(m, nn.Linear)]
    if not chosen:
        raise ConfigError([f"`lora.targets`: no linear layer of the model is named {sorted(targets)}"])
    device = next(model.parameters()).device
    with torch.device(device):
        for linear in chosen:
            add_adapters(linear, lora)
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name) or trains_in_full(name, lora))
    keep_base(model, spec, mixed_precision, strategy)
    return model


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def keep_base(model: nn.Module, spec: JobSpec, mixed_precision: str, strategy: str) -> None:
    """Every frozen parameter at ``lora.base_dtype`` (a tied one converted once, and tied again): NF4
    for ``is_nf4`` names, else ``rest_dtype``. Refused in one line where the strategy or compute
    dtype cannot run that base (``base_dtype_problems``)."""
    lora = spec.lora
    problems = base_dtype_problems(lora, strategy, mixed_precision)
    if problems:
        raise ConfigError(problems)
    dtype, done = DTYPES[rest_dtype(lora, mixed_precision)], {}
    for name, module in list(model.named_modules()):
        for key, p in list(module.named_parameters(recurse=False)):
            if p.requires_grad:
                continue
            full = f"{name}.{key}" if name else key
            if id(p) not in done:
                done[id(p)] = _stored(p, dtype, is_nf4(full, lora, spec.model.arch))
            if done[id(p)] is not p:
                setattr(module, key, done[id(p)])


def _stored(p: torch.Tensor, dtype: torch.dtype, nf4: bool) -> nn.Parameter:
    """``p`` frozen in ``dtype``, or in NF4 quantized from ``dtype``; ``p`` itself when nothing changes."""
    if nf4:
        return nn.Parameter(to_nf4(p.detach().to(dtype)), requires_grad=False)
    if p.dtype == dtype:
        return p  # type: ignore[return-value]
    return nn.Parameter(p.detach().to(dtype), requires_grad=False)


def copy_into(local: torch.Tensor, value: torch.Tensor) -> None:
    """``local.copy_(value)``; into an NF4 weight, ``value`` cast to its dtype first and quantized (torchao's
    ``copy_``), as the export's merge dequantizes it again (``hpc.ckpt.peft``)."""
    with torch.no_grad():
        local.copy_(value.to(local.dtype) if is_nf4_tensor(local) else value)


def has_frozen(model: nn.Module) -> bool:
    """Whether some parameter is frozen (a LoRA run): checkpoints then hold the trainable part only."""
    return any(not p.requires_grad for p in model.parameters())


def state_options(model: nn.Module) -> tp.Any:
    """``StateDictOptions`` of a checkpoint of ``model``: a frozen base is left out, and loading one
    that lacks it is not an error (``init_from`` supplies it)."""
    frozen = has_frozen(model)
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


# ---------------------------------------------------------------- the base, named by its source and hash

_BASES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {"source", "sha256"} of its base


def _bare(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)  # DDP and DataParallel wrap the model


def set_base_record(model: nn.Module, record: dict[str, str]) -> None:
    """Remember where ``model``'s frozen base came from (``checkpoint.init_from`` and its digest)."""
    _BASES[_bare(model)] = dict(record)


def base_record(model: nn.Module) -> dict[str, str] | None:
    """What ``set_base_record`` remembered, for the checkpoint's ``meta``; None for a model without one."""
    return _BASES.get(_bare(model))


def source_files(source: InitSource) -> list[Path]:
    """The files a base is read from: its tensors' files (safetensors), else the file or step folder's."""
    files = {t.file for t in source.tensors.values() if t.file is not None}
    if not files:
        root = source.step or source.path
        files = {p for p in root.rglob("*") if p.is_file()} if root.is_dir() else {root}
    config = source.path / "config.json" if source.path.is_dir() else None
    return sorted(files | ({config} if config is not None and config.is_file() else set()))


def source_digest(source: InitSource) -> str:
    """SHA-256 over the base's files (name and content digest of each, ``hpc.ckpt.digests.file_digest``)."""
    h = hashlib.sha256()
    for f in source_files(source):
        h.update(f"{f.name}\0{file_digest(f)}\n".encode())
    return h.hexdigest()


def agreed_digest(source: InitSource) -> str:
    """``source_digest`` computed by rank 0 and broadcast (every rank reads the same files)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return source_digest(source)
    box = [source_digest(source) if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def check_base(saved: dict[str, tp.Any] | None, record: dict[str, str], checkpoint: Path) -> None:
    """At resume: the base read now must be the one the checkpoint's adapters were trained on."""
    if saved is None:
        return
    if saved.get("sha256") != record["sha256"]:
        raise CheckpointError([f"{checkpoint}: its adapters were trained on the base {saved.get('source')} "
                               f"(sha256 {str(saved.get('sha256'))[:12]}…), but `checkpoint.init_from` = "
                               f"{record['source']} now has sha256 {record['sha256'][:12]}…: the base changed"])
