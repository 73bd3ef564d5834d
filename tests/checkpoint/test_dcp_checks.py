"""DCP folders whose .metadata lies (about blobs, chunks, storage records) or whose shards are damaged
at the same length: refused with one line per problem by inspect, convert, verify, and by
``load_checkpoint`` as a CheckpointError (never DCP's CheckpointException), never trusted by
``latest_checkpoint`` when the metadata alone shows it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import metadata as dcp_md

sys.path.insert(0, str(Path(__file__).resolve().parent))
import malformed as mf  # noqa: E402
from ckpt_helpers import cli, refused_everywhere  # noqa: E402

from hpc import compat  # noqa: E402
from hpc.ckpt.dcp import DcpReader, dcp_problems  # noqa: E402
from hpc.core.errors import CheckpointError  # noqa: E402
from trainer.checkpoint import Checkpointer, latest_checkpoint, load_checkpoint  # noqa: E402

W = torch.arange(24, dtype=torch.float32).view(4, 6)


def state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"model": {"w": W.clone(), "b": torch.randn(6, generator=g), "e": torch.randn(3, generator=g)},
            "train": {"step": 3}}


def md_of(path: Path) -> dcp_md.Metadata:
    return mf.read_metadata(path)


# ---------------------------------------------------------------- blobs that are not what the chunk says


def test_a_record_pointing_at_a_blob_of_another_shape(tmp_path: Path) -> None:
    src = mf.dcp_save(tmp_path / "c", state())
    file, offset, length = mf.item_bytes(src, "model.b")
    mf.replace_item(src, "model.w", file.read_bytes()[offset:offset + length])  # a copy of b's blob
    refused_everywhere(tmp_path, src, "item 'model.w' at byte", "chunk at [0, 0] holds float32[6], .metadata says float32[4, 6]")
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with pytest.raises(CheckpointException):  # stock torch refuses it too (with a traceback per rank)
        dcp_to_torch_save(src, tmp_path / "stock.pt")

    def share(md: dcp_md.Metadata) -> None:  # pointing at b's own bytes: two items share them
        md.storage_data[mf.record(md, "model.w")[0]] = mf.record(md, "model.b")[1]

    refused_everywhere(tmp_path, mf.edit_metadata(src, share), "items 'model.b' and 'model.w' overlap")


@pytest.mark.parametrize("blob,expect", [
    (torch.arange(24, dtype=torch.float64).view(4, 6), "holds float64[4, 6], .metadata says float32[4, 6]"),
    (torch.arange(24, dtype=torch.float32).view(6, 4), "holds float32[6, 4]"),
    (torch.arange(25, dtype=torch.float32), "holds float32[25]"),
    (torch.zeros(0), "holds float32[0]"),
    ({"a": torch.ones(1)}, "holds a dict, .metadata says a tensor"),
    ([1, 2], "holds a list"),
    (3.0, "holds a float"),
])
def test_a_blob_that_is_not_its_chunk(tmp_path: Path, blob: object, expect: str) -> None:
    import io

    src = mf.dcp_save(tmp_path / "c", state())
    buf = io.BytesIO()
    torch.save(blob, buf)
    mf.replace_item(src, "model.w", buf.getvalue())
    refused_everywhere(tmp_path, src, expect)


# ---------------------------------------------------------------- chunks


def sharded(tmp_path: Path, chunks: list[tuple[tuple, tuple]], name: str = "c") -> Path:
    return mf.sharded_dcp(tmp_path / name, {"model.w": (W, chunks)}, {"train.step": 3})


def test_valid_chunk_grids_convert_bit_exact(tmp_path: Path) -> None:
    grids = {
        "rows": [((0, 0), (2, 6)), ((2, 0), (2, 6))],
        "cols": [((0, 0), (4, 3)), ((0, 3), (4, 3))],
        "2x2": [((0, 0), (2, 3)), ((0, 3), (2, 3)), ((2, 0), (2, 3)), ((2, 3), (2, 3))],
        "uneven": [((0, 0), (1, 6)), ((1, 0), (3, 2)), ((1, 2), (3, 4))],
        "with-empty-chunk": [((0, 0), (4, 6)), ((4, 0), (0, 6))],
    }
    for name, chunks in grids.items():
        src = sharded(tmp_path, chunks, name)
        assert dcp_problems(src) == [], name
        out = tmp_path / f"{name}.pt"
        assert cli("convert", src, out, "--to", "torch")[0] == 0, name
        assert torch.equal(torch.load(out, weights_only=True)["model"]["w"], W), name
        assert cli("inspect", src)[0] == 0


CHUNK_LIES = {
    "missing-half": ([((0, 0), (2, 6))], "chunks hold 12 of its 24 elements"),
    "overlapping": ([((0, 0), (3, 6)), ((1, 0), (3, 6))], "chunks overlap at element at index [1, 0]"),
    "same-volume-hole": ([((0, 0), (2, 6)), ((0, 0), (2, 6))], "no chunk holds the element at index [2, 0]"),
    "hole-in-2d": ([((0, 0), (2, 3)), ((0, 3), (2, 3)), ((2, 0), (2, 3)), ((2, 0), (2, 3))],
                   "no chunk holds the element at index [2, 3]"),
    "outside": ([((0, 0), (4, 6)), ((3, 0), (2, 6))], "reaching outside its size [4, 6]"),
    "wrong-rank": ([((0,), (24,))], "expected 2 non-negative offsets and sizes"),
}


@pytest.mark.parametrize("case", sorted(CHUNK_LIES))
def test_chunks_that_do_not_tile_the_tensor(tmp_path: Path, case: str) -> None:
    chunks, expect = CHUNK_LIES[case]
    full = sharded(tmp_path, [((0, 0), (4, 6))], "full")

    def lie(md: dcp_md.Metadata) -> None:  # the blob stays; the chunk list and records lie
        _, info = mf.record(md, "model.w")
        md.state_dict_metadata["model.w"].chunks = [dcp_md.ChunkStorageMetadata(torch.Size(o), torch.Size(s))
                                                    for o, s in chunks]
        md.storage_data = {i: v for i, v in md.storage_data.items() if i.fqn != "model.w"}
        for o, _ in chunks:
            md.storage_data[dcp_md.MetadataIndex("model.w", torch.Size(o), 0)] = info

    src = mf.edit_metadata(full, lie)
    refused_everywhere(tmp_path, src, expect)


ENTRY_LIES = {
    "negative-size": (lambda md: setattr(md.state_dict_metadata["model.w"], "size", torch.Size([-4, 6])),
                      "has size"),
    "dtype-a-string": (lambda md: setattr(md.state_dict_metadata["model.w"].properties, "dtype", "float32"),
                       "has dtype 'float32', expected a torch dtype"),
    "entry-a-number": (lambda md: md.state_dict_metadata.__setitem__("model.w", 5),
                       "entry 'model.w' is a int"),
    "no-chunks": (lambda md: setattr(md.state_dict_metadata["model.w"], "chunks", []), "has no chunks"),
    "chunk-negative": (lambda md: setattr(md.state_dict_metadata["model.w"], "chunks",
                                          [dcp_md.ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([-4, 6]))]),
                       "non-negative offsets and sizes"),
    "no-record-for-chunk": (lambda md: md.storage_data.pop(mf.record(md, "model.w")[0]),
                            "no storage record for 'model.w' chunk at [0, 0]"),
    "no-record-for-object": (lambda md: md.storage_data.pop(mf.record(md, "train.step")[0]),
                             "no storage record for 'train.step'"),
    "traversal": (lambda md: md.storage_data.__setitem__(mf.record(md, "model.w")[0], compat.storage_info(
        "../__0_0.distcp", 0, 10)), "points outside the folder ('../__0_0.distcp')"),
    "absolute-path": (lambda md: md.storage_data.__setitem__(mf.record(md, "model.w")[0], compat.storage_info(
        "/etc/passwd", 0, 10)), "points outside the folder"),
    "negative-offset": (lambda md: md.storage_data.__setitem__(mf.record(md, "model.w")[0], compat.storage_info(
        "__0_0.distcp", -8, 10)), "offset=-8"),
    "length-a-string": (lambda md: md.storage_data.__setitem__(mf.record(md, "model.w")[0], compat.storage_info(
        "__0_0.distcp", 0, "10")), "length='10'"),
    "past-the-end": (lambda md: md.storage_data.__setitem__(mf.record(md, "model.w")[0], compat.storage_info(
        "__0_0.distcp", 0, 10**9)), "expects at least 1000000000"),
    "overlapping-items": (lambda md: md.storage_data.__setitem__(mf.record(md, "model.b")[0], compat.storage_info(
        "__0_0.distcp", mf.record(md, "model.w")[1].offset + 8, mf.record(md, "model.b")[1].length)), "overlap at bytes"),
    "record-key-a-string": (lambda md: md.storage_data.__setitem__("model.w", mf.record(md, "model.w")[1]),
                            "storage record key 'model.w' is not a MetadataIndex"),
    "transforms": (lambda md: setattr(mf.record(md, "model.w")[1], "transform_descriptors", ["gzip"]),
                   "uses stream transforms"),
    "planner-data-negative-index": (lambda md: setattr(md, "planner_data", {"model.w": ["model", -1]}),
                                    "planner_data: object path of 'model.w'"),
    "planner-data-a-list": (lambda md: setattr(md, "planner_data", [1]), "expected a mapping"),
    "storage-data-missing": (lambda md: setattr(md, "storage_data", None), "has no storage index"),
}


@pytest.mark.parametrize("case", sorted(ENTRY_LIES))
def test_metadata_that_lies(tmp_path: Path, case: str) -> None:
    edit, expect = ENTRY_LIES[case]
    src = mf.edit_metadata(mf.dcp_save(tmp_path / "c", state()), edit)
    refused_everywhere(tmp_path, src, ".metadata" if case not in ("past-the-end", "overlapping-items") else "distcp",
                       expect)


# ---------------------------------------------------------------- damaged at the same length


@pytest.mark.parametrize("what,expect", [
    ("end-record", "not a complete torch.save zip"),
    ("central-entry", "not a complete torch.save zip"),
    ("local-header", "has no local header"),
    ("pickle", "unreadable data.pkl"),
])
def test_a_shard_damaged_at_the_same_length_is_refused_by_inspect(tmp_path: Path, what: str, expect: str) -> None:
    src = mf.dcp_save(tmp_path / "c", state())
    file, offset, length = mf.item_bytes(src, "model.w")
    size = file.stat().st_size
    mf.damage_item(file, offset, length, what)
    assert file.stat().st_size == size and dcp_problems(src) == []  # the size checks cannot see it
    refused_everywhere(tmp_path, src, "item 'model.w' at byte", expect)


# ---------------------------------------------------------------- the trainer's loader


def linear_checkpoint(tmp_path: Path) -> tuple[Path, nn.Module]:
    torch.manual_seed(0)
    model = nn.Linear(6, 4)
    return Checkpointer(tmp_path / "run").save(1, model, None, None, {"step": 1}), model


def test_load_checkpoint_refuses_a_planted_blob_with_the_user_error(tmp_path: Path) -> None:
    path, model = linear_checkpoint(tmp_path)
    marker = tmp_path / "pwned"
    mf.replace_item(path, "model.weight", mf.planted_torch_blob(marker, {"w": torch.zeros(4, 6)}))
    with pytest.raises(CheckpointError, match="refused a stored object"):
        load_checkpoint(path, nn.Linear(6, 4))
    assert not marker.exists()


def test_load_checkpoint_refuses_a_planted_object_item(tmp_path: Path) -> None:
    path, _ = linear_checkpoint(tmp_path)
    marker = tmp_path / "pwned"
    mf.replace_item(path, "train.step", mf.planted_torch_blob(marker, {"w": 1}))
    with pytest.raises(CheckpointError, match="refused a stored object"):
        load_checkpoint(path, nn.Linear(6, 4))
    assert not marker.exists()


@pytest.mark.parametrize("blob", [torch.zeros(4, 7), torch.zeros(4, 6, dtype=torch.float64), torch.zeros(24)])
def test_load_checkpoint_refuses_a_blob_that_is_not_its_chunk(tmp_path: Path, blob: torch.Tensor) -> None:
    import io

    path, _ = linear_checkpoint(tmp_path)
    buf = io.BytesIO()
    torch.save(blob, buf)
    mf.replace_item(path, "model.weight", buf.getvalue())
    with pytest.raises(CheckpointError, match="model.weight"):
        load_checkpoint(path, nn.Linear(6, 4))


@pytest.mark.parametrize("case", ["missing-half", "overlapping", "outside"])
def test_latest_checkpoint_never_trusts_lying_chunks(tmp_path: Path, case: str) -> None:
    path, _ = linear_checkpoint(tmp_path)
    chunks = CHUNK_LIES[case][0]  # nn.Linear(6, 4).weight has W's shape

    def lie(md: dcp_md.Metadata) -> None:
        _, info = mf.record(md, "model.weight")
        md.state_dict_metadata["model.weight"].chunks = [
            dcp_md.ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks]
        for o, _ in chunks:
            md.storage_data[dcp_md.MetadataIndex("model.weight", torch.Size(o), 0)] = info

    mf.edit_metadata(path, lie)
    assert latest_checkpoint(tmp_path / "run") is None
    with pytest.raises(CheckpointError, match="model.weight"):
        load_checkpoint(path, nn.Linear(6, 4))


def test_check_items_reads_no_tensor_data(tmp_path: Path) -> None:
    """inspect's structural pass must stay cheap: it never reads a tensor record's bytes."""
    src = mf.dcp_save(tmp_path / "c", {"model": {"w": torch.randn(512, 512)}})  # 1 MiB of data

    def read_bytes() -> int:
        return next(int(line.split()[1]) for line in open("/proc/self/io") if line.startswith("rchar"))

    reader = DcpReader(src)
    try:
        before = read_bytes()
        assert reader.check_items() == 1
        assert read_bytes() - before < 64 * 1024  # zip directories and pickles only
    finally:
        reader.close()
