"""The streaming ``torch.save`` reader (hpc/ckpt/torch_zip.py) and hpcx's DCP fast paths."""

from __future__ import annotations

import pickle
import sys
import zipfile
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ckpt_helpers import build, train_step  # noqa: E402

from hpc.core.errors import CheckpointError  # noqa: E402
from trainer.checkpoint import Checkpointer, latest_checkpoint, load_checkpoint  # noqa: E402
from hpc.ckpt.torchsave import TorchReader  # noqa: E402


def assert_bit_exact(got: torch.Tensor, want: torch.Tensor, key: str) -> None:
    assert (got.dtype, got.shape, got.stride()) == (want.dtype, want.shape, want.stride()), key
    if want.numel():
        assert torch.equal(got.contiguous().reshape(-1).view(torch.uint8),
                           want.contiguous().reshape(-1).view(torch.uint8)), key


def sample_state() -> dict:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 8, generator=g)
    shared = torch.randn(10, generator=g)
    return {
        "model": OrderedDict([
            ("fp32", base), ("bf16", torch.randn(5, 3, generator=g).bfloat16()),
            ("fp16", torch.randn(7, generator=g).half()), ("int64", torch.arange(-5, 6)),
            ("transposed", base.t()), ("head", shared[:4]), ("tail", shared[3:].view(7, 1)),
            ("strided", shared[::3]), ("empty", torch.zeros(0, 4)), ("scalar", torch.tensor(2.5)),
            ("flag", torch.tensor([True, False])), ("u16", torch.arange(4).to(torch.uint16)),
            ("param", torch.nn.Parameter(torch.ones(3))),
        ]),
        "optim": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 2, generator=g)}},
                  "param_groups": [{"lr": 0.01, "betas": (0.9, 0.95), "params": [0]}]},
        "train": {"step": 7, "name": "run"},
    }


def test_streamed_torch_file_is_bit_exact_against_torch_load(tmp_path: Path) -> None:
    torch.save(sample_state(), tmp_path / "s.pt")
    want_flat = {}
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    want_flat, _ = flatten_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    reader = TorchReader(tmp_path / "s.pt")
    try:
        assert reader.streamed, reader.fallback_reason
        assert set(reader.entries) == set(want_flat)
        for key, want in want_flat.items():
            got = reader.read(key)
            if isinstance(want, torch.Tensor):
                assert not got.is_meta and got.untyped_storage().nbytes() <= max(want.untyped_storage().nbytes(), 1)
                assert_bit_exact(got, want, key)
            else:
                assert got == want, key
    finally:
        reader.close()


class Planted:
    def __init__(self, target: Path):
        self.target = target

    def __reduce__(self):
        return (open, (str(self.target), "w"))


def test_planted_pickle_in_data_pkl_is_refused_without_running(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    torch.save({"w": torch.zeros(2)}, tmp_path / "good.pt")
    # Replace data.pkl with a pickle that would create ``marker``; keep the archive otherwise valid.
    with zipfile.ZipFile(tmp_path / "good.pt") as src, zipfile.ZipFile(tmp_path / "bad.pt", "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("data.pkl"):
                data = pickle.dumps({"w": Planted(marker)}, protocol=2)
            dst.writestr(info.filename, data)
    with pytest.raises(CheckpointError, match="bad.pt"):
        TorchReader(tmp_path / "bad.pt")
    assert not marker.exists()


def test_truncated_zip_is_refused_with_one_line(tmp_path: Path) -> None:
    torch.save({"w": torch.randn(1000)}, tmp_path / "t.pt")
    data = (tmp_path / "t.pt").read_bytes()
    for cut in (len(data) // 2, len(data) - 10):
        (tmp_path / "cut.pt").write_bytes(data[:cut])
        with pytest.raises(CheckpointError) as err:
            TorchReader(tmp_path / "cut.pt")
        assert len(err.value.messages) == 1 and "cut.pt" in err.value.messages[0]
        assert "\n" not in err.value.messages[0]


def test_legacy_non_zip_file_falls_back_to_weights_only_torch_load(tmp_path: Path) -> None:
    state = {"w": torch.arange(6.0).view(2, 3)}
    torch.save(state, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    reader = TorchReader(tmp_path / "old.pt")
    try:
        assert not reader.streamed
        assert_bit_exact(reader.read("model.w"), state["w"], "w")
    finally:
        reader.close()


def test_fast_load_equals_saved_state_and_torn_shards_are_still_refused(tmp_path: Path) -> None:
    import os

    model, optimizer, scheduler = build("none")
    train_step(model, optimizer, scheduler, 0)
    path = Checkpointer(tmp_path).save(1, model, optimizer, scheduler, {"step": 1})
    model2, optimizer2, scheduler2 = build("none", seed=5)
    load_checkpoint(path, model2, optimizer2, scheduler2)
    for (k, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert_bit_exact(b, a, k)
    assert train_step(model2, optimizer2, scheduler2, 1) == train_step(model, optimizer, scheduler, 1)
    shard = next(path.glob("*.distcp"))
    os.truncate(shard, shard.stat().st_size - 1)  # CRC32 is off in shards: sizes still catch this
    assert latest_checkpoint(tmp_path) is None
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(path, *build("none"))
