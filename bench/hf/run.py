"""Hugging Face in and out: ``checkpoint.init_from`` against ``from_pretrained``, and ``--to hf`` against dd.

    python bench/hf/run.py [--dim 1024] [--layers 8] [--vocab 32000] [--ranks 2,4] [--repeat 3] [--dir DIR]

init: a random ``LlamaForCausalLM`` saved by transformers in bf16 (sharded, 2 GB shards: untimed), then
  - hpcx ``init_from`` at each of ``--ranks`` gloo ranks (torchrun, FSDP): each rank builds the model on
    meta, shards it, allocates its shard untouched and loads it (``trainer.init_from.initial_weights``);
  - ``from_pretrained(low_cpu_mem_usage=True)`` of the same folder in one process.
  Each reports the load's seconds, the process's peak RSS (VmHWM) and the bytes its read() calls
  returned (/proc/self/io rchar; safetensors' own loader maps the files, so its pages arrive by page
  faults that rchar does not count: for it the figure is the file bytes it maps). The page cache is
  warm for every contender (the files were just written).
export: a DCP step of the same model (fp32) in a run folder; ``export_hf`` (fp32) in a fresh process
  against ``dd`` of the same byte count (``conv=fdatasync``, right before each run), ``--repeat``
  times (best and median ratio), ``safetensors.save_file`` of the whole state dict as a stock
  reference, and one profiled export: where the time goes (reading, mapping, writing, fsync).
Goals (issue 20): bytes read per rank <= model bytes / ranks + 5%; export >= 0.5x dd median.
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

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
MB = 2**20
CHILD_TAIL = r"""
io = dict(l.split(": ") for l in open("/proc/self/io").read().splitlines())
hwm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
print(json.dumps({"seconds": elapsed, "peak_rss": hwm, "rchar": int(io["rchar"]) - rchar0}))
"""
FROM_PRETRAINED = r"""
import json, sys, time, warnings
warnings.filterwarnings("ignore")
import torch, transformers
rchar0 = int(dict(l.split(": ") for l in open("/proc/self/io").read().splitlines())["rchar"])
t = time.perf_counter()
m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], low_cpu_mem_usage=True, torch_dtype=torch.float32)
elapsed = time.perf_counter() - t
""" + CHILD_TAIL
EXPORT = r"""
import json, sys, time
import torch
from hpc.ckpt.hf import export_hf
import hpc.ckpt.dcp, hpc.core.spec, hpc.core.runs, hpc.core.models  # imported before the clock, as bench/convert does
rchar0 = int(dict(l.split(": ") for l in open("/proc/self/io").read().splitlines())["rchar"])
t = time.perf_counter()
export_hf(sys.argv[1], sys.argv[2])
elapsed = time.perf_counter() - t
""" + CHILD_TAIL
SAVE_FILE = r"""
import json, sys, time
import torch
from safetensors.torch import save_file
from hpc.ckpt.dcp import DcpReader
r = DcpReader(sys.argv[1])
state = {k: r.read(k) for k in r.entries if k.startswith("model.")}
rchar0 = int(dict(l.split(": ") for l in open("/proc/self/io").read().splitlines())["rchar"])
t = time.perf_counter()
save_file(state, sys.argv[2])
os_fd = open(sys.argv[2], "rb+"); import os; os.fsync(os_fd.fileno())
elapsed = time.perf_counter() - t
""" + CHILD_TAIL


def child(code: str, *args: str) -> dict:
    """Run ``code`` in a fresh interpreter; its last stdout line as JSON."""
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}, check=False)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def config(args: argparse.Namespace) -> dict:
    """The LlamaConfig fields of the benchmark's model (head size 64, two queries per kv head)."""
    ffn = 256 * -(-int(8 * args.dim / 3) // 256)
    return dict(hidden_size=args.dim, intermediate_size=ffn, num_hidden_layers=args.layers,
                num_attention_heads=args.dim // 64, num_key_value_heads=args.dim // 128, vocab_size=args.vocab,
                max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0)


def spec_sets(cfg: dict, init_from: Path) -> list[str]:
    """``--set`` overrides of jobs/tiny-llama.toml that describe the same model."""
    return ["model.arch='llama'", "model.size='small'", f"model.dim={cfg['hidden_size']}",
            f"model.n_layers={cfg['num_hidden_layers']}", f"model.n_heads={cfg['num_attention_heads']}",
            f"model.n_kv_heads={cfg['num_key_value_heads']}", f"model.ffn_dim={cfg['intermediate_size']}",
            f"model.vocab_size={cfg['vocab_size']}", f"checkpoint.init_from={str(init_from)!r}",
            "train.global_batch=8", "train.micro_batch=1", "parallel.strategy='fsdp'"]


def make_run(root: Path, name: str, sets: list[str], ranks: int) -> Path:
    """A run folder with resolved.json, as ``hpcx submit`` writes it (local site)."""
    from hpc.core.resolve import resolved_document
    from hpc.plan.resolve import resolve
    from hpc.core.site import load_site
    from hpc.core.spec import load_spec

    spec = load_spec(REPO / "jobs" / "tiny-llama.toml", [*sets, f"job.tasks_per_node={ranks}", "job.nodes=1"])
    site = load_site("local")
    run = root / name
    run.mkdir(parents=True, exist_ok=True)
    (run / "resolved.json").write_text(json.dumps(resolved_document(spec, site, resolve(spec, site), str(run))))
    return run


def hf_folder(path: Path, cfg: dict) -> int:
    """A random LlamaForCausalLM saved in bf16 at ``path``; the safetensors bytes."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).to(torch.bfloat16)
    model.save_pretrained(path, max_shard_size="2GB")
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def init_ranks(root: Path, hf: Path, cfg: dict, ranks: int) -> list[dict]:
    """``ranks`` gloo ranks loading ``hf`` through init_from (bench/hf/worker.py); each rank's report."""
    run = make_run(root, f"init-{ranks}", spec_sets(cfg, hf), ranks)
    out = root / f"init-{ranks}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--standalone",
           str(REPO / "bench" / "hf" / "worker.py"), str(out), str(run)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=False,
                          env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    return json.loads(out.read_text())


def bench_init(root: Path, args: argparse.Namespace) -> None:
    """init_from at each rank count against from_pretrained, as a table."""
    cfg = config(args)
    hf = root / "hf"
    size = hf_folder(hf, cfg)
    base = child("import json,time\nimport torch, transformers\nrchar0=0\nelapsed=0.0\n" + CHILD_TAIL)["peak_rss"]
    print(f"init: {size / MB:.0f} MB of bf16 safetensors ({cfg}); a process with torch + transformers "
          f"imported: {base / MB:.0f} MB RSS")
    print(f"{'who':34} {'s':>6} {'peak RSS MB':>11} {'- base':>7} {'read MB':>8} {'read/model':>10}")
    hf_run = child(FROM_PRETRAINED, str(hf))
    print(f"{'from_pretrained(low_cpu_mem_usage)':34} {hf_run['seconds']:6.2f} {hf_run['peak_rss'] / MB:11.0f} "
          f"{(hf_run['peak_rss'] - base) / MB:7.0f} {size / MB:8.0f} {'1 (mmap)':>10}")
    for ranks in args.ranks:
        for r in init_ranks(root, hf, cfg, ranks):
            who = f"init_from, rank {r['rank']} of {ranks}"
            print(f"{who:34} {r['seconds']:6.2f} {r['peak_rss'] / MB:11.0f} "
                  f"{(r['peak_rss'] - base) / MB:7.0f} {r['bytes_read'] / MB:8.1f} "
                  f"{r['bytes_read'] / r['source_bytes']:10.3f}")
    print(f"goal: read/model <= 1/ranks + 5% ({', '.join(f'{1 / n + 0.05:.3f} at {n}' for n in args.ranks)})")


def dcp_run(root: Path, cfg: dict) -> Path:
    """A run folder whose one step is a DCP of the model (fp32), as training saves it."""
    import torch
    import torch.distributed.checkpoint as dcp

    from hpc.core.models.llama import LlamaShape
    from trainer.models.llama import Llama

    run = make_run(root, "export", spec_sets(cfg, root / "unused"), 1)
    shape = LlamaShape(cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"],
                       cfg["num_key_value_heads"], cfg["intermediate_size"], 64, cfg["vocab_size"])
    torch.manual_seed(0)
    model = Llama(shape)
    step = run / "checkpoints" / "step-0000001"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(step), no_dist=True)
    return run


