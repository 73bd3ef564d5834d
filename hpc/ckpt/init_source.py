"""What ``checkpoint.init_from`` names, read from headers alone: which tensor of it feeds which parameter.

A source is one of:

- a Hugging Face folder (``config.json`` beside ``model.safetensors`` or shards with
  ``model.safetensors.index.json``): names mapped by ``hpc.core.hf.tensor_plan`` (the Llama family), and
  its ``config.json`` must describe the run's model (torchtune's checkpointer refuses the same);
- an hpcx run folder (its newest committed step) or step folder (DCP): the ``model.*`` entries;
- one ``.safetensors`` file (hpcx's, ``model.``-prefixed or not, or Hugging Face's names) or one
  ``torch.save`` file (a plain ``state_dict()`` or hpcx's export).

Every file is opened through hpc/ckpt's hardened readers (headers, index and DCP metadata checked,
nothing unpickled outside the allow-list) and nothing but headers is read. ``open_source`` returns
an ``InitSource`` (for each parameter: the source's name, dtype, shape and, for safetensors, the
file and byte offset its data starts at) or raises ``CheckpointError`` with one line per problem:
every missing parameter, shape mismatch, non-floating dtype and unmatched tensor at once.
"""

from __future__ import annotations

import math
import typing as tp
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hpc.ckpt import formats
from hpc.ckpt.files import METADATA_FILE
from hpc.ckpt.peft import adapter_base, adapter_problems, is_adapter_folder, listed, weight_problems
from hpc.core.errors import CheckpointError, ConfigError
from hpc.core.hf import CONFIG_FILE, hf_config, read_config, spec_fields, tensor_plan
from hpc.core.models import HfReader, families, family, model_facts

FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
IGNORED = ("context_len",)  # the length a fine-tune trains at is its own choice (max_position_embeddings)


@dataclass(frozen=True)
class SourceTensor:
    """One tensor of the source, as its header describes it."""

    key: str  # its name in the source (a reader key for dcp/torch)
    dtype: torch.dtype
    shape: tuple[int, ...]
    file: Path | None = None  # safetensors: the file and the absolute byte offset of its data
    offset: int = 0


@dataclass
class InitSource:
    """A checked source: ``tensors`` maps each of the model's parameter names to its source tensor."""

    path: Path
    kind: str  # its format (``hpc.ckpt.formats``): "safetensors" (HF folder or one file), "dcp" or "torch"
    tensors: dict[str, SourceTensor] = field(default_factory=dict)
    step: Path | None = None  # dcp: the step folder read

    @property
    def nbytes(self) -> int:
        return sum(t.dtype.itemsize * math.prod(t.shape) for t in self.tensors.values())



def expected(arch: str, shape: tp.Any) -> dict[str, tuple[int, ...]]:
    """The model's parameter names and shapes (hpcx's layout), from the family's tensor plan."""
    return {t.source: (t.shape[::-1] if t.op == "transpose" else t.shape) for t in tensor_plan(arch, shape)
            if t.source}


def hf_to_hpcx(family: str, shape: tp.Any) -> dict[str, str]:
    """Hugging Face name → hpcx parameter name, for families whose tensors are Hugging Face's as they
    are (the Llama; GPT-2's are transposed and have biases hpcx's GPT lacks)."""
    plan = tensor_plan(family, shape)
    return {t.name: t.source for t in plan} if all(t.op == "copy" for t in plan) else {}


# ---------------------------------------------------------------- reading headers


def _reader_tensors(reader: tp.Any) -> dict[str, SourceTensor]:
    return {k: SourceTensor(k, e.dtype, e.shape) for k, e in reader.entries.items() if e.is_tensor}


def _dcp_step(path: Path) -> Path:
    """A step folder (``.metadata``), or a run folder's newest committed step."""
    if (path / METADATA_FILE).exists():
        return path
    steps = sorted(p for p in (path / "checkpoints").glob("step-*") if (p / METADATA_FILE).exists())
    if not steps:
        raise CheckpointError([f"`checkpoint.init_from` = {str(path)!r}: a folder with neither safetensors, a DCP "
                               ".metadata nor a run's committed checkpoint"])
    return steps[-1]


