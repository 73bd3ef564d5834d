"""Zip records that are not stored as is (issue 24, class 3): a ``.pt`` (or a DCP item) re-zipped
with deflate is read right, a chunk at a time, with its size and CRC-32 checked; bzip2, lzma, other
methods, encryption, a forged CRC or size, a local header that disagrees with the directory are one
line each. Never wrong bytes: ``torch.load(mmap=True)`` maps the compressed bytes as tensor data,
``torch.load`` without mmap inflates them; hpcx agrees with the latter or refuses."""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hostile as hs  # noqa: E402
import malformed as mf  # noqa: E402
from ckpt_helpers import cli, refused_everywhere  # noqa: E402

from hpc.ckpt.torchsave import TorchReader  # noqa: E402


def state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(64, 32, generator=g), "b": torch.arange(100.0), "z": torch.zeros(5000),
                      "half": torch.randn(7, generator=g).half(), "i": torch.arange(-3, 9)},
            "optim": {"param_groups": [{"lr": 0.1, "params": [0]}]}, "train": {"step": 4}}


def good(tmp_path: Path) -> Path:
    torch.save(state(), tmp_path / "good.pt")
    return tmp_path / "good.pt"


SCHEMES = {
    "all-deflated": zipfile.ZIP_DEFLATED,
    "deflated-level-1": zipfile.ZIP_DEFLATED,
    "deflated-level-9": zipfile.ZIP_DEFLATED,
    "only-data-deflated": {"/data/0": zipfile.ZIP_DEFLATED, "/data/1": zipfile.ZIP_DEFLATED,
                           "/data/2": zipfile.ZIP_DEFLATED},
    "only-pickle-deflated": {"data.pkl": zipfile.ZIP_DEFLATED},
    "only-byteorder-deflated": {"byteorder": zipfile.ZIP_DEFLATED},
}


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_deflated_records_are_read_right_everywhere(tmp_path: Path, scheme: str) -> None:
    level = {"deflated-level-1": 1, "deflated-level-9": 9}.get(scheme)
    src = hs.write(tmp_path / "d.pt", hs.rezip(good(tmp_path).read_bytes(), SCHEMES[scheme], level))
    want = torch.load(src, weights_only=True)  # torch without mmap inflates correctly
    for key, value in state()["model"].items():
        assert torch.equal(want["model"][key], value)
    reader = TorchReader(src)
    try:
        assert reader.streamed
        for key, value in state()["model"].items():
            assert torch.equal(reader.read(f"model.{key}"), value), key
    finally:
        reader.close()
    assert cli("inspect", src, "--deep")[0] == 0
    for to, dst in (("torch", "o.pt"), ("dcp", "o.dcp"), ("safetensors", "o.st")):
        assert cli("convert", src, tmp_path / dst, "--to", to)[0] == 0
        code, out = cli("verify", tmp_path / "good.pt", tmp_path / dst)
        assert code == 0, out
    code, out = cli("verify", src, tmp_path / "good.pt")
    assert code == 0, out


def test_torch_load_with_mmap_gives_wrong_bytes_where_hpcx_gives_right_ones(tmp_path: Path) -> None:
    torch.save({"b": torch.arange(100.0)}, tmp_path / "b.pt")
    src = hs.write(tmp_path / "d.pt", hs.rezip((tmp_path / "b.pt").read_bytes(), zipfile.ZIP_DEFLATED))
    mapped = torch.load(src, weights_only=True, mmap=True)["b"]
    assert not torch.equal(mapped, torch.arange(100.0))  # the issue: compressed bytes as data
    assert cli("convert", src, tmp_path / "o.safetensors", "--to", "safetensors", "--model-only")[0] == 0
    from safetensors.torch import load_file

    assert torch.equal(load_file(tmp_path / "o.safetensors")["b"], torch.arange(100.0))


def test_a_highly_compressed_tensor_is_inflated_with_bounded_buffers(tmp_path: Path) -> None:
    torch.save({"z": torch.zeros(2**22)}, tmp_path / "z.pt")  # 16 MiB of zeros: ~16 KiB deflated
    src = hs.write(tmp_path / "zd.pt", hs.rezip((tmp_path / "z.pt").read_bytes(), zipfile.ZIP_DEFLATED, 9))
    assert src.stat().st_size < 64 * 1024
    code, out = cli("inspect", src, "--deep")
    assert code == 0, out
    code, out = cli("verify", src, tmp_path / "z.pt")
    assert code == 0, out


@pytest.mark.parametrize("method,name", [(zipfile.ZIP_BZIP2, "bzip2"), (zipfile.ZIP_LZMA, "lzma")])
def test_other_methods_are_refused_with_one_line(tmp_path: Path, method: int, name: str) -> None:
    src = hs.write(tmp_path / "m.pt", hs.rezip(good(tmp_path).read_bytes(), method))
    refused_everywhere(tmp_path, src, f"compressed with {name}", "stored and deflated records only")


@pytest.mark.parametrize("method,name", [(93, "zstandard"), (9, "deflate64"), (98, "PPMd"), (6, "implode"),
                                         (77, "method")])
