"""Declared sizes the file does not back (issue 24, class 1): a DCP entry declaring 10¹² elements
over a 10-float blob, a torch.save tensor whose stride-0 or overlapping view spans far more elements
than its storage holds, safetensors headers declaring terabytes. Every path (inspect, inspect
--deep, convert to each format, verify, load_checkpoint) refuses them with one line naming the file
and the entry, before it allocates: under a capped address space too."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import metadata as dcp_md

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hostile as hs  # noqa: E402
import malformed as mf  # noqa: E402
from ckpt_helpers import cli, refused_everywhere  # noqa: E402

from hpc.core.errors import CheckpointError  # noqa: E402
from trainer.checkpoint import Checkpointer, latest_checkpoint, load_checkpoint  # noqa: E402


def small_dcp(tmp_path: Path) -> Path:
    return mf.dcp_save(tmp_path / "c", {"model": {"w": torch.arange(10.0), "b": torch.ones(3)}, "train": {"step": 1}})


def declare(path: Path, key: str, size: list[int], chunks: list[tuple[list[int], list[int]]] | None = None,
            dtype: torch.dtype | None = None) -> Path:
    """Let ``.metadata`` declare ``size`` (and ``chunks``, all pointing at the entry's one blob) for ``key``."""
    def lie(md: dcp_md.Metadata) -> None:
        entry = md.state_dict_metadata[key]
        index, info = mf.record(md, key)
        del md.storage_data[index]
        entry.size = torch.Size(size)
        if dtype is not None:
            entry.properties.dtype = dtype
        boxes = chunks or [([0] * len(size), size)]
        entry.chunks = [dcp_md.ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in boxes]
        for i, (o, _) in enumerate(boxes):
            md.storage_data[dcp_md.MetadataIndex(key, torch.Size(o), 0)] = info if i == 0 else mf.compat.storage_info(
                info.relative_path, info.offset, info.length)

    return mf.edit_metadata(path, lie)


DCP_LIES = {
    "1e12-elements": ([10**12], None, None),
    "2d-1e6-squared": ([10**6, 10**6], None, None),
    "3d": ([10**4, 10**4, 10**4], None, None),
    "512-mib-float32": ([2**27], None, None),
    "float64-over-float32-blob": ([2**24], None, torch.float64),
    "complex128": ([2**20], None, torch.complex128),
    "int64-2-pow-40": ([2**40], None, torch.int64),
}


@pytest.mark.parametrize("case", sorted(DCP_LIES))
def test_a_dcp_entry_declaring_more_than_its_item_holds(tmp_path: Path, case: str) -> None:
    size, chunks, dtype = DCP_LIES[case]
    src = declare(small_dcp(tmp_path), "model.w", size, chunks, dtype)
    refused_everywhere(tmp_path, src, "entry 'model.w' chunk at", "bytes, but its stored item holds")


def test_the_issue_case_refused_by_every_command_under_a_capped_address_space(tmp_path: Path) -> None:
    src = declare(small_dcp(tmp_path), "model.w", [10**12])
    good = mf.dcp_save(tmp_path / "good", {"model": {"w": torch.arange(10.0)}})
    for args in (("inspect", src), ("inspect", src, "--deep"), ("convert", src, tmp_path / "o.pt", "--to", "torch"),
                 ("convert", src, tmp_path / "o.dcp", "--to", "dcp"),
                 ("convert", src, tmp_path / "o.st", "--to", "safetensors"), ("verify", src, good),
                 ("verify", good, src)):
        code, out = hs.limited_cli(*args, limit=2 << 30)
        assert code == 2, (args, out)
        hs.one_error_line(out, "'model.w'", "4000000000000 bytes")
    assert not list(tmp_path.glob("o.*")) and not list(tmp_path.glob(".o.*"))


def test_a_lying_chunk_among_honest_ones(tmp_path: Path) -> None:
    w = torch.arange(24.0).view(4, 6)
    src = mf.sharded_dcp(tmp_path / "s", {"model.w": (w, [((0, 0), (2, 6)), ((2, 0), (2, 6))])})

    def lie(md: dcp_md.Metadata) -> None:  # the second chunk grows to 10^9 rows, the tensor with it
        entry = md.state_dict_metadata["model.w"]
        entry.size = torch.Size([2 + 10**9, 6])
        entry.chunks[1] = dcp_md.ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([10**9, 6]))

    mf.edit_metadata(src, lie)
    refused_everywhere(tmp_path, src, "chunk at [2, 0] declares [1000000000, 6]")