def source_format(path: Path) -> formats.Format:
    """The format of ``checkpoint.init_from`` (``hpc.ckpt.formats``): a run folder is what training saves."""
    saved = formats.saved()
    if path.is_dir() and not (saved.folder and saved.folder(path)) and (path / "checkpoints").is_dir():
        return saved
    if not path.exists():
        raise CheckpointError([f"`checkpoint.init_from` = {str(path)!r}: no such file or folder"])
    check_bin_folder(path)
    fmt = formats.detect(path)
    if not fmt.init_reads:
        raise CheckpointError([f"`checkpoint.init_from` = {str(path)!r}: a {fmt.name} checkpoint, which init_from "
                               "cannot read"])
    return fmt


def check_bin_folder(path: Path) -> None:
    """A Hugging Face folder whose weights are ``.bin`` torch files only (no safetensors, no DCP): say to
    name the file (init_from reads one torch file), or, when sharded, to make safetensors of them."""
    if not path.is_dir() or (path / METADATA_FILE).exists() or any(path.glob("*.safetensors")):
        return
    bins = sorted(p.name for p in path.glob("*.bin") if p.is_file())
    if len(bins) == 1:
        raise CheckpointError([f"`checkpoint.init_from` = {str(path)!r}: its weights are one torch file: point "
                               f"init_from at the file, {str(path / bins[0])!r}"])
    if bins:
        raise CheckpointError([f"`checkpoint.init_from` = {str(path)!r}: its weights are {len(bins)} torch files "
                               f"({bins[0]} …); init_from reads one torch file, or safetensors shards: load and "
                               "save_pretrained them with transformers (safetensors), then point init_from here"])


def read_source(path: Path) -> tuple[str, dict[str, SourceTensor], Path | None]:
    """(format, the source's tensors by their own names, the step folder of a run) from headers alone."""
    fmt = source_format(path)
    step = _dcp_step(path) if fmt.saves else None
    if fmt.offsets:
        found = formats.load(fmt.offsets)(path)
        return fmt.name, {n: SourceTensor(n, dtype, shape, file, offset) for n, (dtype, shape, file, offset)
                          in found.items()}, None
    reader = fmt.open(step or path)
    try:
        return fmt.name, _reader_tensors(reader), step
    finally:
        reader.close()


def _name_map(kind: str, names: tp.Iterable[str], arch: str, shape: tp.Any) -> dict[str, str]:
    """Source name → parameter name: of the candidate namings (hpcx's, ``model.``-prefixed, Hugging
    Face's), the one that matches the most names."""
    names = list(names)
    ours = expected(arch, shape)
    candidates = [{n: n for n in names if n in ours},
                  {n: n[len("model."):] for n in names if n.startswith("model.") and n[len("model."):] in ours}]
    if not formats.get(kind).saves:  # what training saves has hpcx's names only
        hf = hf_to_hpcx(arch, shape)
        candidates.append({n: hf[n] for n in names if n in hf})
        # a torch file's plain state_dict reads as model.* entries: a pytorch_model.bin's HF names under it
        candidates.append({n: hf[n[len("model."):]] for n in names if n.startswith("model.") and n[len("model."):] in hf})
    return max(candidates, key=len)


# ---------------------------------------------------------------- checking


def open_source(path: str | Path, arch: str, shape: tp.Any) -> InitSource:
    """The checked source for a model of ``arch`` and ``shape``; CheckpointError listing every problem."""
    path = Path(path)
    if is_adapter_folder(path):  # a PEFT folder: its base (the adapters: hpc.ckpt.peft)
        path = adapter_base(path)
    problems = _config_problems(path, arch, shape)
    if problems:  # another model: its tensors differ too, which says nothing more
        raise CheckpointError(problems)
    kind, tensors, step = read_source(path)
    mapping = _name_map(kind, tensors, arch, shape)
    ours = expected(arch, shape)
    source = InitSource(path, kind, step=step)
    for name, param in mapping.items():
        source.tensors[param] = tensors[name]
    problems += _tensor_problems(path, source, ours, set(tensors) - set(mapping), arch, shape)
    if problems:
        raise CheckpointError(problems)
    return source


