"""`hpcx ckpt convert` throughput against `dd`, and peak memory against the largest tensor.

    python bench/convert/run.py [--size-mb 1024] [--largest-mb 64] [--dir DIR]

Builds a DCP checkpoint of ``--size-mb`` MB (model-only, fp32, largest tensor ``--largest-mb``),
then runs each direction in a fresh process and reads that process's peak RSS (VmHWM):
dcp->safetensors, safetensors->dcp, dcp->torch (not streamed, by necessity), torch->dcp (streamed
by ``TorchZip``), the same with the old reader (``torch.load(mmap=True)``, the fallback) for a
before/after in one run, and torch's own ``dcp_to_torch_save`` (loads everything first) for
comparison. ``dd`` writes the same number of random bytes (from a file in the page cache) with
``conv=fdatasync`` in the same folder for the throughput ratio. The baseline RSS of a
process that has only imported torch is printed too, and each peak minus that baseline. Goals: >= 0.3x dd; for the streamed
directions peak RSS <= largest tensor + 256 MB.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MB = 2**20
CHILD = r"""
import json, sys, time
t = time.perf_counter()
{body}
elapsed = time.perf_counter() - t
hwm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
print(json.dumps({{"seconds": elapsed, "peak_rss": hwm}}))
"""
BODIES = {
    "baseline (import torch)": "import torch, hpc.ckpt.convert",
    "dcp -> safetensors": "from hpc.ckpt.convert import convert_checkpoint as c; c(sys.argv[1], sys.argv[2], 'safetensors')",
    "safetensors -> dcp": "from hpc.ckpt.convert import convert_checkpoint as c; c(sys.argv[1], sys.argv[2], 'dcp')",
    "dcp -> torch (not streamed)": "from hpc.ckpt.convert import convert_checkpoint as c; c(sys.argv[1], sys.argv[2], 'torch')",
    "torch -> dcp (streamed)": "from hpc.ckpt.convert import convert_checkpoint as c; c(sys.argv[1], sys.argv[2], 'dcp')",
    "torch -> dcp (old: mmap)": "import hpc.ckpt.torchsave as f, hpc.ckpt.torch_zip as z\n"
                                "def no(*a, **k): raise z.Unsupported('bench: old path')\n"
                                "f.TorchZip = no\n"
                                "from hpc.ckpt.convert import convert_checkpoint as c; c(sys.argv[1], sys.argv[2], 'dcp')",
    "dcp_to_torch_save (torch's)": "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save as c; "
                                   "c(sys.argv[1], sys.argv[2])",
}


def make_checkpoint(root: Path, size_mb: int, largest_mb: int) -> Path:
    """A model-only DCP checkpoint: one ``largest_mb`` tensor, the rest in 16 MB tensors."""
    import torch
    from torch import nn

    from trainer.checkpoint import save_checkpoint

    rows = largest_mb * MB // (4 * 1024)
    layers = [nn.Linear(1024, rows, bias=False)] + [nn.Linear(1024, 4096, bias=False)
                                                    for _ in range(max(0, (size_mb - largest_mb) // 16))]
    with torch.no_grad():
        for layer in layers:
            layer.weight.normal_()
    return save_checkpoint(root, 1, nn.Sequential(*layers), None, None, {"step": 1})


def child(name: str, *args: str) -> dict:
    code = CHILD.format(body=BODIES[name])
    out = subprocess.run([sys.executable, "-c", code, *args], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def dd_write(path: Path, size_mb: int) -> float:
    """Seconds to write ``size_mb`` MB of random bytes (source in the page cache) with fdatasync."""
    src = path.with_suffix(".src")
    src.write_bytes(os.urandom(size_mb * MB))
    t = time.perf_counter()
    subprocess.run(["dd", f"if={src}", f"of={path}", "bs=1M", f"count={size_mb}", "conv=fdatasync"],
                   check=True, capture_output=True)
    elapsed = time.perf_counter() - t
    path.unlink()
    src.unlink()
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=1024, help="checkpoint size in MB (default 1024)")
    ap.add_argument("--largest-mb", type=int, default=64, help="size of the largest tensor in MB (default 64)")
    ap.add_argument("--dir", type=Path, default=None, help="folder on the disk to measure (default: a temp folder)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="hpcx-bench-convert-", dir=args.dir))
    try:
        run(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(args: argparse.Namespace, root: Path) -> None:
    ckpt = make_checkpoint(root, args.size_mb, args.largest_mb)
    size = sum(f.stat().st_size for f in ckpt.iterdir())
    dd_s = dd_write(root / "dd.bin", round(size / MB))
    print(f"checkpoint {size / MB:.0f} MB, largest tensor {args.largest_mb} MB, in {root}")
    print(f"dd write (fdatasync): {size / MB / dd_s:.0f} MB/s")
    base = child("baseline (import torch)")["peak_rss"]
    print(f"baseline RSS after importing torch: {base / MB:.0f} MB")
    steps = [("dcp -> safetensors", ckpt, root / "out.safetensors"), ("safetensors -> dcp", root / "out.safetensors", root / "back1"),
             ("dcp -> torch (not streamed)", ckpt, root / "out.pt"), ("torch -> dcp (streamed)", root / "out.pt", root / "back2"),
             ("torch -> dcp (old: mmap)", root / "out.pt", root / "back3"),
             ("dcp_to_torch_save (torch's)", ckpt, root / "ref.pt")]
    print(f"{'direction':30} {'MB/s':>7} {'x dd':>6} {'peak RSS MB':>12} {'/ckpt':>6} {'/largest':>9} {'-largest MB':>12} {'-baseline MB':>13}")
    for name, src, dst in steps:
        r = child(name, str(src), str(dst))
        peak, largest = r["peak_rss"], args.largest_mb * MB
        print(f"{name:30} {size / MB / r['seconds']:7.0f} {dd_s / r['seconds']:6.2f} {peak / MB:12.0f} "
              f"{peak / size:6.2f} {peak / largest:9.2f} {(peak - largest) / MB:12.0f} {(peak - base) / MB:13.0f}")
    print("goals: >= 0.3x dd; streamed directions: peak RSS <= largest tensor + 256 MB")


if __name__ == "__main__":
    main()
