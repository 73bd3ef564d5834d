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

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
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


def fan_in_fan_out(arch: str, shape: tp.Any) -> bool:
    """Whether Hugging Face stores the targets transposed (GPT-2's Conv1D): PEFT's ``fan_in_fan_out``."""
    return any(t.op == "transpose" for t in tensor_plan(arch, shape))


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


def full_modules(lora: tp.Any, arch: str, shape: tp.Any) -> dict[str, list[HfTensor]]:
    """The Hugging Face modules whose parameters ``lora.trainable`` trains in full (PEFT's
    ``modules_to_save``, by full dotted name) → their tensors, in the plan's order; ConfigError, one
    line (``module_problems``), when PEFT cannot save them as they trained."""
    modules, problems = _modules_of(lora, arch, shape)
    if problems:
        raise ConfigError([f"{p}; export the merged model with --to hf --merge-lora" for p in problems])
    return modules


def module_problems(lora: tp.Any, arch: str, shape: tp.Any) -> list[str]:
    """Why the modules ``lora.trainable`` trains are not whole modules PEFT can save: one line, or none."""
    return _modules_of(lora, arch, shape)[1]


def _modules_of(lora: tp.Any, arch: str, shape: tp.Any) -> tuple[dict[str, list[HfTensor]], list[str]]:
    from hpc.core.hf import hf_config
    from hpc.core.lora import resolved_targets, trains_in_full

    if not lora.trainable:
        return {}, []
    plan = tensor_plan(arch, shape)
    by_module: dict[str, list[HfTensor]] = {}
    for t in plan:
        by_module.setdefault(t.name.rpartition(".")[0], []).append(t)
    chosen = set(resolved_targets(lora, arch))
    targets = {t.name.rpartition(".")[0] for t in plan
               if t.source.endswith(".weight") and t.source.split(".")[-2] in chosen}
    modules, why = {}, []
    for module, tensors in by_module.items():
        full = [t for t in tensors if t.source and trains_in_full(t.source, lora)]
        if not full:
            continue
        if len(full) < len(tensors):
            rest = ", ".join(t.name.rpartition(".")[2] + (" (not in hpcx's model)" if t.op == "zeros" else "")
                             for t in tensors if t not in full)
            why.append(f"{module} would have {rest} untrained")
        elif module in targets:
            why.append(f"{module} is a LoRA target")
        elif any(t.source == "tok_emb.weight" for t in tensors) and hf_config(arch, shape).get("tie_word_embeddings"):
            why.append(f"{module} is tied to the head, which PEFT's copy unties")
        else:
            modules[module] = tensors
    if why:
        more = f"; and {len(why) - 3} more modules" if len(why) > 3 else ""
        return {}, [f"`lora.trainable` = {lora.trainable}: PEFT's modules_to_save copies whole modules, and "
                    f"{'; '.join(why[:3])}{more}"]
    return modules, []


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

    def __init__(self, step: Path, spec: tp.Any, arch: str, shape: tp.Any):
        from hpc.ckpt.dcp import DcpReader
        from hpc.ckpt.entries import tensor_entry
        from hpc.ckpt.init_source import open_source

        if not spec.checkpoint.init_from:
            raise ConfigError([f"{step}: a LoRA run without `checkpoint.init_from`: its base is its own "
                               "initialisation, which --merge-lora cannot read back"])
        self.path, self.scaling = step, spec.lora.scaling
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
            out.copy_(self._base_tensor(name))
        stem = name.removesuffix(".weight")
        if f"model.{stem}.lora_A.weight" in self.ckpt.entries:
            a, b = (self.ckpt.read(f"model.{stem}.lora_{x}.weight").float() for x in "AB")
            out.add_((b @ a * self.scaling).to(out.dtype))

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
    """The reader ``export_hf`` takes for ``--merge-lora``."""
    return MergedReader(step, run_lora(resolved, run), arch, shape)


# ---------------------------------------------------------------- a PEFT folder as init_from