def test_a_stride_zero_blob_behind_a_big_chunk(tmp_path: Path) -> None:
    """The blob itself is a stride-0 view as big as the chunk: its item is small, so refused."""
    src = small_dcp(tmp_path)
    mf.replace_item(src, "model.w", hs.torch_bytes(torch.zeros(1).expand(2**22)))
    declare(src, "model.w", [2**22])
    refused_everywhere(tmp_path, src, "16777216 bytes, but its stored item holds")


def test_load_checkpoint_and_latest_checkpoint_refuse_it(tmp_path: Path) -> None:
    torch.manual_seed(0)
    path = Checkpointer(tmp_path / "run").save(1, nn.Linear(6, 4), None, None, {"step": 1})
    declare(path, "model.bias", [10**12])
    assert latest_checkpoint(tmp_path / "run") is None
    with pytest.raises(CheckpointError, match="model.bias"):
        load_checkpoint(path, nn.Linear(6, 4))


# ---------------------------------------------------------------- torch.save views


def views() -> dict[str, dict[str, torch.Tensor]]:
    base = torch.arange(2**17, dtype=torch.float32)
    return {
        "stride-0-2-pow-38": {"w": torch.zeros(1).as_strided((2**19, 2**19), (0, 0))},
        "expand": {"w": torch.ones(1, 3).expand(2**26, 3)},
        "overlapping-rows": {"w": base.as_strided((2**16, 2**16), (1, 1))},
        "stride-0-inner": {"w": base[:8].as_strided((8, 2**24), (1, 0))},
        "storage-offset-stride-0": {"w": base.as_strided((2**25,), (0,), 2**17 - 1)},
        "int64-expanded": {"w": torch.arange(4).expand(2**24, 4)},
        "bool-expanded": {"w": torch.tensor([True]).expand(2**30)},
        "many-small-adding-up": {f"w{i}": torch.zeros(1).expand(2**20) for i in range(40)},
        "beside-an-honest-tensor": {"ok": torch.arange(5.0), "w": torch.zeros(2).as_strided((2**30,), (0,))},
        "nested-in-optim": {"model": {"ok": torch.ones(2)},
                            "optim": {"state": {"0": {"exp_avg": torch.zeros(1).expand(2**28)}}}},
    }


@pytest.mark.parametrize("case", sorted(views()))
def test_a_torch_view_spanning_more_than_its_storage(tmp_path: Path, case: str) -> None:
    src = tmp_path / "v.pt"
    torch.save(views()[case], src)
    loaded = torch.load(src, weights_only=True)  # torch itself maps them in no time: the views stay views
    assert loaded
    refused_everywhere(tmp_path, src, "v.pt: tensor", "a stride-0 or overlapping view")


def test_a_legacy_file_with_a_stride_zero_view_is_refused_too(tmp_path: Path) -> None:
    src = tmp_path / "old.pt"
    torch.save({"w": torch.zeros(1).expand(2**28)}, src, _use_new_zipfile_serialization=False)
    refused_everywhere(tmp_path, src, "old.pt: tensor 'model.w'", "over a storage record of 4 bytes")


@pytest.mark.parametrize("state", [
    {"expanded-small": torch.arange(3.0).expand(100, 3)},
    {"tied-a": (t := torch.randn(64, 8)), "tied-b": t},
    {"head": (s := torch.arange(20.0))[:4], "tail": s[3:], "every-other": s[::2]},
    {"transposed": torch.randn(5, 7).t(), "scalar": torch.tensor(1.5)},
], ids=["small-expand", "tied", "views-of-one-storage", "transposed"])
def test_honest_views_still_convert_to_what_torch_load_gives(tmp_path: Path, state: dict) -> None:
    src = tmp_path / "ok.pt"
    torch.save(state, src)
    want = torch.load(src, weights_only=True)
    for to, dst in (("torch", "o.pt"), ("dcp", "o.dcp"), ("safetensors", "o.st")):
        code, out = cli("convert", src, tmp_path / dst, "--to", to)
        assert code == 0, out
        code, out = cli("verify", src, tmp_path / dst)
        assert code == 0, out
    got = torch.load(tmp_path / "o.pt", weights_only=True)["model"]
    for key, value in want.items():
        assert torch.equal(got[key], value), key


