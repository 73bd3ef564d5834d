"""Every benchmark under bench/ still runs, at its smallest size: a bench is a script that only a person
runs, so a change inside the trainer (the task seam broke bench/trainer_overhead's stand-in
``Resilience`` once, unnoticed) must fail here, not on the day someone measures. Each bench runs as
users run it (``python bench/NAME/run.py ARGS``, from a bare checkout's folder) and must end with exit
0 and print its result line. Only that: the figures are timings, which tests never check.

bench/gpu_check (tests/test_gpu_check.py) and bench/dryrun (its 70B cases take minutes; tests/test_dryrun.py
builds the same models) are tested where they are; bench/container_start submits jobs to the Slurm sandbox in
its image, so it runs at its smallest size in tests/slurm/test_container_slurm.py, whose fixtures know whether
the sandbox and its images are there.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow

# (bench script, smallest arguments, a piece of its result line)
BENCHES = [
    ("trainer_overhead/run.py", ["--size", "tiny", "--steps", "4", "--warmup", "2", "--strategies", "none,ddp"],
     "max |loss hpcx - hand|"),
    ("log_every/run.py", ["--size", "tiny", "--steps", "4", "--warmup", "2"], "ratio default / every-step"),
    ("data_step/run.py", ["--size", "tiny", "--steps", "3", "--warmup", "1", "--rounds", "1"], "manifest / synthetic"),
    ("step_vote/run.py", ["--steps", "10"], "async"),
    ("float_math/run.py", ["--size", "tiny", "--train-steps", "2", "--reps", "1"], "fused AdamW step"),
    # dim 256: the smallest whose projections NF4 blocks whole (16,384 weights), for the nf4 base
    ("lora_memory/run.py", ["--dim", "256", "--layers", "2", "--rank", "4", "--micro-batch", "1"], "base nf4 / fp32"),
    ("activation_memory/run.py", ["--micro-batch", "1"], "bf16-weights"),
    ("optimizer_step/run.py", ["--size", "tiny", "--steps", "2"], "FSDP2 + CPU offload"),
    ("checkpoint/run.py", ["--size-mb", "8", "--repeat", "1"], "async pause"),
    ("checkpoint/step_impact.py", ["--size-mb", "8", "--repeat", "1"], "goal: thread"),
    ("convert/run.py", ["--size-mb", "8", "--largest-mb", "2", "--repeat", "1"], "goals:"),
    ("data_prepare/run.py", ["--mb", "1", "--repeat", "1"], "peak RSS"),
    ("rendezvous/run.py", ["--worlds", "8", "--reps", "1"], "ratio"),
    ("hf/run.py", ["--dim", "128", "--layers", "2", "--vocab", "512", "--ranks", "2", "--repeat", "1"], "fsync"),
    ("init_memory/run.py", ["--sizes", "tiny", "--ranks", "2", "--old", "tiny"], "peak RSS meta / old"),
    ("cli_latency/run.py", ["--runs", "2", "--run-folders", "3"], "pass"),
    ("packing/run.py", ["--examples", "16", "--seq-len", "64", "--dim", "32", "--layers", "1", "--rounds", "1",
                        "--micro-batch", "2"], "packed / unpacked real tokens/s"),
]


def test_every_bench_is_listed():
    scripts = {str(p.relative_to(REPO / "bench")) for p in (REPO / "bench").glob("*/*.py")
               if p.name in ("run.py", "step_impact.py")}
    listed = {b for b, _, _ in BENCHES} | {"gpu_check/run.py", "dryrun/run.py", "container_start/run.py"}
    assert scripts == listed


@pytest.mark.parametrize("script,args,result", BENCHES, ids=[b for b, _, _ in BENCHES])
def test_the_bench_runs_at_its_smallest_size(tmp_path, script, args, result):
    out = subprocess.run([sys.executable, str(REPO / "bench" / script), *args], capture_output=True, text=True,
                         timeout=600, cwd=tmp_path)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert result in out.stdout + out.stderr, out.stdout[-3000:]
