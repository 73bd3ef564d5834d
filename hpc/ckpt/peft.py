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
    from hpc.ckpt.hf import _write_shard, _write_text, run_model, run_of
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
            _write_text(tmp / ADAPTER_CONFIG, json.dumps(adapter_config(spec, arch, shape), indent=2) + "\n")
            _write_shard(tmp / ADAPTER_WEIGHTS, reader, plan, torch.float32, lambda n: None, (Scratch(), Scratch()))
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
    """Whether ``path`` is a PEFT adapter folder (``adapter_config.json``, whatever kind of file it is:
    a FIFO or a device there is refused by ``read_adapter_config``, not taken for a base folder)."""
    config = Path(path) / ADAPTER_CONFIG
    return Path(path).is_dir() and (config.exists() or config.is_symlink())


MAX_CONFIG_BYTES = 1 << 20  # PEFT writes ~1 KB; a bigger adapter_config.json is not one
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


def read_adapter_config(folder: Path) -> dict[str, tp.Any]:
    """``adapter_config.json`` of a PEFT folder, read bounded (a regular file of at most 1 MiB, JSON
    nested at most 32 deep) and checked to be a LoRA one whose fields have PEFT's types."""
    from hpc.core.config import load_json_bounded
    from hpc.core.validate import open_regular

    where = folder / ADAPTER_CONFIG
    with open_regular(where, str(where), "PEFT's adapter_config.json", CheckpointError) as f:
        data = f.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise CheckpointError([f"{where}: over {MAX_CONFIG_BYTES >> 20} MiB: expected PEFT's adapter_config.json "
                               "of a few KB"])
    doc = load_json_bounded(data, str(where), CheckpointError)
    if not isinstance(doc, dict) or doc.get("peft_type") != "LORA":
        raise CheckpointError([f"{where}: peft_type {doc.get('peft_type') if isinstance(doc, dict) else doc!r}; "
                               "hpcx continues LoRA adapters ('LORA')"])
    problems = config_field_problems(doc)
    if problems:
        raise CheckpointError([f"{where}: {'; '.join(problems)}"])
    return doc


def _number(x: tp.Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _names(x: tp.Any) -> bool:
    return isinstance(x, list) and all(isinstance(n, str) and n for n in x)


# field → (whether a value is well-typed, what is expected); absent fields take PEFT's defaults
CONFIG_FIELDS: dict[str, tuple[tp.Callable[[tp.Any], bool], str]] = {
    "r": (lambda x: isinstance(x, int) and not isinstance(x, bool) and 0 < x <= 65536, "an integer rank from 1"),
    "lora_alpha": (lambda x: _number(x) and x >= 0, "a number"),
    "lora_dropout": (lambda x: _number(x) and 0 <= x < 1, "a number from 0 to below 1"),
    "target_modules": (lambda x: _names(x) and bool(x) or (isinstance(x, str) and bool(x)),
                       "a list of module names"),
    "modules_to_save": (lambda x: x is None or _names(x), "a list of module names, or null"),
    "base_model_name_or_path": (lambda x: x is None or isinstance(x, str), "a path"),
    "fan_in_fan_out": (lambda x: isinstance(x, bool), "true or false"),
    "bias": (lambda x: x == "none", "'none' (hpcx's adapters train no biases)"),
    "use_dora": (lambda x: x is False or x is None, "false (hpcx trains LoRA, not DoRA)"),
    "use_rslora": (lambda x: x is False or x is None, "false (hpcx scales by alpha / r)"),
    "layers_to_transform": (lambda x: x is None, "null (hpcx adapts the targets of every layer)"),
    "rank_pattern": (lambda x: not x, "{} (one rank for every target)"),
    "alpha_pattern": (lambda x: not x, "{} (one alpha for every target)"),
}


def config_field_problems(doc: dict[str, tp.Any]) -> list[str]:
    """Each field of ``CONFIG_FIELDS`` present with another type or a value hpcx does not train."""
    return [f"{key} = {shown_value(doc[key])}: expected {what}" for key, (ok, what) in CONFIG_FIELDS.items()
            if key in doc and not ok(doc[key])] + (["r is missing: expected an integer rank from 1"]
                                                   if "r" not in doc else [])


def shown_value(value: tp.Any) -> str:
    """A JSON value as the file has it, cut (a 1 MiB string stays a line)."""
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


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
    out = [f"{where}: {key} = {doc.get(key, default)!r}, the spec's `lora.{ours}` = {want!r}"
           for key, ours, want, default in (("r", "rank", lora.rank, 8), ("lora_alpha", "alpha", lora.alpha, 8))
           if doc.get(key, default) != want]
    from hpc.core.models import model_facts

    facts = model_facts(spec.model)
    if doc.get("fan_in_fan_out", False) != fan_in_fan_out(facts.family, facts.shape):
        out.append(f"{where}: fan_in_fan_out = {doc.get('fan_in_fan_out', False)}, but {spec.model.arch!r} stores "
                   f"its targets {'transposed (Conv1D)' if not doc.get('fan_in_fan_out') else 'as nn.Linear does'}")
    theirs = doc.get("target_modules")
    from hpc.core.lora import family_targets

    known = [hf for _, hf in family_targets(spec.model.arch)]
    unknown = [t for t in (theirs if isinstance(theirs, list) else []) if t not in known]
    if unknown:
        return out + [f"{where}: target_modules = {theirs!r}: {', '.join(map(repr, unknown))} is no module of "
                      f"{spec.model.arch!r} (its projections: {', '.join(known)})"]
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
    names = theirs or []  # a list of names or null (read_adapter_config)
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


def listed(label: str, items: list[str], most: int = 3) -> str:
    """``label: a, b, c and 5 more`` (empty for no items): one line however many there are."""
    if not items:
        return ""
    more = f" and {len(items) - most} more" if len(items) > most else ""
    return f"{label}: {', '.join(items[:most])}{more}"


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
