"""LoRA runs out and in, in the forms people load: PEFT adapter folders and merged Hugging Face models.
This module holds PEFT's names, config and the reading of a PEFT folder; the two exports, which use the
Hugging Face writer, are in their own modules above it (so ``hpc.ckpt.hf`` and ``init_source`` import it).

- ``hpc.ckpt.peft_export.export_peft`` (``hpcx ckpt convert RUN OUT --to peft``): ``adapter_config.json`` and
  ``adapter_model.safetensors`` with PEFT's names (``base_model.model.<Hugging Face module>.lora_A.weight``),
  which ``peft.PeftModel.from_pretrained(base, OUT)`` loads onto the Hugging Face model of the run's
  base (``base_model_name_or_path``: the run's ``checkpoint.init_from``).
- ``hpc.ckpt.merge.merged_reader`` (``--to hf --merge-lora``): the run's checkpoint seen as a full model's, each
  target weight ``W + (alpha / r) · B A`` read from the base (``checkpoint.init_from``) and the
  adapters, one tensor at a time; ``hpc.ckpt.hf.export_hf`` writes it as any run.
- ``adapter_base`` / ``read_adapters``: a PEFT folder as ``checkpoint.init_from`` (continue training
  it): the base it names, and its adapters and ``modules_to_save`` parameters by hpcx's names.

A run's parameters trained in full beside the adapters (``lora.trainable``) are PEFT's
``modules_to_save``: ``adapter_config.json`` lists the Hugging Face modules they make up, by full
dotted name (``model.norm``, ``model.layers.0.input_layernorm``, ``lm_head``: PEFT wraps every module
whose name ends with one of them), and ``adapter_model.safetensors`` holds each of those modules'
parameters under the key PEFT saves, ``base_model.model.<module>.<param>`` (``modules_to_save.default``
stripped), mapped from the checkpoint's ``model.<hpcx name>`` by the family's tensor plan. PEFT copies
whole modules, so a ``lora.trainable`` that trains only some of a module's parameters (GPT-2's
``ln_f.weight`` without its bias; a ``Conv1D`` weight, whose bias hpcx does not have), a LoRA target's
own weight, or a tied embedding is refused in one line. A PEFT folder as ``init_from`` gives them back
by hpcx's names when its ``modules_to_save`` cover exactly the modules of the spec's ``lora.trainable``,
and is refused in one line otherwise. The merged export (``--to hf --merge-lora``) has them too.
"""

from __future__ import annotations

import typing as tp
from pathlib import Path

import torch

from hpc.core.errors import CheckpointError, ConfigError
from hpc.ckpt.safetensors import ST_DTYPES, SafetensorsReader
from hpc.core.hf import HfTensor, hf_config, tensor_plan
from hpc.core.lora import adapter_shapes, base_name, hf_targets
from hpc.core.spec import spec_from_dict
from hpc.core.validate import check_regular
from hpc.core.peft_config import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, FLOAT_DTYPES, adapter_base,  # noqa: F401
                                  adapter_problems, fan_in_fan_out, full_modules, is_adapter_folder, listed,
                                  module_problems, read_adapter_config)  # the torch-free half, re-exported

PREFIX = "base_model.model."  # PEFT's prefix of a CausalLM's module names


def peft_names(arch: str, shape: tp.Any, adapters: tp.Iterable[str]) -> dict[str, str]:
    """hpcx adapter name (``blocks.0.attn.wq.lora_A.weight``) → PEFT's key, through the family's names
    of the base weight (``model.layers.0.self_attn.q_proj.weight``)."""
    hf = {t.source: t.name for t in tensor_plan(arch, shape) if t.source}
    out = {}
    for name in adapters:
        base = hf[base_name(name)]
        out[name] = f"{PREFIX}{base.removesuffix('.weight')}.{name.split('.')[-2]}.weight"
    return out


def adapter_config(spec: tp.Any, arch: str, shape: tp.Any) -> dict[str, tp.Any]:
    """PEFT's ``adapter_config.json`` of the run's ``[lora]`` (fields PEFT 0.x reads; the rest default)."""
    lora = spec.lora
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": spec.checkpoint.init_from or None,
            "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
            "target_modules": hf_targets(lora, arch), "bias": "none", "fan_in_fan_out": fan_in_fan_out(arch, shape),
            "modules_to_save": list(full_modules(lora, arch, shape)) or None, "inference_mode": True,
            "init_lora_weights": True, "use_rslora": False, "use_dora": False, "revision": None,
            "auto_mapping": {"base_model_class": hf_config(arch, shape)["architectures"][0],
                             "parent_library": "transformers"}}


