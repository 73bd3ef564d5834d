"""Hugging Face checkpoints: ``hpcx ckpt convert RUN|STEP OUT --to hf`` and the tensors it maps.

The export reads a run's step folder (DCP; a run folder means its newest committed step), the
run's ``resolved.json`` for the model (family and shapes), and writes what ``from_pretrained``
loads with no missing or unexpected keys: ``config.json`` (``hpc.core.hf.hf_config``), safetensors
shards of at most ``shard_bytes`` (``model.safetensors`` alone, or ``model-0000i-of-0000n`` with
``model.safetensors.index.json``), in fp32 or bf16, and the tokenizer's files when the run's data
names a tokenizer. Tensors go through ``hpc.core.hf.tensor_plan`` one at a time through one reusable
buffer, so memory stays at about the largest tensor, as the other conversions.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import typing as tp
from pathlib import Path

import torch

from hpc.ckpt.dcp import DcpReader
from hpc.ckpt.entries import Progress, Reader, Scratch
from hpc.ckpt.merge import merged_reader
from hpc.ckpt.outputs import check_destination, fsync_file, parents_made, staged
from hpc.ckpt.safetensors import INDEX_FILE, ST_DTYPES
from hpc.ckpt.torch_zip import byte_view
from hpc.core.errors import CheckpointError, ConfigError
from hpc.core.config import load_json_bounded
from hpc.core.hf import CONFIG_FILE, HfTensor, hf_config, tensor_plan
from hpc.core.models import model_facts
from hpc.core.runs import RunDir
from hpc.core.spec import spec_from_dict
from hpc.core.validate import open_regular
from hpc.data.chat import (CONFIG_FILE as TOKENIZER_CONFIG, TEMPLATE_DIR, TEMPLATE_FILE, folder_templates,
                           template_digest)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GENERATION_FILE = "generation_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "generation_config.json")


def hf_tensors(state: tp.Mapping[str, torch.Tensor], arch: str, shape: tp.Any,
               dtype: torch.dtype = torch.float32) -> tp.Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) for every tensor of the model, from an hpcx state dict."""
    for t in tensor_plan(arch, shape):
        yield t.name, mapped(t, state[t.source] if t.source else None, dtype)


