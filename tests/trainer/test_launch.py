"""Starting the trainer: torchrun, submitit, a single process, and rendezvous failures."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc.resolve import resolve, resolved_document
from hpc.site import load_site
from hpc.spec import load_spec
from trainer.dist import rendezvous_port
from trainer.metrics import PHASES
from trainer_testlib import REPO, TINY, child_env, make_run, read_losses, torchrun


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
                           "phases_s"}
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
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "trainer", str(run_dir)], env=env, capture_output=True,
                          text=True, timeout=60, cwd=REPO)
    assert proc.returncode != 0
    assert f"missing ranks: {missing}" in proc.stderr or f"ranks {missing} of 4 did not arrive" in proc.stderr, \
        proc.stderr[-2000:]
    assert time.monotonic() - start < 30


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
