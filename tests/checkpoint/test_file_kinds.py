"""Messages and exit codes (issue 24, class 5): a FIFO, ``/dev/zero``, a device, a socket, a folder or
a dangling symlink where a checkpoint, a shard, ``.metadata``, an index or a digest should be is
reported as what it is and never read (a FIFO would block forever, ``/dev/zero`` never ends);
``verify`` of a torn checkpoint exits 2 naming the torn item however many other entries differ;
``--to dcp --model-only`` writes the model's entries under their ``model.`` keys."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import malformed as mf  # noqa: E402
from ckpt_helpers import assert_refused, cli  # noqa: E402

from hpc.ckpt.files import file_kind, relative_name_problem  # noqa: E402
from trainer.checkpoint import load_checkpoint  # noqa: E402


@pytest.fixture(autouse=True)
def never_blocks():
    """A reader that opens a FIFO for reading would block forever: fail the test after 60 s instead."""
    def expired(signum, frame):
        raise TimeoutError("blocked: a FIFO or a device was read")

    before = signal.signal(signal.SIGALRM, expired)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, before)


def make(kind: str, path: Path) -> str:
    """Put a ``kind`` at ``path``; the words the message must use."""
    if kind == "fifo":
        os.mkfifo(path)
        return "is a FIFO (named pipe)"
    if kind == "dev-zero":
        path.symlink_to("/dev/zero")
        return "is a character device"
    if kind == "dev-null":
        path.symlink_to("/dev/null")
        return "is a character device"
    if kind == "folder":
        path.mkdir()
        return "is a folder"
    if kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        s.close()
        return "is a socket"
    if kind == "dangling":
        path.symlink_to(path.parent / "no-such-target")
        return "a dangling symlink"
    raise ValueError(kind)


KINDS = ["fifo", "dev-zero", "dev-null", "folder", "socket", "dangling"]


def short_tmp(tmp_path: Path) -> Path:
    """A folder with a short path (AF_UNIX socket paths are limited to ~108 bytes)."""
    import tempfile

    return Path(tempfile.mkdtemp(prefix="k", dir="/tmp"))


@pytest.fixture
def tmp(tmp_path: Path):
    folder = short_tmp(tmp_path)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "folder"])
@pytest.mark.parametrize("suffix", [".pt", ".safetensors", ""])
def test_the_checkpoint_path_itself(tmp: Path, kind: str, suffix: str) -> None:
    src = tmp / f"x{suffix}"
    words = make(kind, src)
    if kind == "dangling":
        words = "no such file or folder"
    good = mf.valid_st(tmp / "g.safetensors", {"w": torch.ones(2)})
    assert_refused(("inspect", src), str(src), words)
    assert_refused(("convert", src, tmp / "o.pt", "--to", "torch"), words)
    assert_refused(("verify", good, src), words)
    assert not (tmp / "o.pt").exists()


@pytest.mark.parametrize("kind", KINDS)
def test_a_dcp_shard(tmp: Path, kind: str) -> None:
    src = mf.dcp_save(tmp / "c", {"model": {"w": torch.ones(4)}})
    shard = src / "__0_0.distcp"
    shard.unlink()
    words = make(kind, shard)
    for args in (("inspect", src), ("inspect", src, "--deep"), ("convert", src, tmp / "o.pt", "--to", "torch"),
                 ("verify", src, src)):
        out = assert_refused(args, str(shard), words, "expected a shard file of at least")
        assert "missing" not in out or kind == "dangling", out


def test_a_missing_shard_is_still_called_missing(tmp: Path) -> None:
    src = mf.dcp_save(tmp / "c", {"model": {"w": torch.ones(4)}})
    (src / "__0_0.distcp").unlink()
    assert_refused(("inspect", src), "__0_0.distcp: missing; expected a shard file of at least")


@pytest.mark.parametrize("kind", KINDS)
def test_dcp_metadata(tmp: Path, kind: str) -> None:
    src = mf.dcp_save(tmp / "c", {"model": {"w": torch.ones(4)}})
    (src / ".metadata").unlink()
    words = make(kind, src / ".metadata")
    assert_refused(("inspect", src), ".metadata", words)
    assert_refused(("convert", src, tmp / "o.st", "--to", "safetensors"), words)


@pytest.mark.parametrize("kind", KINDS)
def test_a_digest_sidecar(tmp: Path, kind: str) -> None:
    src = mf.dcp_save(tmp / "c", {"model": {"w": torch.ones(4)}})
    words = make(kind, src / "__0_0.distcp.sha256")
    if kind == "dangling":
        assert cli("inspect", src)[0] == 2
        return
    assert_refused(("inspect", src, "--deep"), "__0_0.distcp.sha256", words, "expected a sha256sum line")
    assert_refused(("verify", src, src), words)


@pytest.mark.parametrize("kind", KINDS)
def test_a_safetensors_shard_the_index_lists(tmp: Path, kind: str) -> None:
    src = mf.st_index(tmp / "st", {"a": "s1.safetensors", "b": "s2.safetensors"},
                      {"s1.safetensors": {"a": torch.ones(2)}})
    words = make(kind, src / "s2.safetensors")
    out = assert_refused(("inspect", src), "s2.safetensors", words, "index.json lists it")
    assert "missing" not in out or kind == "dangling"
    assert_refused(("convert", src, tmp / "o.pt", "--to", "torch"), words)


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "folder", "socket"])
def test_the_index_itself_and_a_lone_shard(tmp: Path, kind: str) -> None:
    src = tmp / "st"
    src.mkdir()
    mf.valid_st(src / "s1.safetensors", {"a": torch.ones(2)})
    words = make(kind, src / "model.safetensors.index.json")
    assert_refused(("inspect", src), "model.safetensors.index.json", words)
    lone = tmp / "lone"
    lone.mkdir()
    words = make(kind, lone / "x.safetensors")
    assert_refused(("inspect", lone), "x.safetensors", words)


def test_a_symlink_to_a_regular_shard_is_read(tmp: Path) -> None:
    """HF's cache links every snapshot file to a blob outside the folder: that is fine."""
    src = mf.dcp_save(tmp / "c", {"model": {"w": torch.arange(4.0)}})
    (tmp / "blobs").mkdir()
    shutil.move(src / "__0_0.distcp", tmp / "blobs" / "b1")
    (src / "__0_0.distcp").symlink_to(tmp / "blobs" / "b1")
    assert cli("inspect", src, "--deep")[0] == 0
    assert file_kind(src / "__0_0.distcp") is None


