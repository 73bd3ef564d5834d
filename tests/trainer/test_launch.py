"""Starting the trainer: torchrun, submitit, a single process, and rendezvous failures."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hpc.core.resolve import resolved_document
from hpc.plan.resolve import resolve
from hpc.core.site import load_site
from hpc.core.spec import load_spec
from hpc.schedulers.base import rendezvous_port
from trainer.metrics import PHASES
from trainer_testlib import REPO, TINY, child_env, make_run, torchrun


def tiny_ddp_run(root: Path, overrides: list[str] = ()) -> Path:
    """jobs/tiny-ddp.toml on the `local` site, resolved exactly as `hpcx submit` would."""
    spec = load_spec(TINY, ["train.steps=6", *overrides])
    site = load_site("local")
    run_dir = root / "tiny-ddp"
    run_dir.mkdir()
    doc = resolved_document(spec, site, resolve(spec, site), str(run_dir))
    (run_dir / "resolved.json").write_text(json.dumps(doc))
    return run_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_port_comes_from_the_job_id():
    assert rendezvous_port("4242") == 24242
    assert rendezvous_port("123456_7") == 20000 + 1234567 % 20000
    assert rendezvous_port("4242") != rendezvous_port("4243")


def test_task_module_does_not_import_torch():
    code = "import sys, pickle, trainer.task as t; pickle.dumps(t.TrainTask('/x')); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.slow
def test_torchrun_two_ranks(tmp_path):
    run_dir = tiny_ddp_run(tmp_path)
    proc = torchrun(2, ["-m", "trainer", str(run_dir)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["world_size"] == 2 and result["strategy"] == "ddp" and result["steps"] == 6
    world = json.loads((run_dir / "world.json").read_text())
    assert world == {"world_size": 2, "all_reduce": 2, "hosts": [socket.gethostname()] * 2, "backend": "gloo"}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 6]  # default log_every 10: the end of warm-up (2), the last step
    record = records[-1]
    assert set(record) == {"step", "loss", "lr", "tokens_per_s", "step_time_s", "data_s", "mfu", "mem_gb", "grad_norm",
                           "phases_s", "start", "padding_fraction", "real_tokens_per_s"}
    assert record["padding_fraction"] == 0 and record["real_tokens_per_s"] == record["tokens_per_s"]  # synthetic
    assert record["step"] == 6 and set(record["phases_s"]) == set(PHASES)
    assert sum(record["phases_s"].values()) == pytest.approx(record["step_time_s"])
    for rank in (0, 1):
        assert "all_reduce(1) = 2" in (run_dir / "logs" / f"rank-{rank}.log").read_text()


@pytest.mark.slow
def test_torchrun_at_another_world_size_refits_the_launch(tmp_path):
    run_dir = make_run(tmp_path, "fsdp", "fsdp", 2, ["train.steps=3"])
    proc = torchrun(4, ["-m", "trainer", str(run_dir)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["world_size"] == 4
    assert "resolved for 2 ranks, started with 4: fsdp full_shard (sharded over 4 ranks)" in \
        (run_dir / "logs" / "rank-0.log").read_text()


@pytest.mark.parametrize("rank,missing", [(0, "[1, 2, 3]"), (1, "[0]")])
def test_rendezvous_timeout_names_missing_ranks(tmp_path, rank, missing):
    run_dir = make_run(tmp_path, "ddp", "ddp", 2, ["parallel.timeout_s=3"])
    env = child_env() | {"RANK": str(rank), "WORLD_SIZE": "4", "LOCAL_RANK": str(rank),
                         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    proc = subprocess.run([sys.executable, "-m", "trainer", str(run_dir)], env=env, capture_output=True,
                          text=True, timeout=300, cwd=REPO)
    assert proc.returncode != 0
    assert f"missing ranks: {missing}" in proc.stderr or f"ranks {missing} of 4 did not arrive" in proc.stderr, \
        proc.stderr[-2000:]
    assert "within 3 s" in proc.stderr or "timed out after 3 s" in proc.stderr  # parallel.timeout_s ended it


@pytest.mark.slow
def test_submitit_local_executor_runs_the_task(tmp_path):
    import submitit

    from trainer.task import TrainTask

    run_dir = tiny_ddp_run(tmp_path, ["train.steps=3"])
    executor = submitit.LocalExecutor(folder=tmp_path / "submitit")
    executor.update_parameters(tasks_per_node=2, nodes=1, timeout_min=5)
    job = executor.submit(TrainTask(str(run_dir)))
    results = job.results()
    assert results[0]["world_size"] == 2 and results[0]["steps"] == 3 and results[1] is None
    assert json.loads((run_dir / "world.json").read_text())["all_reduce"] == 2


def test_preemption_signal_only_sets_a_flag():
    import os
    import signal

    from trainer.preemption import PreemptionFlag

    previous = signal.getsignal(signal.SIGUSR2)
    try:
        flag = PreemptionFlag().install()
        assert not flag.requested
        os.kill(os.getpid(), signal.SIGUSR2)
        assert flag.requested and flag.agreed(torch_cpu())
    finally:
        signal.signal(signal.SIGUSR2, previous)


def torch_cpu():
    import torch

    return torch.device("cpu")


def test_train_state_round_trip():
    from trainer.loop import TrainState

    state = TrainState(step=7, tokens_seen=7 * 512, sampler={"consumed_samples": 56, "epoch": 1})
    other = TrainState()
    other.load_state_dict({**state.state_dict(), "meta": {}, "rng_restored": True})
    assert other == state


# ---------------------------------------------------------------- which rank am I, on which GPU

RECORDED = REPO / "tests" / "data" / "recorded"


def recorded_env(name: str) -> dict[str, str]:
    """A task's SLURM_* variables as the sandbox's Slurm set them (tests/data/recorded/SOURCES.md)."""
    text = (RECORDED / f"slurm-22.05-env_{name}_2node-2task.txt").read_text()
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def test_a_plain_srun_task_reads_slurms_step_variables():
    from hpc.schedulers.slurm.ranks import srun_env

    first, last = srun_env(recorded_env("srun-task0")), srun_env(recorded_env("srun-task3"))
    assert (first.rank, first.local_rank, first.world_size, first.local_world_size) == (0, 0, 4, 2)
    assert (last.rank, last.local_rank, last.world_size, last.local_world_size) == (3, 1, 4, 2)
    assert first.master_addr == last.master_addr == "n1" and first.master_port == last.master_port
    assert first.launcher == "srun" and first.master_port == rendezvous_port("2350")


def test_srun_variables_that_are_missing_or_do_not_fit_are_refused():
    from hpc.schedulers.slurm.ranks import srun_env

    env = recorded_env("srun-task3")
    for missing in ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_TASKS_PER_NODE"):
        with pytest.raises(RuntimeError, match=f"without {missing}"):
            srun_env({k: v for k, v in env.items() if k != missing})
    with pytest.raises(RuntimeError, match="do not fit"):
        srun_env({**env, "SLURM_PROCID": "4"})
    with pytest.raises(RuntimeError, match="do not parse"):
        srun_env({**env, "SLURM_STEP_TASKS_PER_NODE": "lots"})
    assert srun_env({**env, "MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "29999"}).master_port == 29999


@pytest.mark.parametrize("name,extra,launcher,world", [
    ("srun-task3", {}, "srun", 4),
    ("batch-step", {}, "single", 1),  # the batch script: SLURM_PROCID=0 and SLURM_NTASKS=4, but one process
    ("srun-task3", {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}, "torchrun", 2),  # torchrun inside srun
])
def test_launchers_are_told_apart(monkeypatch, name, extra, launcher, world):
    from trainer.dist import detect_rank_env

    for key in [k for k in os.environ if k.startswith(("SLURM_", "SUBMITIT_")) or k in ("RANK", "WORLD_SIZE")]:
        monkeypatch.delenv(key)
    for key, value in {**recorded_env(name), **extra}.items():
        monkeypatch.setenv(key, value)
    env = detect_rank_env()
    assert (env.launcher, env.world_size) == (launcher, world)


def test_a_plain_srun_task_is_slurms_to_requeue(monkeypatch):
    from hpc import schedulers

    for key in [k for k in os.environ if k.startswith(("SLURM_", "SUBMITIT_", "HPCX_"))]:
        monkeypatch.delenv(key)
    for key, value in recorded_env("srun-task0").items():
        monkeypatch.setenv(key, value)
    side = schedulers.job_side()
    assert side.kind == "slurm" and side.job_id() == "235" and not side.decides_failures
    monkeypatch.setenv("RANK", "0")
    assert schedulers.job_side() is None  # torchrun started it
    for key in recorded_env("srun-task0"):
        monkeypatch.delenv(key)
    monkeypatch.delenv("RANK")
    assert schedulers.job_side() is None


@pytest.mark.parametrize("local_rank,local_world,visible,index", [
    (0, 1, 1, 0), (5, 8, 1, 0),  # Slurm bound one GPU to each task (--gpus-per-task=1, --gpu-bind)
    (5, 8, 8, 5), (3, 4, 8, 3),  # every task sees the node's GPUs
    (0, 1, 8, 0),  # dp: one process, every GPU (DataParallel spreads from cuda:0)
])
def test_gpu_index(local_rank, local_world, visible, index):
    from trainer.dist import gpu_index

    assert gpu_index(local_rank, local_world, visible) == index


@pytest.mark.parametrize("local_rank,local_world,visible", [(0, 2, 0), (5, 8, 4), (2, 4, 2), (7, 8, 3)])
def test_gpu_index_refuses_to_share_or_guess(monkeypatch, local_rank, local_world, visible):
    from trainer.dist import gpu_index

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(visible))))
    with pytest.raises(ValueError, match=f"sees {visible} GPU.*expected 1 .* or at least {local_world}"):
        gpu_index(local_rank, local_world, visible)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message where CUDA sees no GPU")
def test_a_gpu_site_without_visible_gpus_names_cuda_visible_devices(monkeypatch):
    from trainer.dist import device_for

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(RuntimeError, match="CUDA_VISIBLE_DEVICES='' hides them"):
        device_for("nccl", 0, 2)
    assert device_for("gloo", 1, 2).type == "cpu"


def test_nccl_flight_recorder_dumps_into_the_run_folder(tmp_path, monkeypatch):
    from trainer.dist import apply_nccl_trace, nccl_trace_env

    env = nccl_trace_env(tmp_path)
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and int(env["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == env["TORCH_FR_DUMP_TEMP_FILE"] == f"{tmp_path}/nccl-trace/rank-"
    for name in env:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "50")  # the user's own value wins
    apply_nccl_trace(tmp_path)
    assert (tmp_path / "nccl-trace").is_dir() and os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "50"
    assert os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == f"{tmp_path}/nccl-trace/rank-"


# ---------------------------------------------------------------- signals before the handler, votes, timeouts


HOLD_PROBE = """
import os, signal, sys, time
from trainer.entry import hold_signals
hold_signals()
os.kill(os.getpid(), signal.SIGUSR2)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.2)  # both wait, pending, instead of killing the process or being dropped
from trainer.preemption import PreemptionFlag
flag = PreemptionFlag().install()
print(flag.requested, flag.terminated, flush=True)
"""


def test_signals_that_come_before_the_handler_wait_for_it():
    out = subprocess.run([sys.executable, "-c", HOLD_PROBE], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"]


TASK_PROBE = """
import sys
print("started", flush=True)  # past the task command, no handler of ours yet: the test signals now
sys.stdin.readline()  # ... and says when it has
from trainer.preemption import PreemptionFlag
flag = PreemptionFlag().install()  # unblocking runs the handlers of what was pending
print(flag.requested, flag.terminated, flush=True)
"""


def started_task(cmd: list[str], env: dict) -> subprocess.Popen:
    """TASK_PROBE under ``cmd``, once it says it started (a slow start is waited for, never raced)."""
    proc = subprocess.Popen([*cmd, sys.executable, "-c", TASK_PROBE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, cwd=REPO, env=env)
    assert proc.stdout.readline() == "started\n"
    return proc


@pytest.mark.parametrize("env_blocks", [True, False])
def test_the_task_command_keeps_signals_that_come_before_any_python(tmp_path, env_blocks):
    """The rendered task command: USR2 and SIGTERM sent before the handler (the task tells when it has
    started) wait for it (coreutils' env blocks them across the exec, as they are before any Python line
    runs), or, where env cannot, USR2 at least does not kill the task."""
    import signal

    from hpc.schedulers.base import TASK_WRAPPER

    path = os.environ["PATH"]
    if not env_blocks:  # an env without --block-signal (coreutils < 8.31, busybox)
        (tmp_path / "env").write_text('#!/bin/sh\ncase "$1" in --block-signal*) exit 125;; esac\nexec /usr/bin/env "$@"\n')
        (tmp_path / "env").chmod(0o755)
        path = f"{tmp_path}:{path}"
    proc = started_task(TASK_WRAPPER, {**child_env(), "PATH": path})
    proc.send_signal(signal.SIGUSR2)
    if env_blocks:
        proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate("go\n", timeout=60)
    assert proc.returncode == 0
    assert out.split() == (["True", "True"] if env_blocks else ["False", "False"])


def test_without_the_task_command_an_early_usr2_kills():
    import signal

    proc = started_task([], child_env())
    proc.send_signal(signal.SIGUSR2)
    proc.communicate("go\n", timeout=60)
    assert proc.returncode == -signal.SIGUSR2


@pytest.mark.slow
def test_votes_agree_one_boundary_late_and_timeouts_shorten_after_the_first_step(tmp_path):
    proc = torchrun(2, [str(REPO / "tests" / "trainer" / "collective_worker.py"), str(tmp_path)], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    for report in reports:
        # rank 1 raised flag 0 at boundary 3: every rank acts on it at boundary 4, and each one after
        assert report["votes"]["flag0"] == [4, 5, 6, 7, 8]
        assert report["votes"]["flag1"] == [6]  # rank 0's flag of boundary 5 alone, read at boundary 6
        assert report["groups"] == 2  # the default group and the side group (no mesh on this model)
    late, cut = reports[0]["late_in_a_save"], reports[0]["late_mid_run"]
    assert late["ok"] and late["value"] == 2.0 and late["waited_s"] >= 4  # rank 1 came 4 s after rank 0 waited
    assert not cut["ok"] and "Timed out waiting 2000ms" in cut["error"], cut  # the short timeout, not the 60 s