def _tensor_problems(path: Path, source: InitSource, ours: dict[str, tuple[int, ...]], unmatched: set[str],
                     arch: str, shape: tp.Any) -> list[str]:
    """One line per kind of problem (missing, shapes, dtypes, unmatched), each naming the first few: a
    base of another size differs in every tensor, and that is one problem, not one per tensor."""
    missing = [f"{name} {list(want)}" for name, want in ours.items() if name not in source.tensors]
    shapes = [f"{t.key} is {list(t.shape)}, the model's {name} is {list(ours[name])}"
              for name, t in source.tensors.items() if t.shape != ours[name]]
    dtypes = [f"{t.key} ({str(t.dtype).removeprefix('torch.')})" for t in source.tensors.values()
              if t.dtype not in FLOATS]
    tied_extra = {"lm_head.weight", "model.head.weight", "head.weight"} if getattr(shape, "tied", False) else set()
    prefix_ok = formats.get(source.kind).saves  # a saved step holds optimizer state and more beside model.*
    extra = [name for name in sorted(unmatched) if name not in tied_extra and not (prefix_ok and not name.startswith(
        "model.")) and not name.endswith("rotary_emb.inv_freq")]
    lines = (listed(f"no tensor for {len(missing)} of the model's parameters", missing),
             listed(f"{len(shapes)} tensors have other shapes", shapes),
             listed(f"{len(dtypes)} tensors are not floating point", dtypes),
             listed(f"{len(extra)} tensors match no parameter of the model", extra))
    return [f"`checkpoint.init_from`: {path}: {line}" for line in lines if line]


def _config_problems(path: Path, arch: str, shape: tp.Any) -> list[str]:
    """A Hugging Face folder's ``config.json`` must describe the run's model, value for value."""
    config = path / CONFIG_FILE if path.is_dir() else None
    if config is None or not (config.exists() or config.is_symlink()):  # a FIFO or device: read_config refuses it
        return []
    if not hf_to_hpcx(arch, shape):  # nothing would match: one line, not one per tensor
        readers = [f.phrase for f in families() if isinstance(f, HfReader)]
        raise CheckpointError([f"`checkpoint.init_from`: {path} is a Hugging Face folder; hpcx reads those for "
                               f"{', '.join(readers[:-1])} or {readers[-1]}, not {arch!r} (GPT-2 has biases and "
                               "Conv1D layouts hpcx's GPT does not)"])
    theirs = spec_fields(config, read_config(config))  # refuses what hpcx does not implement
    ours = spec_fields(config, hf_config(arch, shape))  # the run's model, read the same way
    names = {"arch": "architectures", **{o: t for t, o in tp.cast(HfReader, family(arch)).hf_keys}}
    differ = [f"{names.get(key, key)} = {theirs.get(key)!r} (the run's model has {ours[key]!r})" for key in ours
              if key not in IGNORED and theirs.get(key) != ours[key]]
    line = listed("describes another model", differ, most=4)
    return [f"`checkpoint.init_from`: {config}: {line}"] if line else []


def init_from_problems(spec: tp.Any) -> list[str]:
    """Login-node check of ``spec.checkpoint.init_from`` against ``spec.model`` (headers only)."""
    if not spec.checkpoint.init_from:
        return []
    facts = model_facts(spec.model)
    try:
        open_source(spec.checkpoint.init_from, facts.family, facts.shape)
        if is_adapter_folder(spec.checkpoint.init_from):
            folder = Path(spec.checkpoint.init_from)
            problems = adapter_problems(folder, spec) or weight_problems(folder, spec, facts.family, facts.shape)
            return [p if p.startswith("`checkpoint.init_from`") else f"`checkpoint.init_from`: {p}" for p in problems]
    except (CheckpointError, ConfigError) as exc:
        return [m if m.startswith("`checkpoint.init_from`") else f"`checkpoint.init_from`: {m}" for m in exc.messages]
    return []