def dd(path: Path, src: Path, nbytes: int) -> float:
    """Seconds dd takes to write ``nbytes`` of ``src`` to ``path`` with fdatasync."""
    t = time.perf_counter()
    subprocess.run(["dd", f"if={src}", f"of={path}", "bs=1M", f"count={-(-nbytes // MB)}", "conv=fdatasync"],
                   capture_output=True, check=True)
    seconds = time.perf_counter() - t
    path.unlink()
    return seconds


def bench_export(root: Path, args: argparse.Namespace) -> None:
    """--to hf and safetensors.save_file against dd, then one profiled export."""
    run = dcp_run(root, config(args))
    step = run / "checkpoints" / "step-0000001"
    nbytes = sum(f.stat().st_size for f in step.glob("*.distcp"))
    (root / "random.src").write_bytes(os.urandom(-(-nbytes // MB) * MB))
    print(f"export: a DCP step of {nbytes / MB:.0f} MB (fp32) -> --to hf fp32, against dd of the same bytes")
    for name, code, target in (("hpcx export_hf", EXPORT, "out"), ("safetensors.save_file (stock)", SAVE_FILE,
                                                                    "out.safetensors")):
        ratios = []
        for _ in range(args.repeat):
            dd_s = dd(root / "dd.bin", root / "random.src", nbytes)
            r = child(code, str(run if name.startswith("hpcx") else step), str(root / target))
            ratios.append(dd_s / r["seconds"])
            shutil.rmtree(root / target, ignore_errors=True) if (root / target).is_dir() else (root / target).unlink()
        print(f"  {name:32} x dd best {max(ratios):.2f}, median {statistics.median(ratios):.2f} "
              f"(last: {r['seconds']:.2f} s, peak RSS {r['peak_rss'] / MB:.0f} MB)")
    profile(run, root / "profiled")


def profile(run: Path, dst: Path) -> None:
    """One export under cProfile: the time in reading, mapping, writing and fsync."""
    import cProfile
    import pstats

    from hpc.ckpt.hf import export_hf

    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.runcall(export_hf, run, dst)
    total = time.perf_counter() - t
    stats = pstats.Stats(prof)
    parts = {"read (DcpReader.read_into)": "read_into", "map (copy/cast/transpose)": "mapped",
             "write (file.write)": "<method 'write' of '_io.BufferedWriter' objects>", "fsync": "<built-in method posix.fsync>"}
    print(f"  where one export's {total:.2f} s go:")
    for label, needle in parts.items():
        cum = sum(v[3] for k, v in stats.stats.items() if needle in (k[2] if not needle.startswith("<") else k[2]))
        print(f"    {label:32} {cum:6.2f} s ({cum / total:.0%})")


def main() -> None:
    """Parse the options and run the parts asked for in a temporary folder."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--ranks", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--only", choices=("init", "export"), default=None)
    ap.add_argument("--dir", type=Path, default=None)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="hpcx-bench-hf-", dir=args.dir))
    try:
        if args.only in (None, "init"):
            bench_init(root, args)
        if args.only in (None, "export"):
            bench_export(root, args)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
