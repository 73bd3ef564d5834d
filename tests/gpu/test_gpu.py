"""GPU-only behaviour, skipped where CUDA is absent (the `gpu` marker; tests/conftest.py skips it).

What a CPU can reach (rank detection, GPU index arithmetic, launch parameters, requeue decisions,
cancel) is tested for real elsewhere; these check the parts only a GPU shows.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from tests.trainer.trainer_testlib import child_env

pytestmark = pytest.mark.gpu
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
TWO_GPUS = pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")


def gpu_site(gpus: int) -> dict:
    return {"scheduler": {"kind": "local", "gpu_directive": "none"},
            "node": {"gpus": gpus, "gpu_memory_gb": 16, "cpus": 4, "intra_link": "pcie" if gpus > 1 else "none"},
            "network": {"fabric": "none"}}


def gpu_run(root: Path, name: str, gpus: int, overrides: list[str]) -> Path:
    from hpc.core.resolve import resolved_document
    from hpc.plan.resolve import resolve
    from hpc.core.site import parse_site
    from hpc.core.spec import load_spec

    spec = load_spec(REPO / "jobs" / "tiny-ddp.toml", ["train.steps=6", "train.log_every=1", *overrides])
    site = parse_site(gpu_site(gpus), "gpu-test", "<gpu-test>")
    run = root / name
    (run / "logs").mkdir(parents=True)
    (run / "resolved.json").write_text(json.dumps(resolved_document(spec, site, resolve(spec, site), str(run))))
    return run


def env_with(**extra: str) -> dict[str, str]:
    return {**child_env(), **extra}


def test_the_only_visible_gpu_is_used_whatever_the_local_rank():
    code = ("from trainer.dist import device_for; d = device_for('nccl', 5, 8); "
            "import torch; print(d, torch.cuda.current_device())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                         env=env_with(CUDA_VISIBLE_DEVICES=str(GPUS - 1)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["cuda:0", "0"]


@TWO_GPUS
def test_each_local_rank_takes_its_own_gpu_when_all_are_visible():
    code = "from trainer.dist import device_for; print(device_for('nccl', 1, 2))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                         env=env_with(CUDA_VISIBLE_DEVICES="0,1"))
    assert out.stdout.strip() == "cuda:1", out.stderr


def test_the_step_boundary_vote_never_syncs_the_gpu(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO / "tests" / "gpu" / "gpu_worker.py"), "vote", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300, env=env_with())
    assert out.returncode == 0, out.stderr[-3000:]
    for rank in (0, 1):
        agreed = json.loads((tmp_path / f"rank-{rank}.json").read_text())["agreed"]
        assert [a[0] for a in agreed] == [0, 0, 0, 1, 0, 0]  # rank 1's flag of boundary 2, read at 3


def test_a_local_gpu_site_runs_its_job_on_the_gpu(tmp_path):
    spec = tmp_path / "job.toml"
    spec.write_text((REPO / "jobs" / "tiny-ddp.toml").read_text())
    sites = tmp_path / "sites"
    sites.mkdir()
    (sites / "ws.toml").write_text('[scheduler]\nkind = "local"\ngpu_directive = "none"\n[node]\ngpus = 1\n'
                                   'gpu_memory_gb = 16\ncpus = 4\n[storage]\nrun_root = "%s"\n' % (tmp_path / "runs"))
    env = {k: v for k, v in env_with(HPCX_SITE_PATH=str(sites)).items() if k != "CUDA_VISIBLE_DEVICES"}
    out = subprocess.run([sys.executable, "-m", "hpc.cli", "submit", str(spec), "--site", "ws", "--set",
                          "train.steps=4", "--set", "parallel.strategy='none'", "--set", "train.global_batch=2",
                          "--wait"], capture_output=True, text=True, cwd=REPO, timeout=600, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    run = Path(next(ln.split(": ", 1)[1] for ln in out.stdout.splitlines() if ln.startswith("run folder:")))
    assert "4 steps" in out.stdout
    assert json.loads((run / "world.json").read_text())["world_size"] == 1
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["mem_gb"] > 0  # torch.cuda.max_memory_allocated: it ran on the GPU


@TWO_GPUS
def test_dp_drives_every_gpu_of_the_node_from_one_process(tmp_path):
    run = gpu_run(tmp_path, "dp", 2, ["parallel.strategy='dp'", "train.global_batch=4", "train.micro_batch=4"])
    launch = json.loads((run / "resolved.json").read_text())["launch"]
    assert (launch["tasks_per_node"], launch["gpus_per_node"]) == (1, 2)
    out = subprocess.run([sys.executable, "-m", "trainer", str(run)], capture_output=True, text=True, cwd=REPO,
                         timeout=600, env=env_with(CUDA_VISIBLE_DEVICES="0,1"))
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["strategy"] == "dp" and result["steps"] == 6 and result["final_loss"] == result["final_loss"]


@TWO_GPUS
def test_a_collective_that_times_out_leaves_the_flight_recorder_dump(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO / "tests" / "gpu" / "gpu_worker.py"), "timeout", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300,
                         env=env_with(CUDA_VISIBLE_DEVICES="0,1"))
    assert out.returncode != 0  # the watchdog ended rank 0 (torchrun then ends rank 1)
    # the short timeout (5 s) fired, not the long one (60 s): the watchdog names the one it applied
    assert "Timeout(ms)=5000)" in out.stderr and "Timeout(ms)=60000)" not in out.stderr, out.stderr[-3000:]
    dumps = list((tmp_path / "nccl-trace").glob("rank-*"))
    assert dumps, f"no flight recorder dump in {tmp_path / 'nccl-trace'}: {out.stderr[-2000:]}"
