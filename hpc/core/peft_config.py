"""PEFT adapter folders without torch: reading ``adapter_config.json`` (bounded, PEFT's field types) and
judging it against the spec's ``[lora]`` and model, on the login node before anything is queued (issue
47: a wrong rank, base or target was found only when the job started). ``hpc.ckpt.peft`` (torch) reads
the weights' header and the tensors; this module is what needs no torch, so a bad config is refused in
the time a spec takes to load. The modules ``lora.trainable`` trains in full are PEFT's
``modules_to_save`` (``full_modules``; see ``hpc.ckpt.peft``).
"""

from __future__ import annotations

import json
import math
import typing as tp
from pathlib import Path

from hpc.core.config import load_json_bounded
from hpc.core.errors import CheckpointError, ConfigError
from hpc.core.hf import HfTensor, hf_config, tensor_plan
from hpc.core.lora import family_targets, hf_targets, resolved_targets, trains_in_full
from hpc.core.models import model_facts
from hpc.core.validate import open_regular

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def fan_in_fan_out(arch: str, shape: tp.Any) -> bool:
    """Whether Hugging Face stores the targets transposed (GPT-2's Conv1D): PEFT's ``fan_in_fan_out``."""
    return any(t.op == "transpose" for t in tensor_plan(arch, shape))


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
    doc, lora, where = read_adapter_config(folder), spec.lora, f"`checkpoint.init_from`: {folder / ADAPTER_CONFIG}"
    if not lora.enabled:
        return [f"{where}: a LoRA adapter folder, but `lora.rank` = 0"]
    out = [f"{where}: {key} = {doc.get(key, default)!r}, the spec's `lora.{ours}` = {want!r}"
           for key, ours, want, default in (("r", "rank", lora.rank, 8), ("lora_alpha", "alpha", lora.alpha, 8))
           if doc.get(key, default) != want]
    facts = model_facts(spec.model)
    if doc.get("fan_in_fan_out", False) != fan_in_fan_out(facts.family, facts.shape):
        out.append(f"{where}: fan_in_fan_out = {doc.get('fan_in_fan_out', False)}, but {spec.model.arch!r} stores "
                   f"its targets {'transposed (Conv1D)' if not doc.get('fan_in_fan_out') else 'as nn.Linear does'}")
    theirs = doc.get("target_modules")
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


def listed(label: str, items: list[str], most: int = 3) -> str:
    """``label: a, b, c and 5 more`` (empty for no items): one line however many there are."""
    if not items:
        return ""
    more = f" and {len(items) - most} more" if len(items) > most else ""
    return f"{label}: {', '.join(items[:most])}{more}"


def config_problems(spec: tp.Any) -> list[str]:
    """``checkpoint.init_from`` as a PEFT folder: its config against the spec, one line per problem, each
    starting with the key (the login node's first check, before torch is imported for the headers)."""
    folder = Path(spec.checkpoint.init_from)
    if not is_adapter_folder(folder):
        return []
    try:
        problems = adapter_problems(folder, spec)
    except (CheckpointError, ConfigError) as exc:
        problems = exc.messages
    return [p if p.startswith("`checkpoint.init_from`") else f"`checkpoint.init_from`: {p}" for p in problems]
