"""``TorchReader.read_rows``: only a tensor's rows from a stored, contiguous record; anything else (a
transposed view, a deflated record) refused so that ``load_torch_file`` reads it whole and slices."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

from hpc.ckpt.init_source import InitSource, SourceTensor
from hpc.ckpt.torchsave import TorchReader
from trainer.init_from import load_torch_file


def saved(tmp_path: Path, state: dict) -> Path:
    torch.save(state, tmp_path / "m.pt")
    return tmp_path / "m.pt"


def test_rows_of_a_contiguous_tensor_are_one_range(tmp_path):
    w = torch.randn(10, 6)
    reader = TorchReader(saved(tmp_path, {"w": w, "v": torch.arange(5.0)}))
    try:
        out = torch.empty(3, 6)
        assert reader.read_rows("model.w", 4, 7, out) and torch.equal(out, w[4:7])
        assert reader.read_rows("model.w", 10, 10, torch.empty(0, 6))
        assert not reader.read_rows("model.w", 8, 11, torch.empty(3, 6))  # past the end: refused, nothing read
        assert not reader.read_rows("model.w", 0, 2, torch.empty(2, 5))  # wrong size
        one = torch.empty(2)
        assert reader.read_rows("model.v", 1, 3, one) and torch.equal(one, torch.tensor([1.0, 2.0]))
    finally:
        reader.close()


def test_a_view_into_a_larger_storage_reads_its_own_rows(tmp_path):
    base = torch.randn(20, 4)
    reader = TorchReader(saved(tmp_path, {"w": base[5:15]}))  # storage offset 20 elements
    try:
        out = torch.empty(2, 4)
        assert reader.read_rows("model.w", 3, 5, out) and torch.equal(out, base[8:10])
    finally:
        reader.close()


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(6, 8))
        self.b = nn.Parameter(torch.zeros(8, 3))


def load(path: Path, state: dict) -> tuple[Two, int]:
    """``state`` loaded into a fresh ``Two`` through ``load_torch_file``; (the model, the bytes read)."""
    tensors = {n: SourceTensor(f"model.{n}", t.dtype, tuple(t.shape)) for n, t in state.items()}
    source = InitSource(path, "torch", tensors)
    model = Two()
    return model, load_torch_file(model, source)


def test_a_transposed_tensor_loads_through_the_whole_read(tmp_path):
    a, b = torch.randn(6, 8), torch.randn(3, 8).t()  # b is stored transposed: not row-contiguous
    reader = TorchReader(saved(tmp_path, {"a": a, "b": b}))
    try:
        assert not reader.read_rows("model.b", 0, 8, torch.empty(8, 3))
    finally:
        reader.close()
    model, read = load(tmp_path / "m.pt", {"a": a, "b": b})
    assert torch.equal(model.a, a) and torch.equal(model.b, b)
    assert read == (48 + 24) * 4


def test_a_deflated_record_falls_back_to_the_whole_read(tmp_path):
    a, b = torch.randn(6, 8), torch.randn(8, 3)
    src = saved(tmp_path, {"a": a, "b": b})
    packed = tmp_path / "packed.pt"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(packed, "w") as zout:
        for info in zin.infolist():
            method = zipfile.ZIP_DEFLATED if "/data/" in info.filename else zipfile.ZIP_STORED
            zout.writestr(info.filename, zin.read(info), compress_type=method)
    reader = TorchReader(packed)
    try:
        assert reader.streamed and len(reader.zip.compressed()) == 2
        assert not reader.read_rows("model.a", 0, 1, torch.empty(1, 8))
    finally:
        reader.close()
    model, _ = load(packed, {"a": a, "b": b})
    assert torch.equal(model.a, a) and torch.equal(model.b, b)


if __name__ == "__main__":
    pytest.main([__file__])