def mapped(t: HfTensor, value: torch.Tensor | None, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """``value`` (hpcx's tensor) as Hugging Face's ``t``, in ``dtype``, into ``out`` when given."""
    out = torch.empty(t.shape, dtype=dtype) if out is None else out
    if t.op == "zeros":
        return out.zero_()
    assert value is not None
    src = value.t() if t.op == "transpose" else value
    if tuple(src.shape) != t.shape:
        raise CheckpointError([f"{t.source}: shape {tuple(value.shape)}, the model's {t.name} needs {t.shape}"])
    return out.copy_(src)


# ---------------------------------------------------------------- the run's model


def run_of(path: Path) -> tuple[Path, Path]:
    """(run folder, step folder) of a run folder (its newest committed step) or a step folder."""
    path = path.resolve()
    if (path / ".metadata").exists() and path.parent.name == "checkpoints":
        return path.parent.parent, path
    steps = sorted(p for p in (path / "checkpoints").glob("step-*") if (p / ".metadata").exists())
    if not steps:
        raise CheckpointError([f"{path}: neither a step folder (checkpoints/step-N with .metadata) nor a run "
                               f"folder with a committed checkpoint"])
    if not (path / RunDir.RESOLVED).exists():
        raise CheckpointError([f"{path}: no resolved.json; --to hf needs the run's model"])
    return path, steps[-1]


def run_model(run: Path) -> tuple[str, tp.Any, dict[str, tp.Any]]:
    """(arch, shape, resolved.json) of a run: the model the export describes."""
    where = run / "resolved.json"
    try:
        resolved = load_json_bounded(bounded_bytes(where), str(where), CheckpointError)
        spec = spec_from_dict(resolved["spec"], str(where), read_hf_config=False)
    except (OSError, KeyError, TypeError) as exc:
        raise CheckpointError([f"{where}: cannot read the run's spec ({exc})"]) from None
    facts = model_facts(spec.model)
    try:
        tensor_plan(facts.family, facts.shape)
    except ConfigError as exc:
        raise ConfigError([f"{run}: {exc.messages[0]}"]) from None
    return facts.family, facts.shape, resolved


def tokenizer_files(resolved: dict[str, tp.Any], run: Path | None = None) -> list[Path]:
    """The tokenizer files of the run's data, when it names a tokenizer: the ``tokenizer.path`` of
    ``RUN/data.json`` (what the run trained on) or of the manifest of a prepared ``data.source``
    folder; a ``tokenizer.json`` brings the files beside it. None named (synthetic tokens, a flat
    ``.bin``): nothing (the export then has no tokenizer)."""
    named = _tokenizer_path(resolved, run)
    if named is None:
        return []
    folder = named if named.is_dir() else named.parent
    files = [folder / f for f in TOKENIZER_FILES if (folder / f).is_file()]
    return files if named.is_dir() or named in files else [named, *files]


def _tokenizer_path(resolved: dict[str, tp.Any], run: Path | None) -> Path | None:
    return _tokenizer(resolved, run)[0]


def _tokenizer(resolved: dict[str, tp.Any], run: Path | None) -> tuple[Path | None, dict[str, tp.Any]]:
    """(the tokenizer's path, what the run's data recorded about it: ``eos_id`` …; {} when nothing)."""
    data = resolved.get("spec", {}).get("data", {})
    data = data if isinstance(data, dict) else {}
    docs = [run / "data.json"] if run is not None else []
    if isinstance(data.get("source"), str):
        docs.append(Path(data["source"]) / "manifest.json")
    for doc in docs:
        try:
            tok = _read_json(doc).get("tokenizer")
        except AttributeError:
            continue
        path = tok.get("path") if isinstance(tok, dict) else tok
        if isinstance(path, str) and Path(path).exists():
            return Path(path), tok if isinstance(tok, dict) else {}
    return None, {}  # `[data]` names no tokenizer of its own: only prepared data records one


def chat_templates(resolved: dict[str, tp.Any], run: Path | None = None) -> dict[str, str]:
    """The chat templates the run's data was rendered with, by name (``default``, ``tool_use``): those
    ``RUN/data.json`` (or the prepared manifest) recorded; a manifest from before it kept them names
    the template by SHA-256, and the tokenizer folder's must still be that one. {} when the data used
    none."""
    record = _recorded(resolved, run, "chat_template")
    if not isinstance(record, dict):
        return {}
    if isinstance(record.get("templates"), dict):
        return {k: v for k, v in record["templates"].items() if isinstance(v, str)}
    named = _tokenizer_path(resolved, run)
    folder = named if named is None or named.is_dir() else named.parent
    found = folder_templates(folder) if folder is not None else {}
    if template_digest(found) != record.get("sha256"):
        raise CheckpointError([f"{run}: its data was rendered with the chat template {record.get('source')} (sha256 "
                               f"{str(record.get('sha256'))[:12]}…), which the tokenizer folder {folder} no longer "
                               "holds: expected that template, to export it with the model; restore it, or prepare "
                               "the data again"])
    return found


def _recorded(resolved: dict[str, tp.Any], run: Path | None, key: str) -> tp.Any:
    """``key`` of ``RUN/data.json``, else of the manifest of a prepared ``data.source``; None when neither has it."""
    data = resolved.get("spec", {}).get("data", {})
    docs = [run / "data.json"] if run is not None else []
    if isinstance(data, dict) and isinstance(data.get("source"), str):
        docs.append(Path(data["source"]) / "manifest.json")
    for doc in docs:
        found = _read_json(doc)
        if key in found:
            return found[key]
    return None


SPECIAL = ("bos", "eos", "pad")  # the tokens generate() needs: what starts, ends and pads a sequence


def special_token_ids(resolved: dict[str, tp.Any], run: Path | None = None) -> dict[str, int]:
    """``{"bos_token_id": …, "eos_token_id": …, "pad_token_id": …}`` of the run's tokenizer, those known:
    the EOS its data recorded (``data.json`` / the manifest: what every document ends with), else the one
    its ``tokenizer_config.json`` names; BOS and PAD as that file names them, looked up in its
    ``tokenizer.json`` (added tokens, then the vocabulary)."""
    path, record = _tokenizer(resolved, run)
    if path is None:
        return {}
    folder = path if path.is_dir() else path.parent
    names = _read_json(folder / "tokenizer_config.json")
    vocab = _token_ids(_read_json(folder / "tokenizer.json"))
    out = {}
    for kind in SPECIAL:
        name = names.get(f"{kind}_token")
        name = name.get("content") if isinstance(name, dict) else name
        if isinstance(name, str) and name in vocab:
            out[f"{kind}_token_id"] = vocab[name]
    if isinstance(record.get("eos_id"), int):
        out["eos_token_id"] = record["eos_id"]
    return out


MAX_RUN_JSON = 64 << 20  # a run's resolved.json / data.json, or a manifest of many shards


def bounded_bytes(path: Path, limit: int = MAX_RUN_JSON) -> bytes:
    """A JSON file of a run folder handed on the command line: a regular file (a FIFO or /dev/zero is
    refused unopened) of at most ``limit`` bytes; CheckpointError naming it otherwise."""
    with open_regular(path, str(path), "a regular JSON file", CheckpointError) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise CheckpointError([f"{path}: over {limit >> 20} MiB: expected a JSON file hpcx wrote"])
    return data


def _read_json(path: Path) -> dict[str, tp.Any]:
    """What a run recorded beside its checkpoint, or {} when it is absent, unreadable or not an object
    (read bounded in size and depth: it only adds to the export)."""
    try:
        doc = load_json_bounded(bounded_bytes(path), str(path), CheckpointError)
    except CheckpointError:
        return {}
    return doc if isinstance(doc, dict) else {}


def _token_ids(doc: dict[str, tp.Any]) -> dict[str, int]:
    """Token text → id of a ``tokenizer.json``: its vocabulary (a dict, or Unigram's list of pairs), then
    its added tokens over it."""
    raw = doc.get("model")
    model = raw if isinstance(raw, dict) else {}
    vocab = model.get("vocab")
    ids = {t: i for t, i in vocab.items() if isinstance(i, int)} if isinstance(vocab, dict) else {
        v[0]: i for i, v in enumerate(vocab) if isinstance(v, list) and v and isinstance(v[0], str)
    } if isinstance(vocab, list) else {}
    for t in doc.get("added_tokens") or []:
        if isinstance(t, dict) and isinstance(t.get("content"), str) and isinstance(t.get("id"), int):
            ids[t["content"]] = t["id"]
    return ids


# ---------------------------------------------------------------- export


def _missing(reader: Reader, plan: list[HfTensor]) -> list[str]:
    """Every planned source the checkpoint lacks or holds in another shape, one line each."""
    out = []
    for t in plan:
        if not t.source:
            continue
        e = reader.entries.get(f"model.{t.source}")
        want = t.shape[::-1] if t.op == "transpose" else t.shape
        if e is None or not e.is_tensor:
            out.append(f"{getattr(reader, 'path', '?')}: no tensor model.{t.source} (for {t.name})")
        elif e.shape != want:
            out.append(f"{getattr(reader, 'path', '?')}: model.{t.source} is {list(e.shape or ())}, the run's model "
                       f"has {list(want)}")
    return out


def hf_shards(plan: list[HfTensor], itemsize: int, shard_bytes: int) -> list[list[HfTensor]]:
    """The plan cut into files of at most ``shard_bytes`` (a larger tensor gets a file of its own)."""
    shards: list[list[HfTensor]] = [[]]
    size = 0
    for t in plan:
        n = math.prod(t.shape) * itemsize
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += n
    return shards



def write_shard(path: Path, reader: Reader, shard: list[HfTensor], dtype: torch.dtype, progress: Progress,
                 scratch: tuple[Scratch, Scratch]) -> None:
    """One safetensors file: the header, then each tensor read, mapped and written in turn."""
    header: dict[str, tp.Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in shard:
        n = math.prod(t.shape) * dtype.itemsize
        header[t.name] = {"dtype": ST_DTYPES[dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for t in shard:
            data = _tensor(reader, t, dtype, scratch)
            if data.numel():
                f.write(byte_view(data))
            progress(data.numel() * dtype.itemsize)
        fsync_file(f)


def _tensor(reader: Reader, t: HfTensor, dtype: torch.dtype, scratch: tuple[Scratch, Scratch]) -> torch.Tensor:
    """Hugging Face's tensor ``t``: read straight into the output buffer when no change is needed."""
    out = scratch[1].view(dtype, t.shape)
    if t.op == "zeros":
        return out.zero_()
    e = reader.entries[f"model.{t.source}"]
    if t.op == "copy" and e.dtype == dtype:
        reader.read_into(e.key, out)
        return out
    assert e.dtype is not None and e.shape is not None  # a tensor entry
    src = scratch[0].view(e.dtype, e.shape)
    reader.read_into(e.key, src)
    return mapped(t, src, dtype, out)


def export_hf(src: str | Path, dst: str | Path, *, dtype: str = "fp32", shard_bytes: int = 5 * 10**9,
              start: tp.Callable[[int], Progress] = lambda total: (lambda n: None),
              merge_lora: bool = False) -> dict[str, tp.Any]:
    """``hpcx ckpt convert SRC DST --to hf``: a Hugging Face folder of the run's model at ``dst``; with
    ``merge_lora``, a LoRA run's adapters merged into its base (``hpc.ckpt.merge.merged_reader``)."""
    if dtype not in DTYPES:
        raise ConfigError([f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}"])
    src, dst = Path(src), Path(dst)
    check_destination(dst, make_parents=True)
    run, step = run_of(src)
    if Path(os.path.realpath(dst)).is_relative_to(os.path.realpath(step)):
        raise CheckpointError([f"{dst}: inside the checkpoint {step} it reads; hpcx never writes into a checkpoint"])
    arch, shape, resolved = run_model(run)
    plan, torch_dtype = tensor_plan(arch, shape), DTYPES[dtype]
    reader = _lora_reader(run, step, resolved, arch, shape, merge_lora) or DcpReader(step)
    try:
        problems = _missing(reader, plan)
        if problems:
            raise CheckpointError(problems)
        shards = hf_shards(plan, torch_dtype.itemsize, shard_bytes)
        total = sum(math.prod(t.shape) for t in plan) * torch_dtype.itemsize
        special, tokenizer = special_token_ids(resolved, run), tokenizer_files(resolved, run)
        templates = chat_templates(resolved, run) if tokenizer else {}
        with parents_made(dst):
            _write_folder(dst, reader, shards, {**_config(arch, shape, dtype), **special}, torch_dtype,
                          start(total), tokenizer, special, templates)
    finally:
        reader.close()
    return {"src": str(step), "dst": str(dst), "arch": hf_config(arch, shape)["architectures"][0],
            "tensors": len(plan), "files": len(shards), "bytes": total, "dtype": dtype}


def _lora_reader(run: Path, step: Path, resolved: dict[str, tp.Any], arch: str, shape: tp.Any,
                 merge: bool) -> Reader | None:
    """``--merge-lora``'s reader (``hpc.ckpt.merge``); a LoRA run exported without it is refused in one line
    (its checkpoints hold the adapters, not the frozen base)."""
    lora = resolved.get("spec", {}).get("lora", {})
    if not merge:
        if isinstance(lora, dict) and lora.get("rank"):
            raise ConfigError([f"{run}: a LoRA run (`lora.rank` = {lora['rank']}): its checkpoints hold the "
                               "adapters; export --to peft, or --to hf --merge-lora for the merged model"])
        return None
    return merged_reader(run, step, resolved, arch, shape)


def _config(arch: str, shape: tp.Any, dtype: str) -> dict[str, tp.Any]:
    config = hf_config(arch, shape)
    config["torch_dtype"] = {"fp32": "float32", "bf16": "bfloat16"}[dtype]
    return config


def _write_folder(dst: Path, reader: Reader, shards: list[list[HfTensor]], config: dict[str, tp.Any],
                  dtype: torch.dtype, progress: Progress, tokenizer: list[Path], special: dict[str, int],
                  templates: dict[str, str] | None = None) -> None:
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    scratch = (Scratch(), Scratch())
    with staged(dst, folder=True) as tmp:
        write_text(tmp / CONFIG_FILE, json.dumps(config, indent=2) + "\n")
        for name, shard in zip(names, shards):
            write_shard(tmp / name, reader, shard, dtype, progress, scratch)
        if len(shards) > 1:
            weight_map = {t.name: name for name, shard in zip(names, shards) for t in shard}
            total = sum(math.prod(t.shape) for shard in shards for t in shard) * dtype.itemsize
            write_text(tmp / INDEX_FILE, json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                     indent=2) + "\n")
        for f in tokenizer:
            shutil.copyfile(f, tmp / f.name)
        if special:  # generate() stops at the EOS the model trained on (a copied file's other settings kept)
            generation = {**_read_json(tmp / GENERATION_FILE), **special}
            write_text(tmp / GENERATION_FILE, json.dumps(generation, indent=2) + "\n")
        if templates:
            _write_templates(tmp, templates)


def _write_templates(folder: Path, templates: dict[str, str]) -> None:
    """The chat templates as transformers' ``save_pretrained`` writes them today: ``chat_template.jinja``
    (the default), ``additional_chat_templates/NAME.jinja`` (the others), and no ``chat_template`` left in
    ``tokenizer_config.json`` (a copied one could be another template than the run's)."""
    write_text(folder / TEMPLATE_FILE, templates["default"])
    for name, text in sorted(templates.items()):
        if name != "default":
            (folder / TEMPLATE_DIR).mkdir(exist_ok=True)
            write_text(folder / TEMPLATE_DIR / f"{name}.jinja", text)
    config = _read_json(folder / TOKENIZER_CONFIG)
    if config.pop("chat_template", None) is not None:
        write_text(folder / TOKENIZER_CONFIG, json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def write_text(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        fsync_file(f)  # type: ignore[arg-type]