# ---------------------------------------------------------------- safetensors headers


@pytest.mark.parametrize("header,expect", [
    ({"w": mf.entry("F32", [10**12], [0, 4 * 10**12])}, "past the end of the data"),
    ({"w": mf.entry("F64", [2**31, 2**31], [0, 8 * 2**62])}, "past the end of the data"),
    ({"w": mf.entry("F32", [2**40], [0, 4])}, "span 4"),
    ({"w": mf.entry("U8", [10**18], [0, 10**18])}, "past the end of the data"),
    ({"a": mf.entry("F32", [1], [0, 4]), "w": mf.entry("BF16", [2**33], [4, 4 + 2**34])}, "'w' ends at data byte"),
])
def test_a_safetensors_header_declaring_terabytes(tmp_path: Path, header: dict, expect: str) -> None:
    src = mf.write_st(tmp_path / "x.safetensors", header, b"\0" * 16)
    refused_everywhere(tmp_path, src, expect)


def legacy_lie(tmp_path: Path, numel: int, width: int = 9) -> Path:
    """A legacy (torch < 1.6) file whose main pickle declares ``numel`` elements for the storage of
    ``w`` (10 floats are stored): ``torch.load`` allocates what the pickle declares first."""
    torch.save({"w": torch.arange(10.0), "v": torch.ones(3, dtype=torch.int64)}, tmp_path / "old.pt",
               _use_new_zipfile_serialization=False)
    data = (tmp_path / "old.pt").read_bytes()
    at = data.find(b"X\x03\x00\x00\x00cpuq\x06K\nN")  # BININT1 10, then the view metadata None
    assert at > 0
    long1 = b"\x8a" + bytes([width]) + numel.to_bytes(width, "little", signed=True)
    return hs.write(tmp_path / "lie.pt", data[:at + 10] + long1 + data[at + 12:])


@pytest.mark.parametrize("numel,expect", [
    (10**12, "declares storages of 4000000000024 bytes in all; the file holds"),
    (2**29, "declares storages of 2147483672 bytes"),
    (-5, "declares a storage of -5 elements"),
    (2**62, "bytes in all"),
])
def test_a_legacy_file_declaring_storages_it_does_not_hold(tmp_path: Path, numel: int, expect: str) -> None:
    src = legacy_lie(tmp_path, numel)
    (tmp_path / "old.pt").unlink()
    refused_everywhere(tmp_path, src, "lie.pt", expect)


def test_the_legacy_lie_under_a_capped_address_space(tmp_path: Path) -> None:
    src = legacy_lie(tmp_path, 2**29)  # 2 GiB: overcommit would let torch.load allocate it
    for args in (("inspect", src), ("convert", src, tmp_path / "o.st", "--to", "safetensors")):
        code, out = hs.limited_cli(*args, limit=1536 << 20)
        assert code == 2, out
        hs.one_error_line(out, "2147483672 bytes")


def test_an_honest_legacy_file_still_converts(tmp_path: Path) -> None:
    legacy_lie(tmp_path, 10)  # the same bytes as torch wrote them
    assert cli("convert", tmp_path / "lie.pt", tmp_path / "o.pt", "--to", "torch")[0] == 0
    assert torch.equal(torch.load(tmp_path / "o.pt", weights_only=True)["model"]["w"], torch.arange(10.0))


# ---------------------------------------------------------------- what torch.load would allocate


def lying_archive(obj: dict, numel: int) -> bytes:
    """``torch.save(obj)`` (one float32 tensor of 10 elements inside) whose data.pkl declares
    ``numel`` elements for that storage; the record still holds 40 bytes."""
    import zipfile

    data = hs.torch_bytes(obj)
    with zipfile.ZipFile(hs.io.BytesIO(data)) as z:
        pkl, record = z.read("archive/data.pkl"), z.read("archive/data/0")
    at = pkl.find(b"K\n", pkl.find(b"cpu"))  # BININT1 10: the storage's numel
    lie = pkl[:at] + b"\x8a\x09" + numel.to_bytes(9, "little", signed=True) + pkl[at + 2:]
    return hs.torch_archive(lie, {"0": record})


