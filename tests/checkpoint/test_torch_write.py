"""The streaming ``torch.save`` writer: what it writes is what torch.save writes, for every dtype, and
hpcx's outputs are read by torch's own loaders (torch.load, dcp.load, dcp_to_torch_save, zipfile)."""

from __future__ import annotations

import io
import sys
import zipfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import malformed as mf  # noqa: E402
from ckpt_helpers import cli  # noqa: E402

from hpc.ckpt.entries import Scratch  # noqa: E402
from hpc.ckpt.torch_write import Sink, Stored, TorchWriter  # noqa: E402

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool, torch.uint16, torch.uint32, torch.uint64, torch.complex64,
          torch.float8_e4m3fn, torch.float8_e5m2]


def sample(dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    g = torch.Generator().manual_seed(len(shape))
    top = 2 if dtype == torch.bool else 256  # a bool byte is 0 or 1
    raw = torch.randint(0, top, (max(1, torch.Size(shape).numel() * dtype.itemsize),), dtype=torch.uint8, generator=g)
    return raw[:torch.Size(shape).numel() * dtype.itemsize].view(dtype).view(shape) if torch.Size(shape).numel() \
        else torch.empty(shape, dtype=dtype)


def stream(layout: object, tensors: dict[str, torch.Tensor], crc32: bool | None = None) -> bytes:
    buf = io.BytesIO()
    writer = TorchWriter(buf, layout, crc32=crc32)
    writer.write_storages(lambda stored, out: out.copy_(tensors[stored.key]), Scratch())
    writer.finish()
    return buf.getvalue()


def layout_of(obj: object) -> object:
    if isinstance(obj, dict):
        return {k: layout_of(v) for k, v in obj.items()}
    if isinstance(obj, torch.Tensor):
        return Stored(f"k{id(obj)}", obj.dtype, tuple(obj.shape))
    return obj


def keyed(obj: object, out: dict) -> dict:
    if isinstance(obj, dict):
        for v in obj.values():
            keyed(v, out)
    elif isinstance(obj, torch.Tensor):
        out[f"k{id(obj)}"] = obj
    return out


@pytest.mark.parametrize("shape", [(3, 5), (), (0, 4), (7,), (2, 1, 3)])
def test_every_dtype_round_trips_through_torch_load(shape: tuple) -> None:
    state = {"model": {str(d).removeprefix("torch."): sample(d, shape) for d in DTYPES}, "lr": 0.1, "name": "x",
             "betas": (0.9, 0.95), "steps": [1, 2]}
    got = torch.load(io.BytesIO(stream(layout_of(state), keyed(state, {}))), weights_only=True)
    assert {k: v for k, v in got.items() if k != "model"} == {k: v for k, v in state.items() if k != "model"}
    for name, want in state["model"].items():
        have = got["model"][name]
        assert (have.dtype, have.shape, have.stride()) == (want.dtype, want.shape, want.contiguous().stride()), name
        assert torch.equal(have.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), name


def test_the_archive_holds_the_records_torch_save_writes_with_valid_crcs() -> None:
    state = {"a": torch.randn(4, 4), "b": torch.arange(5)}
    ours, theirs = io.BytesIO(stream(layout_of(state), keyed(state, {}), crc32=True)), io.BytesIO()
    torch.save(state, theirs)
    names = lambda b: [i.filename for i in zipfile.ZipFile(b).infolist()]  # noqa: E731
    assert names(ours) == names(theirs)
    assert zipfile.ZipFile(ours).testzip() is None  # every CRC32 checks out


def test_tensors_inside_objects_are_written_from_memory() -> None:
    inner = torch.arange(6.0).view(2, 3)
    layout = {"w": Stored("w", torch.float32, (2,)), "obj": {"t": inner, "n": 3}, "t": (inner[0], 1)}
    got = torch.load(io.BytesIO(stream(layout, {"w": torch.ones(2)})), weights_only=True)
    assert torch.equal(got["obj"]["t"], inner) and torch.equal(got["t"][0], inner[0]) and got["obj"]["n"] == 3


def test_a_failing_write_raises_in_python_and_never_aborts_the_process() -> None:
    class Full(io.BytesIO):
        def write(self, data):  # noqa: ANN001
            if self.tell() > 1000:
                raise OSError(28, "No space left on device")
            return super().write(data)

    with pytest.raises(OSError, match="No space left"):
        w = TorchWriter(Full(), {"w": Stored("w", torch.float32, (1000,))})
        w.write_storages(lambda stored, out: out.fill_(1), Scratch())
    del w  # its destructor writes the end records into the failed sink: swallowed, no abort
    sink = Sink(Full())
    sink.write(b"x" * 2000)
    assert sink.write(b"y" * 10) == 10  # fails inside, swallowed: torch's C++ writer must not see it
    sink.write(b"z")
    with pytest.raises(OSError):
        sink.check()


def test_hpcx_outputs_are_read_by_torchs_own_loaders(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    state = {"model": {"w": torch.randn(8, 4), "b": torch.randn(4).bfloat16()}, "train": {"step": 7}}
    src = mf.dcp_save(tmp_path / "src", state)
    assert cli("convert", src, tmp_path / "o.pt", "--to", "torch")[0] == 0
    assert cli("convert", tmp_path / "o.pt", tmp_path / "o.dcp", "--to", "dcp")[0] == 0
    loaded = torch.load(tmp_path / "o.pt", weights_only=True)
    assert torch.equal(loaded["model"]["w"], state["model"]["w"]) and loaded["train"] == {"step": 7}
    assert zipfile.ZipFile(tmp_path / "o.pt").testzip() is None
    dcp_to_torch_save(tmp_path / "o.dcp", tmp_path / "stock.pt")
    assert torch.equal(torch.load(tmp_path / "stock.pt", weights_only=True)["model"]["b"], state["model"]["b"])
    target = {"model": {"w": torch.zeros(8, 4), "b": torch.zeros(4).bfloat16()}, "train": {"step": 0}}
    dcp.load(target, checkpoint_id=tmp_path / "o.dcp", no_dist=True)
    assert torch.equal(target["model"]["w"], state["model"]["w"]) and target["train"]["step"] == 7