def is_adapter_folder(path: str | Path) -> bool:
    """Whether ``path`` is a PEFT adapter folder (``adapter_config.json``)."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def read_adapter_config(folder: Path) -> dict[str, tp.Any]:
    """``adapter_config.json`` of a PEFT folder, checked to be a LoRA one."""
    from hpc.core.config import load_json_bounded

    where = folder / ADAPTER_CONFIG
    doc = load_json_bounded(where.read_bytes(), str(where), CheckpointError)
    if not isinstance(doc, dict) or doc.get("peft_type") != "LORA":
        raise CheckpointError([f"{where}: peft_type {doc.get('peft_type') if isinstance(doc, dict) else doc!r}; "
                               "hpcx continues LoRA adapters ('LORA')"])
    return doc


def adapter_base(folder: str | Path) -> Path:
    """The base a PEFT folder adapts: its ``base_model_name_or_path``, a local folder or file."""
    folder = Path(folder)
    named = read_adapter_config(folder).get("base_model_name_or_path")
    base = Path(named) if isinstance(named, str) and named else None
    if base is not None and not base.is_absolute():
        base = (folder / base) if (folder / base).exists() else base
    if base is None or not base.exists():
        raise CheckpointError([f"`checkpoint.init_from`: {folder / ADAPTER_CONFIG}: base_model_name_or_path = "
                               f"{named!r} is not a local folder or file; hpcx downloads nothing"])
    return base


def adapter_problems(folder: Path, spec: tp.Any) -> list[str]:
    """A PEFT folder's settings that differ from the spec's ``[lora]`` (rank, alpha, targets, and
    ``modules_to_save`` against ``trainable``)."""
    from hpc.core.lora import hf_targets

    doc, lora, where = read_adapter_config(folder), spec.lora, f"`checkpoint.init_from`: {folder / ADAPTER_CONFIG}"
    if not lora.enabled:
        return [f"{where}: a LoRA adapter folder, but `lora.rank` = 0"]
    out = [f"{where}: {key} = {doc.get(key)!r}, the spec's `lora.{ours}` = {want!r}"
           for key, ours, want in (("r", "rank", lora.rank), ("lora_alpha", "alpha", lora.alpha))
           if doc.get(key) != want]
    theirs = doc.get("target_modules")
    if sorted(theirs if isinstance(theirs, list) else [theirs]) != sorted(hf_targets(lora, spec.model.arch)):
        out.append(f"{where}: target_modules = {theirs!r}, the spec's `lora.targets` are "
                   f"{hf_targets(lora, spec.model.arch)}")
    return out + _saved_problems(doc, spec, where)


def _saved_problems(doc: dict[str, tp.Any], spec: tp.Any, where: str) -> list[str]:
    """One line when the folder's ``modules_to_save`` (matched as PEFT matches them: every module whose
    name ends with one) are not the modules the spec's ``lora.trainable`` trains in full. A folder without
    any is fine: the parameters the spec trains in full start from the base (PEFT's model has the
    base's there too)."""
    from hpc.core.models import model_facts

    theirs = doc.get("modules_to_save")
    names = [theirs] if isinstance(theirs, str) else theirs or []
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        return [f"{where}: modules_to_save = {theirs!r}: expected a list of module names"]
    if not names:  # a plain adapter folder: what the spec trains in full starts from the base, as in PEFT
        return []
    facts = model_facts(spec.model)
    problems = module_problems(spec.lora, facts.family, facts.shape)
    if problems:
        return [f"{where}: {p}: no PEFT folder holds what the spec trains" for p in problems]
    want = set(full_modules(spec.lora, facts.family, facts.shape))
    got = _peft_matched(names, {t.name.rpartition(".")[0] for t in tensor_plan(facts.family, facts.shape)})
    if got == want:
        return []
    lacks, more = sorted(want - got), sorted(got - want)
    diff = "; ".join(f"{label} {', '.join(ms[:3])}{f' and {len(ms) - 3} more' if len(ms) > 3 else ''}"
                     for label, ms in (("lacks", lacks), ("also has", more)) if ms)
    return [f"{where}: modules_to_save = {theirs!r} are not the modules the spec's `lora.trainable` = "
            f"{spec.lora.trainable} trains in full ({len(want)}): the folder {diff}"]


def _peft_matched(names: list[str], modules: set[str]) -> set[str]:
    """The modules (with parameters) that PEFT's ``modules_to_save`` = ``names`` copy: it wraps every
    module whose dotted name ends with one of ``names`` (``str.endswith``), the wrapped one's whole subtree."""
    prefixes = {".".join(parts[:i]) for m in modules for parts in [m.split(".")] for i in range(1, len(parts) + 1)}
    wrapped = {p for p in prefixes if any(p.endswith(n) for n in names)}
    return {m for m in modules if any(m == w or m.startswith(w + ".") for w in wrapped)}


def read_adapters(folder: Path, spec: tp.Any, arch: str, shape: tp.Any) -> dict[str, torch.Tensor]:
    """The adapters of a PEFT folder by hpcx's parameter names, every one the spec's model has, checked;
    with them its ``modules_to_save`` parameters (``lora.trainable``), by hpcx's names too."""
    from hpc.ckpt.safetensors import SafetensorsReader
    from hpc.core.lora import adapter_shapes

    problems = adapter_problems(folder, spec)
    if problems:
        raise CheckpointError(problems)
    shapes = adapter_shapes(spec.model, spec.lora)
    names = peft_names(arch, shape, shapes)
    has_saved = bool(read_adapter_config(folder).get("modules_to_save"))  # checked to agree with the spec
    saved = {t.source: t for t in module_plan(spec.lora, arch, shape)} if has_saved else {}
    full = {t.source: (t.shape[::-1] if t.op == "transpose" else t.shape) for t in saved.values()}
    reader = SafetensorsReader(folder / ADAPTER_WEIGHTS)
    try:
        keys = {_no_adapter_name(k.removeprefix(reader.prefix)): k for k, e in reader.entries.items() if e.is_tensor}
        out, missing = {}, []
        for ours, theirs, want in [*((n, names[n], shapes[n]) for n in shapes),
                                   *((n, t.name, full[n]) for n, t in saved.items())]:
            if theirs not in keys:
                missing.append(f"`checkpoint.init_from`: {folder / ADAPTER_WEIGHTS}: no tensor {theirs}")
                continue
            value = reader.read(keys[theirs])
            if ours in saved and saved[ours].op == "transpose" and value.dim() == 2:
                value = value.t().contiguous()
            out[ours] = value
            if tuple(value.shape) != tuple(want):
                missing.append(f"`checkpoint.init_from`: {keys[theirs]} is {list(value.shape)}, the model's "
                               f"{ours} is {list(want)}")
        extra = sorted(set(keys) - set(names.values()) - {t.name for t in saved.values()})
        missing += [f"`checkpoint.init_from`: {folder / ADAPTER_WEIGHTS}: {k} matches no adapter or "
                    "modules_to_save parameter of the model" for k in extra]
    finally:
        reader.close()
    if missing:
        raise CheckpointError(missing)
    return out


def _no_adapter_name(key: str) -> str:
    """PEFT saves ``….lora_A.weight`` and ``model.norm.weight``; a state dict taken in memory has
    ``….lora_A.default.weight`` and ``model.norm.modules_to_save.default.weight``."""
    return (key.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
            .replace(".modules_to_save.default.", "."))
