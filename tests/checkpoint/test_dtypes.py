"""Every dtype torch can save (issue 24, class 4): fp8 (e4m3fn, e5m2, their fnuz forms, e8m0),
packed float4, complex32/64/128, bool, uint16/32/64, int8..int64. ``inspect --deep`` counts NaN/Inf
where a format has them (no crash where CPU kernels lack ``isfinite``), every conversion is
bit-exact, ``verify`` compares them (exactly, and with --atol), and the safetensors side holds exactly
the dtypes the safetensors library itself maps (its ``safetensors.torch._TYPES``): files it writes
read here, files written here load there, the rest is one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ckpt_helpers import assert_refused, cli  # noqa: E402

from hpc.ckpt.convert import compare_values, nonfinite_count  # noqa: E402
from hpc.ckpt.safetensors import ST_DTYPES  # noqa: E402
from tests.extras import extra  # noqa: E402

st_torch = extra("safetensors.torch")

DTYPES = ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
          "float4_e2m1fn_x2", "complex32", "complex64", "complex128", "bool", "uint8", "uint16", "uint32", "uint64",
          "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64"]
AVAILABLE = [d for d in DTYPES if isinstance(getattr(torch, d, None), torch.dtype)]


def raw_tensor(name: str, n: int = 48, seed: int = 0) -> torch.Tensor:
    """``n`` random bytes seen as dtype ``name`` (every bit pattern: NaN payloads, subnormals ...)."""
    dtype = getattr(torch, name)
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    return torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g).view(dtype)


def test_the_safetensors_dtypes_are_the_librarys() -> None:
    library = {v: k for k, v in st_torch._TYPES.items()}
    assert ST_DTYPES == library


@pytest.mark.parametrize("name", AVAILABLE)
def test_every_dtype_converts_bit_exact_and_inspects_deep(tmp_path: Path, name: str) -> None:
    t = raw_tensor(name)
    torch.save({"t": t, "k": t.reshape(2, -1)[:, :4]}, tmp_path / "s.pt")
    code, out = cli("inspect", tmp_path / "s.pt", "--deep", "--json")
    assert code == 0, out
    info = json.loads(out)
    assert info["nonfinite"].get("model.t", 0) == nonfinite_count(t)
    targets = [("torch", "o.pt"), ("dcp", "o.dcp")]
    if t.dtype in ST_DTYPES:
        targets.append(("safetensors", "o.safetensors"))
    else:
        assert_refused(("convert", tmp_path / "s.pt", tmp_path / "o.safetensors", "--to", "safetensors"),
                       "safetensors cannot hold model.t", str(t.dtype))
    for to, dst in targets:
        code, out = cli("convert", tmp_path / "s.pt", tmp_path / dst, "--to", to)
        assert code == 0, (to, out)
        code, out = cli("verify", tmp_path / "s.pt", tmp_path / dst)
        assert code == 0 and "bit-exact" in out, (to, out)
        assert cli("inspect", tmp_path / dst, "--deep")[0] == 0
    got = torch.load(tmp_path / "o.pt", weights_only=True)["model"]["t"]
    assert got.dtype == t.dtype and torch.equal(got.view(torch.uint8), t.view(torch.uint8))


@pytest.mark.parametrize("dtype", sorted(ST_DTYPES, key=str))
def test_files_the_library_writes_read_here_and_ours_load_there(tmp_path: Path, dtype: torch.dtype) -> None:
    t = raw_tensor(str(dtype).removeprefix("torch."))
    st_torch.save_file({"t": t, "u": t[:8].clone()}, tmp_path / "lib.safetensors")
    code, out = cli("convert", tmp_path / "lib.safetensors", tmp_path / "o.safetensors", "--to", "safetensors",
                    "--model-only")
    assert code == 0, out
    back = st_torch.load_file(tmp_path / "o.safetensors")
    assert back["t"].dtype == dtype and torch.equal(back["t"].view(torch.uint8), t.view(torch.uint8))
    code, out = cli("verify", tmp_path / "lib.safetensors", tmp_path / "o.safetensors")
    assert code == 0, out
    assert cli("inspect", tmp_path / "lib.safetensors", "--deep")[0] == 0


FINITE_CASES = {  # dtype: (values, NaN/Inf count)
    "float8_e4m3fn": ([1.0, float("nan"), 448.0, -2.0], 1),  # no Inf in e4m3fn
    "float8_e5m2": ([1.0, float("inf"), float("-inf"), float("nan")], 3),
    "float8_e4m3fnuz": ([1.0, float("nan"), 0.5], 1),
    "float8_e5m2fnuz": ([float("nan"), 2.0], 1),
    "complex64": ([complex(1, float("nan")), complex(float("inf"), 0), 1 + 1j], 2),
    "complex128": ([complex(1, 2), complex(3, float("-inf"))], 1),
    "bfloat16": ([float("nan"), float("inf"), 1.0], 2),
}


@pytest.mark.parametrize("name", sorted(FINITE_CASES))
def test_inspect_deep_counts_nan_and_inf_where_the_format_has_them(tmp_path: Path, name: str) -> None:
    values, bad = FINITE_CASES[name]
    dtype = getattr(torch, name)
    t = (torch.tensor(values, dtype=torch.complex128) if dtype.is_complex else torch.tensor(values)).to(dtype)
    torch.save({"t": t, "i": torch.arange(3).to(torch.uint16)}, tmp_path / "f.pt")
    info = json.loads(cli("inspect", tmp_path / "f.pt", "--deep", "--json")[1])
    assert info["nonfinite"] == {"model.t": bad}


def test_verify_compares_fp8_uint64_and_packed_types() -> None:
    a = torch.tensor([1.0, 2.0, 4.0]).to(torch.float8_e4m3fn)
    b = torch.tensor([1.0, 2.5, 4.0]).to(torch.float8_e4m3fn)
    assert compare_values(a, b, 0.0) == "max |a-b| = 0.5 at flat index 1"
    assert compare_values(a, b, 1.0) is None
    assert "NaN in B only" in compare_values(a, torch.tensor([1.0, float("nan"), 4.0]).to(torch.float8_e4m3fn), 1.0)
    big = torch.tensor([2**64 - 1, 2**63, 5], dtype=torch.uint64)
    near = torch.tensor([2**64 - 2, 2**63, 5], dtype=torch.uint64)
    assert compare_values(big, near, 0.5) == "1 elements differ by more than 0.5, first at flat index 0"
    assert compare_values(big, near, 1.0) is None
    far = torch.tensor([0, 2**63, 5], dtype=torch.uint64)
    assert "first at flat index 0" in compare_values(big, far, 10.0**18)
    i64 = torch.tensor([-2**63, 2**63 - 1])
    assert "first at flat index 0" in compare_values(i64, torch.tensor([2**63 - 1, 2**63 - 1]), 1.0)
    if hasattr(torch, "float4_e2m1fn_x2"):
        p = torch.tensor([1, 2, 3], dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
        q = torch.tensor([1, 9, 3], dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
        assert compare_values(p, p.clone(), 0.0) is None and compare_values(p, p.clone(), 1.0) is None
        assert compare_values(p, q, 0.5) == "bytes differ, first at flat index 1"
    c = torch.tensor([1 + 1j, 2 + 2j], dtype=torch.complex32)
    assert compare_values(c, torch.tensor([1 + 1j, 2 + 3j], dtype=torch.complex32), 0.5) == \
        "max |a-b| = 1 at flat index 3"
