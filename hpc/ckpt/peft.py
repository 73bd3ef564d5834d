"""LoRA runs out and in, in the forms people load: PEFT adapter folders and merged Hugging Face models.

- ``export_peft`` (``hpcx ckpt convert RUN OUT --to peft``): ``adapter_config.json`` and
  ``adapter_model.safetensors`` with PEFT's names (``base_model.model.<Hugging Face module>.lora_A.weight``),
  which ``peft.PeftModel.from_pretrained(base, OUT)`` loads onto the Hugging Face model of the run's
  base (``base_model_name_or_path``: the run's ``checkpoint.init_from``).
- ``merged_reader`` (``--to hf --merge-lora``): the run's checkpoint seen as a full model's, each
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

import json
import math
import typing as tp
from pathlib import Path

import torch

from hpc.core.errors import CheckpointError, ConfigError
from hpc.core.hf import HfTensor, tensor_plan
from hpc.core.peft_config import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, FLOAT_DTYPES, adapter_base,  # noqa: F401
                                  adapter_problems, fan_in_fan_out, full_modules, is_adapter_folder, listed,
                                  module_problems, read_adapter_config)  # the torch-free half, re-exported

PREFIX = "base_model.model."  # PEFT's prefix of a CausalLM's module names


def peft_names(arch: str, shape: tp.Any, adapters: tp.Iterable[str]) -> dict[str, str]:
    """hpcx adapter name (``blocks.0.attn.wq.lora_A.weight``) → PEFT's key, through the family's names
    of the base weight (``model.layers.0.self_attn.q_proj.weight``)."""
    from hpc.core.lora import base_name

    hf = {t.source: t.name for t in tensor_plan(arch, shape) if t.source}
    out = {}
    for name in adapters:
        base = hf[base_name(name)]
        out[name] = f"{PREFIX}{base.removesuffix('.weight')}.{name.split('.')[-2]}.weight"
    return out


def adapter_config(spec: tp.Any, arch: str, shape: tp.Any) -> dict[str, tp.Any]:
    """PEFT's ``adapter_config.json`` of the run's ``[lora]`` (fields PEFT 0.x reads; the rest default)."""
    from hpc.core.hf import hf_config
    from hpc.core.lora import hf_targets

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
    from hpc.core.spec import spec_from_dict

    spec = spec_from_dict(resolved["spec"], str(run / "resolved.json"), read_hf_config=False)
    if not spec.lora.enabled:
        raise ConfigError([f"{run}: not a LoRA run (`lora.rank` = 0): export it with --to hf"])
    return spec


def _adapter_plan(reader: tp.Any, spec: tp.Any, arch: str, shape: tp.Any) -> list[HfTensor]:
    from hpc.core.lora import adapter_shapes

    shapes = adapter_shapes(spec.model, spec.lora)
    names = peft_names(arch, shape, shapes)
    saved = module_plan(spec.lora, arch, shape)
    missing = [f"{reader.path}: no tensor model.{n}" for n in [*shapes, *(t.source for t in saved)]
               if f"model.{n}" not in reader.entries]
    if missing:
        raise CheckpointError(missing)
    return [HfTensor(names[n], n, "copy", s) for n, s in shapes.items()] + saved


def export_peft(src: str | Path, dst: str | Path) -> dict[str, tp.Any]:
    """``hpcx ckpt convert SRC DST --to peft``: the run's adapters as a PEFT folder at ``dst`` (fp32)."""
    from hpc.ckpt.dcp import DcpReader
    from hpc.ckpt.entries import Scratch
    from hpc.ckpt.hf import write_shard, write_text, run_model, run_of
    from hpc.ckpt.outputs import check_destination, parents_made, staged

    src, dst = Path(src), Path(dst)
    check_destination(dst, make_parents=True)
    run, step = run_of(src)
    arch, shape, resolved = run_model(run)
    spec = run_lora(resolved, run)
    problems = module_problems(spec.lora, arch, shape)
    if problems:
        raise ConfigError([f"{run}: {p}; export the merged model with --to hf --merge-lora" for p in problems])
    reader = DcpReader(step)
    try:
        plan = _adapter_plan(reader, spec, arch, shape)
        with parents_made(dst), staged(dst, folder=True) as tmp:
            write_text(tmp / ADAPTER_CONFIG, json.dumps(adapter_config(spec, arch, shape), indent=2) + "\n")
            write_shard(tmp / ADAPTER_WEIGHTS, reader, plan, torch.float32, lambda n: None, (Scratch(), Scratch()))
    finally:
        reader.close()
    nbytes = sum(math.prod(t.shape) for t in plan) * 4
    return {"src": str(step), "dst": str(dst), "arch": "peft LoRA", "tensors": len(plan), "files": 1,
            "bytes": nbytes, "dtype": "fp32"}


# ---------------------------------------------------------------- merged


