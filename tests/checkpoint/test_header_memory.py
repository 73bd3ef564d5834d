"""RAM per safetensors header entry (issue 24, class 6): a header of many tiny tensors costs a
bounded number of bytes per entry to open, inspect (text and --json) and convert, measured as the
peak RSS of a child process above its own RSS after importing torch and hpcx (resource.getrusage).
Measured here, 100,000 entries: ~1,510 bytes per entry to inspect before (issue 24 saw ~2.4 KB at
10⁶ entries; here 10⁶ took ~1,470), ~790 after (~750 at 10⁶). The bound is generous; it checks
memory, never time."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

ENTRIES = 100_000
BOUND = 1200  # bytes of peak RSS per header entry

CHILD = r"""
import os, resource, sys
import torch
import hpc.cli.ckpt, hpc.ckpt.convert
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
sys.stdout = open(os.devnull, "w")
try:
    hpc.cli.ckpt.ckpt_group.main(sys.argv[2:], standalone_mode=False)
finally:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print((peak - base) * 1024 / int(sys.argv[1]), file=sys.stderr)
"""


def many_tensors(path: Path, n: int) -> Path:
    """A safetensors file of ``n`` float32 scalars named like a model's (``layers.I.w``)."""
    parts = [f'"layers.{i}.w":{{"dtype":"F32","shape":[1],"data_offsets":[{4 * i},{4 * i + 4}]}}' for i in range(n)]
    raw = ("{" + ",".join(parts) + "}").encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + b"\0" * (4 * n))
    return path


@pytest.fixture(scope="module")
def big_header(tmp_path_factory) -> Path:
    return many_tensors(tmp_path_factory.mktemp("hdr") / "many.safetensors", ENTRIES)


def peak_per_entry(*args: object) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(ENTRIES), *map(str, args)], capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return float(proc.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("args", [("inspect",), ("inspect", "--json")], ids=["inspect", "inspect-json"])
def test_inspecting_a_header_of_many_tensors_costs_bounded_ram_per_entry(big_header: Path, args: tuple) -> None:
    per_entry = peak_per_entry(*args, big_header)
    assert per_entry < BOUND, f"{per_entry:.0f} bytes of RSS per header entry"


def test_converting_it_costs_bounded_ram_per_entry(big_header: Path, tmp_path: Path) -> None:
    per_entry = peak_per_entry("convert", big_header, tmp_path / "out.safetensors", "--to", "safetensors")
    assert per_entry < 2 * BOUND, f"{per_entry:.0f} bytes of RSS per header entry"
    header_len = struct.unpack("<Q", (tmp_path / "out.safetensors").read_bytes()[:8])[0]
    with open(tmp_path / "out.safetensors", "rb") as f:
        f.seek(8)
        assert len(json.loads(f.read(header_len))) == ENTRIES + 1  # + __metadata__