@pytest.mark.parametrize("numel", [10**12, 2**29, -1])
def test_a_dcp_object_item_whose_pickle_declares_more_than_its_record(tmp_path: Path, numel: int) -> None:
    src = mf.dcp_save(tmp_path / "c", {"model": {"w": torch.ones(2)}, "train": {"step": 1, "extra": [0]}})
    mf.replace_item(src, "train.extra", lying_archive({"t": torch.arange(10.0)}, numel))
    expect = ("holds 40 bytes", str(4 * numel)) if numel > 0 else ()
    refused_everywhere(tmp_path, src, "item 'train.extra'", *expect)
    if numel == 2**29:
        code, out = hs.limited_cli("convert", src, tmp_path / "o.pt", "--to", "torch", limit=1536 << 20)
        assert code == 2, out
        hs.one_error_line(out, "data.pkl declares 2147483648; refused before torch.load allocates them")


def test_a_torch_file_left_to_torch_load_whose_pickle_declares_more_than_its_record(tmp_path: Path) -> None:
    """torch.device is on torch's own list, not hpcx's: the file goes to torch.load, checked first."""
    src = hs.write(tmp_path / "d.pt", lying_archive({"t": torch.arange(10.0), "dev": torch.device("cpu")}, 2**29))
    refused_everywhere(tmp_path, src, "d.pt: record archive/data/0 holds 40 bytes; data.pkl declares 2147483648")


def test_safetensors_stored_objects_whose_pickle_declares_more_than_its_record(tmp_path: Path) -> None:
    import base64

    blob = lying_archive({"train.t": torch.arange(10.0)}, 2**29)
    src = mf.valid_st(tmp_path / "x.safetensors", {"w": torch.ones(2)},
                      {"hpcx.layout": "full", "hpcx.objects": base64.b64encode(blob).decode()})
    refused_everywhere(tmp_path, src, "hpcx.objects: record archive/data/0 holds 40 bytes")


# ---------------------------------------------------------------- sparse and quantized (torch.load's layouts)


def test_a_sparse_tensor_of_a_terabyte_is_refused_and_a_small_one_converts_dense(tmp_path: Path) -> None:
    torch.save({"s": torch.sparse_coo_tensor([[0]], [1.0], (10**12,))}, tmp_path / "big.pt")
    refused_everywhere(tmp_path, tmp_path / "big.pt", "big.pt: tensor 'model.s' is a sparse_coo tensor of shape",
                       "only its stored values and indices")
    (tmp_path / "big.pt").unlink()
    small = torch.sparse_coo_tensor([[0, 3]], [1.0, 2.0], (5,))
    torch.save({"s": small}, tmp_path / "sp.pt")
    for to, dst in (("torch", "o.pt"), ("dcp", "o.dcp"), ("safetensors", "o.st")):
        assert cli("convert", tmp_path / "sp.pt", tmp_path / dst, "--to", to)[0] == 0
        code, out = cli("verify", tmp_path / "sp.pt", tmp_path / dst)
        assert code == 0, out
    assert torch.equal(torch.load(tmp_path / "o.pt", weights_only=True)["model"]["s"], small.to_dense())


def test_a_quantized_tensor_is_one_line(tmp_path: Path) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)
    torch.save({"q": q}, tmp_path / "q.pt")
    refused_everywhere(tmp_path, tmp_path / "q.pt", "tensor 'model.q' is quantized (torch.qint8)")


def test_a_tensor_the_file_holds_but_memory_cannot_is_one_line(tmp_path: Path) -> None:
    """A sparse file of a terabyte backs its header by size; allocating it fails: one line, not a traceback."""
    import json
    import struct

    n = 2**38
    raw = json.dumps({"w": {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]}}).encode()
    raw += b" " * (-len(raw) % 8)
    src = tmp_path / "huge.safetensors"
    with open(src, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + 4 * n)  # a hole: no block is written
    assert cli("inspect", src)[0] == 0  # the structure is honest
    before = sorted(p.name for p in tmp_path.iterdir())
    for args in (("inspect", src, "--deep"), ("convert", src, tmp_path / "o.pt", "--to", "torch"),
                 ("convert", src, tmp_path / "o.dcp", "--to", "dcp"), ("verify", src, src)):
        code, out = hs.limited_cli(*args, limit=2 << 30)  # fails to allocate whatever the overcommit policy
        assert code == 2, out
        hs.one_error_line(out, "huge.safetensors: tensor 'model.w': cannot allocate the 1099511627776 bytes")
    assert sorted(p.name for p in tmp_path.iterdir()) == before
