"""`hpcx ckpt convert` throughput against `dd`, and peak memory against the largest tensor.

    python bench/convert/run.py [--size-mb 1024] [--largest-mb 64] [--repeat 3] [--dir DIR]

Builds a DCP checkpoint of ``--size-mb`` MB (model-only, fp32, largest tensor ``--largest-mb``)
and, from it, a safetensors file and a torch.save file (untimed). Then every direction between
the three formats runs in a fresh process that imports torch and hpcx *before* its clock starts
and reads its own peak RSS (VmHWM) at the end, with two stock baselines for comparison:
``torch.load(mmap=True, weights_only=True)`` + ``safetensors.torch.save_file`` for
torch -> safetensors, and torch's ``dcp_to_torch_save`` for dcp -> torch.

The ratio is ``dd`` time / conversion time, where ``dd`` writes the same number of random bytes
(source in the page cache) with ``conv=fdatasync`` in the same folder *right before* each run,
so both see the same disk and the same load; each direction runs ``--repeat`` times and the best
and median ratios are printed. The baseline RSS is a process that only ran ``import torch``.
Goals: every direction >= 0.3x dd; peak RSS <= largest tensor + 256 MB above that baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MB = 2**20
CHILD = r"""
import json, sys, warnings
warnings.filterwarnings("ignore")
{imports}
import time
t = time.perf_counter()
{body}
elapsed = time.perf_counter() - t
hwm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
print(json.dumps({{"seconds": elapsed, "peak_rss": hwm}}))
"""
HPCX = ("import torch\nfrom hpc.ckpt.convert import convert_checkpoint as c",)
DIRECTIONS = {  # name: (source, target format, imports, body)
    "dcp -> safetensors": ("dcp", "safetensors"),
    "dcp -> torch": ("dcp", "torch"),
    "safetensors -> dcp": ("st", "dcp"),
    "safetensors -> torch": ("st", "torch"),
    "torch -> dcp": ("pt", "dcp"),
    "torch -> safetensors": ("pt", "safetensors"),
}
STOCK = {
    "stock torch -> safetensors": ("pt", "import torch\nfrom safetensors.torch import save_file",
                                   "save_file(torch.load(sys.argv[1], mmap=True, weights_only=True), sys.argv[2])"),
    "stock dcp -> torch (dcp_to_torch_save)": ("dcp", "import torch\nfrom torch.distributed.checkpoint.format_utils "
                                               "import dcp_to_torch_save as c", "c(sys.argv[1], sys.argv[2])"),
}


def make_sources(root: Path, size_mb: int, largest_mb: int) -> dict[str, Path]:
    """A model-only DCP checkpoint (one ``largest_mb`` tensor, the rest 16 MB tensors), and the same
    state as safetensors and as a torch.save file."""
    import torch
    from torch import nn

    from hpc.ckpt.convert import convert_checkpoint
    from trainer.checkpoint import Checkpointer

    rows = largest_mb * MB // (4 * 1024)
    layers = [nn.Linear(1024, rows, bias=False)] + [nn.Linear(1024, 4096, bias=False)
                                                    for _ in range(max(0, (size_mb - largest_mb) // 16))]
    with torch.no_grad():
        for layer in layers:
            layer.weight.normal_()
    saves = Checkpointer(root / "run")
    dcp = saves.save(1, nn.Sequential(*layers), None, None, {"step": 1})
    saves.wait()
    convert_checkpoint(dcp, root / "src.safetensors", "safetensors", model_only=True)
    convert_checkpoint(dcp, root / "src.pt", "torch", model_only=True)
    return {"dcp": dcp, "st": root / "src.safetensors", "pt": root / "src.pt"}


def child(imports: str, body: str, *args: str) -> dict:
    code = CHILD.format(imports=imports, body=body)
    out = subprocess.run([sys.executable, "-c", code, *args], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def dd_write(path: Path, src: Path, size_mb: int) -> float:
    """Seconds to write ``size_mb`` MB of random bytes (``src``, in the page cache) with fdatasync."""
    t = time.perf_counter()
    subprocess.run(["dd", f"if={src}", f"of={path}", "bs=1M", f"count={size_mb}", "conv=fdatasync"],
                   check=True, capture_output=True)
    elapsed = time.perf_counter() - t
    path.unlink()
    return elapsed


def remove(path: Path) -> None:
    shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


def measure(root: Path, name: str, job: tuple[str, str, str, str], size_mb: int, repeat: int) -> dict:
    """``repeat`` runs of one direction, each right after a dd of the same size."""
    src, imports, body, ext = job
    runs = []
    for _ in range(repeat):
        dst = root / f"out.{ext}"
        dd_s = dd_write(root / "dd.bin", root / "random.src", size_mb)
        r = child(imports, body, str(src), str(dst))
        remove(dst)
        runs.append({"dd_s": dd_s, **r})
    return {"name": name, "runs": runs}


def jobs(sources: dict[str, Path]) -> dict[str, tuple[str, str, str, str]]:
    ext = {"dcp": "dcp", "safetensors": "safetensors", "torch": "pt"}
    out = {name: (str(sources[s]), HPCX[0], f"c(sys.argv[1], sys.argv[2], {to!r})", ext[to])
           for name, (s, to) in DIRECTIONS.items()}
    out.update({name: (str(sources[s]), imports, body, "pt" if "torch" in name.split("->")[1] else "safetensors")
                for name, (s, imports, body) in STOCK.items()})
    return out


def report(results: list[dict], size: int, largest: int, base: int) -> None:
    print(f"{'direction':40} {'MB/s':>6} {'x dd best':>9} {'median':>7} {'peak RSS MB':>11} "
          f"{'-baseline MB':>12} {'goal MB':>8}")
    for res in results:
        runs = res["runs"]
        ratios = [r["dd_s"] / r["seconds"] for r in runs]
        peak = max(r["peak_rss"] for r in runs)
        best = min(r["seconds"] for r in runs)
        print(f"{res['name']:40} {size / MB / best:6.0f} {max(ratios):9.2f} {statistics.median(ratios):7.2f} "
              f"{peak / MB:11.0f} {(peak - base) / MB:12.0f} {(largest + 256 * MB) / MB:8.0f}")
    print("goals: every direction >= 0.3x dd; peak RSS - baseline <= largest tensor + 256 MB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=1024, help="checkpoint size in MB (default 1024)")
    ap.add_argument("--largest-mb", type=int, default=64, help="size of the largest tensor in MB (default 64)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per direction, each after its own dd (default 3)")
    ap.add_argument("--only", default="", help="run only directions whose name contains this text")
    ap.add_argument("--dir", type=Path, default=None, help="folder on the disk to measure (default: a temp folder)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="hpcx-bench-convert-", dir=args.dir))
    try:
        run(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(args: argparse.Namespace, root: Path) -> None:
    sources = make_sources(root, args.size_mb, args.largest_mb)
    size = sum(f.stat().st_size for f in sources["dcp"].iterdir() if f.suffix == ".distcp")
    (root / "random.src").write_bytes(os.urandom(round(size / MB) * MB))
    base = child("import torch", "pass")["peak_rss"]
    print(f"checkpoint {size / MB:.0f} MB, largest tensor {args.largest_mb} MB, in {root}; load {os.getloadavg()}")
    print(f"baseline RSS after a bare `import torch`: {base / MB:.0f} MB")
    results = [measure(root, name, job, round(size / MB), args.repeat)
               for name, job in jobs(sources).items() if args.only in name]
    report(results, size, args.largest_mb * MB, base)
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