def module_plan(lora: tp.Any, arch: str, shape: tp.Any) -> list[HfTensor]:
    """The tensors of ``full_modules`` under PEFT's keys (``base_model.model.model.norm.weight``)."""
    return [HfTensor(PREFIX + t.name, t.source, t.op, t.shape)
            for tensors in full_modules(lora, arch, shape).values() for t in tensors]


def run_lora(resolved: dict[str, tp.Any], run: Path) -> tp.Any:
    """The run's checked spec, refused unless it trained LoRA adapters."""
    spec = spec_from_dict(resolved["spec"], str(run / "resolved.json"), read_hf_config=False)
    if not spec.lora.enabled:
        raise ConfigError([f"{run}: not a LoRA run (`lora.rank` = 0): export it with --to hf"])
    return spec


# ---------------------------------------------------------------- a PEFT folder as init_from


def wanted_tensors(folder: Path, spec: tp.Any, arch: str, shape: tp.Any) -> list[tuple[str, str, tuple, bool]]:
    """(hpcx name, PEFT key, hpcx shape, stored transposed) of every tensor the folder must hold: the
    adapters of the spec's targets, and its ``modules_to_save`` parameters when it has any."""
    shapes = adapter_shapes(spec.model, spec.lora)
    names = peft_names(arch, shape, shapes)
    has_saved = bool(read_adapter_config(folder).get("modules_to_save"))  # checked to agree with the spec
    saved = module_plan(spec.lora, arch, shape) if has_saved else []
    return [(n, names[n], shapes[n], False) for n in shapes] + [
        (t.source, t.name, t.shape[::-1] if t.op == "transpose" else t.shape, t.op == "transpose") for t in saved]


def weight_problems(folder: Path, spec: tp.Any, arch: str, shape: tp.Any) -> list[str]:
    """``adapter_model.safetensors`` against the spec from its header alone (the login node's check): a
    regular file, every wanted tensor there with its shape and a floating dtype, nothing else; one line
    per kind of problem."""
    path = folder / ADAPTER_WEIGHTS
    check_regular(path, str(path), "PEFT's adapter weights (adapter_model.safetensors)", CheckpointError)
    reader = SafetensorsReader(path)
    try:
        found = {_no_adapter_name(k.removeprefix(reader.prefix)): (tuple(e.shape or ()), str(
            ST_DTYPES.get(e.dtype, e.dtype) if e.dtype is not None else "?")) for k, e in reader.entries.items()
            if e.is_tensor}
    finally:
        reader.close()
    wanted = wanted_tensors(folder, spec, arch, shape)
    missing = [key for _, key, _, _ in wanted if key not in found]
    wrong = [f"{key} is {list(found[key][0])}, the model's {ours} is {list(want[::-1] if t else want)}"
             for ours, key, want, t in wanted if key in found and found[key][0] != tuple(want[::-1] if t else want)]
    dtypes = [f"{key} ({found[key][1]})" for _, key, _, _ in wanted if key in found and found[key][1] not in FLOAT_DTYPES]
    extra = sorted(set(found) - {key for _, key, _, _ in wanted})
    return [f"{path}: {line}" for line in (
        listed("no tensor", missing), listed("shapes differ", wrong), listed("not floating point", dtypes),
        listed("tensors that match no adapter or modules_to_save parameter of the model", extra)) if line]


def read_adapters(folder: Path, spec: tp.Any, arch: str, shape: tp.Any) -> dict[str, torch.Tensor]:
    """The adapters of a PEFT folder by hpcx's parameter names, every one the spec's model has, checked;
    with them its ``modules_to_save`` parameters (``lora.trainable``), by hpcx's names too."""
    problems = adapter_problems(folder, spec) or weight_problems(folder, spec, arch, shape)
    if problems:
        raise CheckpointError([p if p.startswith("`checkpoint.init_from`") else f"`checkpoint.init_from`: {p}"
                               for p in problems])
    reader = SafetensorsReader(folder / ADAPTER_WEIGHTS)
    try:
        keys = {_no_adapter_name(k.removeprefix(reader.prefix)): k for k, e in reader.entries.items() if e.is_tensor}
        out = {}
        for ours, theirs, _, transposed in wanted_tensors(folder, spec, arch, shape):
            value = reader.read(keys[theirs])
            out[ours] = value.t().contiguous() if transposed and value.dim() == 2 else value
    finally:
        reader.close()
    return out


def _no_adapter_name(key: str) -> str:
    """PEFT saves ``….lora_A.weight`` and ``model.norm.weight``; a state dict taken in memory has
    ``….lora_A.default.weight`` and ``model.norm.modules_to_save.default.weight``."""
    return (key.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
            .replace(".modules_to_save.default.", "."))