def test_a_method_number_zipfile_cannot_read_is_refused(tmp_path: Path, method: int, name: str) -> None:
    data = hs.rezip(good(tmp_path).read_bytes(), {"/data/0": zipfile.ZIP_DEFLATED})
    src = hs.write(tmp_path / "m.pt", hs.patch_central(data, "/data/0", method=method))
    refused_everywhere(tmp_path, src, f"compressed with {name} ({method})")


def deflated(tmp_path: Path) -> bytes:
    return hs.rezip(good(tmp_path).read_bytes(), zipfile.ZIP_DEFLATED)


def test_a_wrong_crc_is_refused_by_every_reading_path(tmp_path: Path) -> None:
    src = hs.write(tmp_path / "c.pt", hs.patch_central(deflated(tmp_path), "/data/1", crc=0x12345678))
    assert cli("inspect", src)[0] == 0  # structure only: the data is not read
    for args in (("inspect", src, "--deep"), ("convert", src, tmp_path / "o.pt", "--to", "torch"),
                 ("convert", src, tmp_path / "o.st", "--to", "safetensors"), ("verify", src, tmp_path / "good.pt")):
        code, out = cli(*args)
        assert code == 2 and "inflates to 400 bytes with CRC-32" in out and "12345678" in out, (args, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt", "good.pt"]


def test_a_flipped_compressed_byte_is_refused(tmp_path: Path) -> None:
    data = bytearray(deflated(tmp_path))
    at, length = hs.record_data_span(bytes(data), "/data/0")
    data[at + length // 2] ^= 0x55
    src = hs.write(tmp_path / "f.pt", bytes(data))
    code, out = cli("inspect", src, "--deep")
    assert code == 2 and "f.pt: record" in out and "(corrupt)" in out, out


@pytest.mark.parametrize("size,expect", [
    (10**9, "more than deflate can expand"),  # declared larger than the stream could ever give
    (100, "holds 100 bytes; the pickle expects"),
])
def test_a_declared_size_that_lies(tmp_path: Path, size: int, expect: str) -> None:
    src = hs.write(tmp_path / "s.pt", hs.patch_central(deflated(tmp_path), "/data/0", size=size))
    refused_everywhere(tmp_path, src, expect)


def test_a_stream_that_inflates_past_its_declared_size_is_stopped(tmp_path: Path) -> None:
    """The pickle and the directory agree on 40 bytes; the deflate stream holds 4000."""
    with zipfile.ZipFile(hs.io.BytesIO(hs.torch_bytes({"w": torch.arange(10.0)}))) as z:
        pkl = z.read("archive/data.pkl")
    data = hs.torch_archive(pkl, {"0": torch.arange(1000.0).numpy().tobytes()}, method=zipfile.ZIP_DEFLATED)
    src = hs.write(tmp_path / "s.pt", hs.patch_central(data, "/data/0", size=40))
    assert cli("inspect", src)[0] == 0  # sizes agree: only inflating shows the lie
    code, out = cli("inspect", src, "--deep")
    assert code == 2 and "s.pt: record archive/data/0 inflates to" in out and "says 40 bytes" in out, out


def test_encrypted_and_mismatched_local_headers_are_refused(tmp_path: Path) -> None:
    src = hs.write(tmp_path / "e.pt", hs.patch_central(deflated(tmp_path), "/data/0", flags=0x1))
    refused_everywhere(tmp_path, src, "is encrypted")
    stored = good(tmp_path).read_bytes()
    src2 = hs.write(tmp_path / "l.pt", hs.patch_central(stored, "/data/0", method=zipfile.ZIP_DEFLATED, local=False))
    refused_everywhere(tmp_path, src2, "its local header says compression method 0, the directory says 8")


def test_a_deflated_dcp_item_is_read_right_and_a_forged_one_refused(tmp_path: Path) -> None:
    src = mf.dcp_save(tmp_path / "c", {"model": {"w": torch.arange(24.0).view(4, 6)}, "train": {"step": 2}})
    file, offset, length = mf.item_bytes(src, "model.w")
    blob = file.read_bytes()[offset:offset + length]
    mf.replace_item(src, "model.w", hs.rezip(blob, zipfile.ZIP_DEFLATED))
    assert cli("inspect", src, "--deep")[0] == 0
    assert cli("convert", src, tmp_path / "o.pt", "--to", "torch")[0] == 0
    assert torch.equal(torch.load(tmp_path / "o.pt", weights_only=True)["model"]["w"], torch.arange(24.0).view(4, 6))
    mf.replace_item(src, "model.w", hs.patch_central(hs.rezip(blob, zipfile.ZIP_DEFLATED), "/data/0", crc=1))
    code, out = cli("inspect", src, "--deep")
    assert code == 2 and "item 'model.w'" in out and "CRC-32" in out, out


def test_a_compressed_file_in_a_layout_hpcx_does_not_stream_is_refused_not_mapped(tmp_path: Path) -> None:
    torch.save({"w": torch.arange(6.0), "dev": torch.device("cpu")}, tmp_path / "dev.pt")
    assert not TorchReader(tmp_path / "dev.pt").streamed  # torch.device: torch's own list, not hpcx's
    src = hs.write(tmp_path / "devd.pt", hs.rezip((tmp_path / "dev.pt").read_bytes(), zipfile.ZIP_DEFLATED))
    refused_everywhere(tmp_path, src, "is compressed, in a layout hpcx does not stream",
                       "torch.load(mmap=True) would map its compressed bytes")