class MergedReader:
    """A LoRA run's step folder read as the full model's (``hpc.ckpt.entries.Reader``): ``model.<name>``
    of every base parameter, from the checkpoint where it trained (``lora.trainable``), else from the
    base, with ``scaling · B A`` added to each target weight."""

    format = "dcp"

    def __init__(self, step: Path, spec: tp.Any, arch: str, shape: tp.Any, mixed_precision: str = "none"):
        from hpc.ckpt.dcp import DcpReader
        from hpc.ckpt.entries import tensor_entry
        from hpc.ckpt.init_source import open_source

        if not spec.checkpoint.init_from:
            raise ConfigError([f"{step}: a LoRA run without `checkpoint.init_from`: its base is its own "
                               "initialisation, which --merge-lora cannot read back"])
        self.path, self.scaling, self.lora, self.arch = step, spec.lora.scaling, spec.lora, arch
        self.mixed_precision = mixed_precision
        self.ckpt = DcpReader(step)
        self.base = open_source(spec.checkpoint.init_from, arch, shape)
        self.meta, self.paths = self.ckpt.meta, self.ckpt.paths
        self.entries = dict(self.ckpt.entries)
        for name, t in self.base.tensors.items():
            self.entries.setdefault(f"model.{name}", tensor_entry(f"model.{name}", t.dtype, t.shape))
        self._base_reader: tp.Any = None

    def read(self, key: str) -> tp.Any:
        return self.ckpt.read(key)

    def read_into(self, key: str, out: torch.Tensor) -> None:
        name = key.removeprefix("model.")
        if key in self.ckpt.entries:
            self.ckpt.read_into(key, out)
        else:
            out.copy_(self._as_trained(name, self._base_tensor(name)))
        stem = name.removesuffix(".weight")
        if f"model.{stem}.lora_A.weight" in self.ckpt.entries:
            a, b = (self.ckpt.read(f"model.{stem}.lora_{x}.weight").float() for x in "AB")
            out.add_((b @ a * self.scaling).to(out.dtype))

    def _as_trained(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """A base tensor as the run computed with it (``lora.base_dtype``): rounded to bf16, or quantized
        to NF4 and dequantized (torchao, as ``trainer.lora`` stored it), so the merged model is the one
        the adapters were trained on."""
        from hpc.core.lora import is_nf4, rest_dtype

        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[rest_dtype(self.lora, self.mixed_precision)]
        if is_nf4(name, self.lora, self.arch):
            from hpc.compat import to_nf4

            return to_nf4(value.to(dtype)).get_original_weight()
        return value.to(dtype)

    def _base_tensor(self, name: str) -> torch.Tensor:
        from hpc.ckpt import formats
        from hpc.ckpt.torch_zip import read_exact

        t = self.base.tensors[name]
        buf = torch.empty(t.shape, dtype=t.dtype)
        if t.file is not None:
            with open(t.file, "rb", buffering=0) as f:
                read_exact(f, t.offset, buf, str(t.file))
            return buf
        if self._base_reader is None:
            self._base_reader = formats.get(self.base.kind).open(self.base.step or self.base.path)
        self._base_reader.read_into(t.key, buf)
        return buf

    def close(self) -> None:
        self.ckpt.close()
        if self._base_reader is not None:
            self._base_reader.close()


def merged_reader(run: Path, step: Path, resolved: dict[str, tp.Any], arch: str, shape: tp.Any) -> MergedReader:
    """The reader ``export_hf`` takes for ``--merge-lora``: the base as the run held it (its decided
    ``mixed_precision``, recorded in ``launch.parallel``, decides ``lora.base_dtype = "auto"``)."""
    return MergedReader(step, run_lora(resolved, run), arch, shape, run_precision(resolved))


def run_precision(resolved: dict[str, tp.Any]) -> str:
    """The compute dtype a run trained in: its launch's decided one, else the spec's (`auto`: the site's
    backend decides it, as ``hpc.core.resolve.decide_parallel`` does)."""
    from hpc.core.spec import compute_precision

    launch = resolved.get("launch")
    launch = launch if isinstance(launch, dict) else {}
    parallel = launch.get("parallel")
    decided = parallel.get("mixed_precision") if isinstance(parallel, dict) else None
    if isinstance(decided, str) and decided != "auto":
        return decided
    spec = resolved.get("spec", {}).get("parallel", {})
    return compute_precision(spec.get("mixed_precision", "auto"), launch.get("backend") == "nccl")


# ---------------------------------------------------------------- a PEFT folder as init_from


def wanted_tensors(folder: Path, spec: tp.Any, arch: str, shape: tp.Any) -> list[tuple[str, str, tuple, bool]]:
    """(hpcx name, PEFT key, hpcx shape, stored transposed) of every tensor the folder must hold: the
    adapters of the spec's targets, and its ``modules_to_save`` parameters when it has any."""
    from hpc.core.lora import adapter_shapes

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
    from hpc.ckpt.safetensors import ST_DTYPES, SafetensorsReader
    from hpc.core.validate import check_regular

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
    from hpc.ckpt.safetensors import SafetensorsReader

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