@pytest.mark.parametrize("name,why", [
    ("a.distcp", None), ("sub/a.distcp", None), ("./a", None), ("a/./b", None), ("../a", "points outside the folder"),
    ("/abs", "points outside the folder"), ("a/../../b", "points outside the folder"), ("", "is not a file name"),
    (".", "is not a file name"), ("a\0b", "is not a file name"), ("sub/", "names a folder, not a file"),
    (3, "is int, not a file name"),
])
def test_relative_names(name: object, why: str | None) -> None:
    assert relative_name_problem(name) == why


def test_a_dcp_storage_record_in_a_subfolder_is_read(tmp: Path) -> None:
    src = mf.dcp_save(tmp / "c", {"model": {"w": torch.arange(4.0)}})
    (src / "sub").mkdir()
    shutil.move(src / "__0_0.distcp", src / "sub" / "__0_0.distcp")

    def move(md) -> None:
        for index, info in list(md.storage_data.items()):
            md.storage_data[index] = mf.compat.storage_info("sub/__0_0.distcp", info.offset, info.length)

    mf.edit_metadata(src, move)
    assert cli("inspect", src, "--deep")[0] == 0
    assert cli("convert", src, tmp / "o.pt", "--to", "torch")[0] == 0
    assert torch.equal(torch.load(tmp / "o.pt", weights_only=True)["model"]["w"], torch.arange(4.0))


# ---------------------------------------------------------------- verify: torn beats different


def many(n: int, offset: float = 0.0) -> dict:
    return {"model": {f"t{i:02d}": torch.full((8,), float(i) + offset) for i in range(n)}, "train": {"step": 1}}


@pytest.mark.parametrize("what", ["local-header", "pickle", "end-record", "central-entry"])
def test_verify_of_a_torn_checkpoint_exits_2_past_ten_differences(tmp: Path, what: str) -> None:
    good = mf.dcp_save(tmp / "good", many(15))
    torn = mf.dcp_save(tmp / "torn", many(15, offset=0.5))  # every entry differs
    file, offset, length = mf.item_bytes(torn, "model.t14")  # the last one in key order
    mf.damage_item(file, offset, length, what)
    for a, b in ((good, torn), (torn, good)):
        out = assert_refused(("verify", a, b), "item 'model.t14'")
        assert "differ" not in out


def test_verify_reads_every_entry_and_counts_every_difference(tmp: Path) -> None:
    a = mf.valid_st(tmp / "a.safetensors", {f"t{i:02d}": torch.full((4,), float(i)) for i in range(13)})
    b = mf.valid_st(tmp / "b.safetensors", {f"t{i:02d}": torch.full((4,), i + 0.5) for i in range(13)})
    code, out = cli("verify", a, b)
    assert code == 1 and "differ (first 10 of 13 shown):" in out, out
    result = json.loads(cli("verify", a, b, "--json")[1])
    assert result["more"] and result["total_differences"] == 13 and len(result["differences"]) == 10


def test_verify_of_a_torn_torch_file_against_a_good_one(tmp: Path) -> None:
    torch.save(many(15)["model"], tmp / "good.pt")
    torch.save(many(15, 0.5)["model"], tmp / "torn.pt")
    data = (tmp / "torn.pt").read_bytes()
    (tmp / "torn.pt").write_bytes(data[: len(data) - 200])
    assert_refused(("verify", tmp / "good.pt", tmp / "torn.pt"), "torn.pt")


# ---------------------------------------------------------------- --to dcp --model-only


def test_to_dcp_model_only_writes_model_keys_that_load_checkpoint_reads(tmp: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    state = {"model": model.state_dict(), "optim": {"param_groups": [{"lr": 0.1, "params": [0, 1]}]},
             "train": {"step": 5}}
    torch.save(state, tmp / "full.pt")
    assert cli("convert", tmp / "full.pt", tmp / "m.dcp", "--to", "dcp", "--model-only")[0] == 0
    info = json.loads(cli("inspect", tmp / "m.dcp", "--json")[1])
    assert sorted(t["key"] for t in info["tensors"]) == ["model.bias", "model.weight"] and info["objects"] == []
    fresh = nn.Linear(4, 3)
    load_checkpoint(tmp / "m.dcp", fresh, restore_rng=False)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    code, help_text = cli("convert", "--help")
    assert "under their model. keys" in " ".join(help_text.split())
    doc = (Path(__file__).resolve().parents[2] / "docs" / "checkpoints.md").read_text()
    assert "--to dcp --model-only" in doc


def test_verify_of_a_truncated_shard_names_the_items_cut_off(tmp: Path) -> None:
    good = mf.dcp_save(tmp / "good", many(15))
    torn = mf.dcp_save(tmp / "torn", many(15, offset=0.5))
    file, offset, _ = mf.item_bytes(torn, "model.t14")
    mf.truncate(file, offset + 10)
    out = assert_refused(("verify", good, torn), "truncated to", "past the end")
    assert "'model.t14'" in out or "more past the end" in out, out
