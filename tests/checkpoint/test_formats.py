"""The checkpoint formats are one table (``hpc.ckpt.formats``): detection, opening, ``--to`` targets,
what ``inspect`` says it checked, and how ``checkpoint.init_from`` reads, all asked of it. A made-up
format added as one row is recognized, inspected and written without a change anywhere else."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpc.ckpt import convert, formats
from hpc.ckpt.entries import tensor_entry

MAGIC = b"TOY!"


class ToyReader:
    """A toy format: the magic, then float32 values of one tensor ``model.w``."""

    format = "toy"

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.values = torch.frombuffer(bytearray(self.path.read_bytes()[len(MAGIC):]), dtype=torch.float32)
        self.entries = {"model.w": tensor_entry("model.w", torch.float32, tuple(self.values.shape))}
        self.paths, self.meta = {"model.w": ("model", "w")}, {"step": 3}

    def read(self, key: str) -> torch.Tensor:
        return self.values.clone()

    def read_into(self, key: str, out: torch.Tensor) -> None:
        out.copy_(self.values)

    def close(self) -> None:
        pass


def write_toy(reader, dst: Path, keys: list[str], *, progress, scratch, **_) -> Path:
    dst.write_bytes(MAGIC + b"".join(reader.read(k).to(torch.float32).numpy().tobytes() for k in keys))
    return dst


TOY = formats.Format("toy", None, lambda path, head, size: head[:4] == MAGIC, f"{__name__}:ToyReader", write_toy,
                     "the magic and a whole number of float32 values")


@pytest.fixture
def toy_table(monkeypatch):
    table = (*formats.FORMATS, TOY)
    monkeypatch.setattr(formats, "FORMATS", table)
    monkeypatch.setattr(formats, "BY_NAME", {f.name: f for f in table})
    monkeypatch.setattr(formats, "TARGETS", tuple(f.name for f in table))


def test_a_format_added_as_a_row_is_detected_inspected_and_written(toy_table, tmp_path):
    src = tmp_path / "w.pt"
    torch.save({"model": {"w": torch.arange(4.0)}}, src)
    out = convert.convert_checkpoint(src, tmp_path / "w.toy", "toy")
    assert out["from"] == "torch" and out["to"] == "toy"
    assert convert.detect_format(tmp_path / "w.toy") == "toy"
    info = convert.inspect_checkpoint(tmp_path / "w.toy")
    assert info["format"] == "toy" and info["step"] == 3 and info["checked"] == TOY.checked
    assert info["digests"] is None and info["tensors"] == [{"key": "model.w", "dtype": "float32", "shape": [4],
                                                            "bytes": 16}]
    back = convert.convert_checkpoint(tmp_path / "w.toy", tmp_path / "back.safetensors", "safetensors")
    assert back["from"] == "toy" and convert.verify_checkpoints(tmp_path / "w.toy", tmp_path / "back.safetensors",
                                                                model_only=True)["equal"]
    with pytest.raises(Exception, match="only --to dcp writes digests"):
        convert.convert_checkpoint(src, tmp_path / "d.toy", "toy", digest=True)


def test_init_from_cannot_read_a_format_whose_row_says_so(toy_table, tmp_path):
    from hpc.ckpt.init_source import source_format
    from hpc.core.errors import CheckpointError

    (tmp_path / "w.toy").write_bytes(MAGIC + bytes(8))
    with pytest.raises(CheckpointError, match="a toy checkpoint, which init_from cannot read"):
        source_format(tmp_path / "w.toy")
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    assert source_format(run) is formats.saved()  # a run folder is what training saves


def test_every_row_names_its_reader_and_every_init_read_has_a_loader():
    from trainer.init_from import LOADERS

    for f in formats.FORMATS:
        assert formats.load(f.reader).format == f.name
        assert f.init_reads in LOADERS and (f.offsets != "") == f.planned_reads
    assert formats.saved().name == "dcp" and formats.TARGETS == tuple(f.name for f in formats.FORMATS)
    assert dataclasses.is_dataclass(formats.Format)


def test_the_cli_offers_the_tables_targets_and_hf_without_importing_torch():
    code = ("import sys, hpc.cli.ckpt as c; opt = next(p for p in c.convert_cmd.params if p.name == 'to'); "
            "print(list(opt.type.choices), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"{[*formats.TARGETS, 'hf', 'peft']} False"  # hf and peft: the exports of a model, not a table's
