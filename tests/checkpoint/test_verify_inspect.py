"""``verify`` compares NaN, infinities and signed zeros correctly; ``inspect`` reports what it checked
and, with --deep, checks digests and reads every byte; shard digests are written at save and
conversion and catch a flipped byte that nothing else sees."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import malformed as mf  # noqa: E402
from ckpt_helpers import assert_refused, cli  # noqa: E402

import hpc.ckpt.convert as convert  # noqa: E402
from hpc.ckpt.convert import compare_values  # noqa: E402
from trainer.checkpoint import Checkpointer  # noqa: E402

NAN, INF = float("nan"), float("inf")


def pair(tmp_path: Path, a: torch.Tensor, b: torch.Tensor) -> tuple[Path, Path]:
    return (mf.valid_st(tmp_path / "a.safetensors", {"w": a}), mf.valid_st(tmp_path / "b.safetensors", {"w": b}))


def test_the_issue_case_shared_nan_does_not_hide_a_difference_of_100(tmp_path: Path) -> None:
    a, b = pair(tmp_path, torch.tensor([1.0, NAN, 3.0]), torch.tensor([101.0, NAN, 3.0]))
    code, out = cli("verify", a, b, "--atol", "1")
    assert code == 1 and "max |a-b| = 100 at flat index 0" in out, out


VERIFY_CASES = {  # a, b, atol, difference (None: equal)
    "nan-same-places-rest-close": ([1.0, NAN, 3.0], [1.5, NAN, 3.0], 1.0, None),
    "nan-in-a-only": ([1.0, NAN, 3.0], [1.0, 2.0, 3.0], 1.0, "NaN in A only, first at flat index 1"),
    "nan-in-b-only": ([1.0, 2.0, 3.0], [1.0, 2.0, NAN], 100.0, "NaN in B only, first at flat index 2"),
    "nan-moved": ([NAN, 2.0], [2.0, NAN], 10.0, "NaN in A only, first at flat index 0"),
    "inf-equal": ([INF, -INF, 1.0], [INF, -INF, 1.0], 0.5, None),
    "inf-sign": ([INF, 1.0], [-INF, 1.0], 0.5, "inf vs -inf, first at flat index 0"),
    "inf-vs-finite": ([1.0, INF], [1.0, 1e30], 1e40, "inf vs 1e+30, first at flat index 1"),
    "within-atol": ([1.0, 2.0], [1.25, 1.75], 0.25, None),
    "just-over-atol": ([1.0, 2.0], [1.0, 2.5], 0.25, "max |a-b| = 0.5 at flat index 1"),
    "max-not-first": ([0.0, 0.0, 0.0], [0.3, 0.0, 0.9], 0.1, "max |a-b| = 0.9 at flat index 2"),
    "exact-nan-same-bits": ([NAN, 1.0], [NAN, 1.0], 0.0, None),
    "exact-signed-zero": ([0.0, 1.0], [-0.0, 1.0], 0.0, "bits differ between equal values"),
    "signed-zero-with-atol": ([0.0, 1.0], [-0.0, 1.0], 1e-9, None),
    "exact-tiny-difference": ([1.0], [1.0000001], 0.0, "max |a-b|"),
}


@pytest.mark.parametrize("case", sorted(VERIFY_CASES))
def test_verify_float_cases(tmp_path: Path, case: str) -> None:
    a, b, atol, diff = VERIFY_CASES[case]
    pa, pb = pair(tmp_path, torch.tensor(a), torch.tensor(b))
    code, out = cli("verify", pa, pb, "--atol", str(atol))
    assert code == (0 if diff is None else 1), out
    if diff:
        assert diff in out, out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_verify_nan_rule_holds_for_every_float_dtype(dtype: torch.dtype) -> None:
    a = torch.tensor([1.0, NAN, 3.0], dtype=dtype)
    assert "max |a-b| = 100" in compare_values(a, torch.tensor([101.0, NAN, 3.0], dtype=dtype), 1.0)
    assert compare_values(a, torch.tensor([1.5, NAN, 3.0], dtype=dtype), 1.0) is None
    assert "NaN in B only" in compare_values(a, torch.tensor([1.0, NAN, NAN], dtype=dtype), 1.0)


def test_verify_complex_integer_and_bool() -> None:
    c = torch.tensor([1 + 1j, complex(NAN, 0)])
    assert compare_values(c, torch.tensor([1 + 1.5j, complex(NAN, 0)]), 1.0) is None
    assert "max |a-b| = 2" in compare_values(c, torch.tensor([1 + 3j, complex(NAN, 0)]), 1.0)
    i = torch.tensor([1, 5, 9])
    assert compare_values(i, torch.tensor([1, 6, 9]), 1.0) is None
    assert "1 elements differ by more than 1, first at flat index 2" in compare_values(i, torch.tensor([1, 6, 12]), 1.0)
    assert "first at flat index 1" in compare_values(i, torch.tensor([1, 6, 9]), 0.0)
    assert "first at flat index 0" in compare_values(torch.tensor([True]), torch.tensor([False]), 0.5)
    assert "int64[3] vs int32[3]" in compare_values(i, i.int(), 0.0)


def test_verify_finds_the_largest_difference_across_slices(monkeypatch) -> None:
    monkeypatch.setattr(convert, "COMPARE_ELEMENTS", 4)  # several slices for a 10-element tensor
    a = torch.zeros(10)
    b = a.clone()
    b[2], b[9] = 0.5, 2.0
    assert compare_values(a, b, 0.1) == "max |a-b| = 2 at flat index 9"
    b[7] = NAN
    assert compare_values(a, b, 0.1) == "NaN in B only, first at flat index 7"


def test_verify_objects_compare_nan_as_equal_and_nested_values() -> None:
    assert compare_values({"lr": NAN, "betas": (0.9, 0.95)}, {"lr": NAN, "betas": (0.9, 0.95)}, 0.0) is None
    assert "['betas']: [1]: 0.95 vs 0.99" in compare_values({"betas": (0.9, 0.95)}, {"betas": (0.9, 0.99)}, 0.0)
    assert compare_values([torch.ones(2)], [torch.ones(2)], 0.0) is None
    assert "1 vs 1.0" in compare_values(1, 1.0, 0.0)


# ---------------------------------------------------------------- inspect


def saved(tmp_path: Path, async_save: bool = False) -> Path:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 8))
    saves = Checkpointer(tmp_path / "run", async_save=async_save)
    path = saves.save(1, model, None, None, {"step": 1})
    saves.wait()
    return path


def test_inspect_says_what_it_checked_and_what_it_did_not_read(tmp_path: Path) -> None:
    path = saved(tmp_path)
    info = json.loads(cli("inspect", path, "--json")[1])
    assert info["complete"] and "every item's zip directory" in info["checked"] and "no tensor data" in info["checked"]
    assert info["digests"] == {"files": 1, "recorded": 1, "verified": None}
    code, help_text = cli("inspect", "--help")
    assert code == 0 and "reads no tensor data" in " ".join(help_text.split())


@pytest.mark.parametrize("what", ["end-record", "central-entry", "local-header", "pickle"])
def test_inspect_reads_each_items_zip_directory(tmp_path: Path, what: str) -> None:
    path = saved(tmp_path)
    file, offset, length = mf.item_bytes(path, "model.1.bias")
    mf.damage_item(file, offset, length, what)
    code, out = cli("inspect", path, "--json")
    assert code == 2 and '"complete"' not in out and "item 'model.1.bias'" in out, out


def flip_tensor_byte(path: Path, key: str) -> None:
    """Flip one bit in the middle of ``key``'s tensor bytes (its zip record), nothing else."""
    from hpc.ckpt.torch_zip import TorchZip

    file, offset, length = mf.item_bytes(path, key)
    with open(file, "rb") as f:
        z = TorchZip(f, str(file), offset, length)
        at, nbytes = z._check(z.ref(z.obj))
    data = file.read_bytes()
    mf.overwrite(file, at + nbytes // 2, bytes([data[at + nbytes // 2] ^ 0x01]))


@pytest.mark.parametrize("async_save", [False, True])
def test_digests_are_written_at_save_and_catch_a_flipped_byte(tmp_path: Path, async_save: bool) -> None:
    path = saved(tmp_path, async_save)
    shard = next(path.glob("*.distcp"))
    assert (path / f"{shard.name}.sha256").read_text().endswith(f"  {shard.name}\n")
    if shutil.which("sha256sum"):  # the sidecar is plain sha256sum format
        subprocess.run(["sha256sum", "-c", f"{shard.name}.sha256"], cwd=path, check=True, capture_output=True)
    code, out = cli("inspect", path, "--deep")
    assert code == 0 and "1 of 1 shard files recorded, 1 verified" in out, out
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    flip_tensor_byte(copy, "model.0.weight")
    assert cli("inspect", copy)[0] == 0  # structure intact: only the bytes changed
    assert_refused(("inspect", copy, "--deep"), "SHA-256", "differs from the", "recorded when it was written")
    assert_refused(("verify", path, copy), "SHA-256")


def test_conversion_to_dcp_writes_a_digest_on_request_and_checkpoints_without_one_still_read(tmp_path: Path) -> None:
    path = saved(tmp_path)
    assert cli("convert", path, tmp_path / "c.dcp", "--to", "dcp", "--digest")[0] == 0
    code, out = cli("inspect", tmp_path / "c.dcp", "--deep")
    assert code == 0 and "1 of 1 shard files recorded, 1 verified" in out, out
    if shutil.which("sha256sum"):
        subprocess.run(["sha256sum", "-c", "__0_0.distcp.sha256"], cwd=tmp_path / "c.dcp", check=True, capture_output=True)
    assert cli("convert", path, tmp_path / "plain.dcp", "--to", "dcp")[0] == 0
    assert not list((tmp_path / "plain.dcp").glob("*.sha256"))
    assert_refused(("convert", path, tmp_path / "x.pt", "--to", "torch", "--digest"), "only --to dcp")
    stock = mf.dcp_save(tmp_path / "stock", {"model": {"w": torch.ones(3)}})
    code, out = cli("inspect", stock, "--deep")
    assert code == 0 and "0 of 1 shard files recorded, 0 verified" in out, out
    result = json.loads(cli("verify", stock, stock, "--json")[1])
    assert result["equal"] and result["digests"]["a"]["recorded"] == 0


def test_a_malformed_digest_file_is_an_error(tmp_path: Path) -> None:
    path = saved(tmp_path)
    shard = next(path.glob("*.distcp"))
    (path / f"{shard.name}.sha256").write_text("not a digest\n")
    assert_refused(("inspect", path, "--deep"), "not a sha256sum line")


def test_inspect_deep_counts_nan_and_inf(tmp_path: Path) -> None:
    src = mf.valid_st(tmp_path / "x.safetensors", {"w": torch.tensor([1.0, NAN, INF, -INF]), "ok": torch.ones(3),
                                                    "i": torch.arange(3)})
    info = json.loads(cli("inspect", src, "--deep", "--json")[1])
    assert info["nonfinite"] == {"model.w": 3}
    code, out = cli("inspect", src, "--deep")
    assert code == 0 and "model.w (3)" in out


def rewrite_archive(src: Path, dst: Path, edit) -> Path:
    """A copy of the zip ``src`` whose records pass through ``edit(name, data) -> data | None``."""
    import zipfile

    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            data = edit(info.filename, zin.read(info))
            if data is not None:
                zout.writestr(info.filename, data)
    return dst


@pytest.mark.parametrize("damage,expect", [
    ("end-record", "not a complete torch.save zip"),
    ("central-entry", "not a complete torch.save zip"),
    ("record-short", "holds 8 bytes; the pickle expects 64"),
    ("record-missing", "record good/data/0 is missing"),
    ("truncated", "not a complete torch.save zip"),
])
def test_a_torch_file_damaged_or_lying_is_refused(tmp_path: Path, damage: str, expect: str) -> None:
    good = tmp_path / "good.pt"
    torch.save({"w": torch.arange(16.0), "b": torch.ones(2)}, good)
    bad = tmp_path / "bad.pt"
    if damage in ("end-record", "central-entry"):
        bad.write_bytes(good.read_bytes())
        mf.damage_item(bad, 0, bad.stat().st_size, damage)
    elif damage == "record-short":
        rewrite_archive(good, bad, lambda name, data: data[:8] if name.endswith("data/0") else data)
    elif damage == "record-missing":
        rewrite_archive(good, bad, lambda name, data: None if name.endswith("data/0") else data)
    else:
        bad.write_bytes(good.read_bytes()[:-30])
    assert_refused(("inspect", bad), "bad.pt", expect)
    assert_refused(("convert", bad, tmp_path / "o.safetensors", "--to", "safetensors"), expect)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.pt", "good.pt"]
