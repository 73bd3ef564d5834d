"""The pre-flight check's collectives (``trainer.preflight``) on real multi-process gloo (torchrun, 2–4
ranks on this machine, each playing a node): every rank reaches the same verdict; a rank whose device
check fails (an injected hook) or that never posts names its node; the blamed ranks' failure reports are
written once, with ``node_fault`` and the ``preflight`` record the check after srun turns into the stop
line and the exclusion. The decisions themselves: tests/resilience/test_preflight_logic.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hpc.core import requeue
from hpc.core.site import parse_site
from tests.trainer.trainer_testlib import REPO, torchrun
from trainer.preflight import DRILL_HOST, device_problem, matmul_right

WORKER = str(REPO / "tests" / "resilience" / "preflight_worker.py")


def launch(tmp_path: Path, nproc: int, per_node: int, case: str) -> dict[int, dict]:
    proc = torchrun(nproc, [WORKER, str(tmp_path), str(per_node), case], timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in tmp_path.glob("rank-*.json")}


def reports(tmp_path: Path) -> dict[int, dict]:
    return {r["rank"]: r for r in requeue.failure_reports(tmp_path / "run", "77.0")}


def test_all_fine_every_rank_measures_and_agrees(tmp_path):
    found = launch(tmp_path, 4, 2, "fine")
    assert sorted(found) == [0, 1, 2, 3] and all(r["ok"] for r in found.values())
    verdicts = [r["verdict"] for r in found.values()]
    assert all(v == verdicts[0] for v in verdicts) and verdicts[0]["blamed"] == {}
    assert verdicts[0]["busbw_gbs"] > 0  # measured; a CPU site without figures only logs it
    assert verdicts[0]["shift"] == 2  # two nodes of two ranks: each rank shifted to the other node and back
    assert not (tmp_path / "run" / "requeue").exists()


def test_a_rank_whose_device_fails_names_its_node_and_only_its_nodes_ranks_report(tmp_path):
    found = launch(tmp_path, 4, 2, "device:3")
    assert sorted(found) == [0, 1, 2, 3] and not any(r["ok"] for r in found.values())
    assert {r["error"] for r in found.values()} == {"preflight: n2 failed: cpu matmul wrong (injected)"}
    assert all(r["reported"] for r in found.values())
    written = reports(tmp_path)
    assert sorted(written) == [2, 3]  # n2's ranks, written once by the lowest rank present
    for rank, report in written.items():
        assert report["host"] == "n2" and report["node_fault"] is True and report["repeats"] is False
        assert report["phase"] == "join" and report["error"] == "preflight: n2 failed: cpu matmul wrong (injected)"
        assert report["preflight"]["nodes"] == ["n2"] and report["preflight"]["lost_s"] > 0


def test_the_drill_hook_fails_the_node_it_names(tmp_path):
    found = launch(tmp_path, 3, 1, "drill:n1")
    assert {r["error"] for r in found.values()} == {f"preflight: n1 failed: cpu failed the drill ({DRILL_HOST}=n1)"}
    assert sorted(reports(tmp_path)) == [0]


@pytest.mark.parametrize("stuck,host", [(2, "n3"), (0, "n1")])  # rank 0 stuck: the others decide without it
def test_a_rank_that_never_posts_names_its_node(tmp_path, stuck, host):
    found = launch(tmp_path, 3, 1, f"stuck:{stuck}")
    assert sorted(found) == [0, 1, 2]  # the stuck rank, back late, takes the verdict the others posted
    assert {r["error"] for r in found.values()} == {
        f"preflight: {host} failed: rank {stuck} did not finish the check in time (stuck or gone)"}
    assert sorted(reports(tmp_path)) == [stuck] and reports(tmp_path)[stuck]["host"] == host


def test_switched_off_the_check_runs_nothing(tmp_path):
    found = launch(tmp_path, 2, 1, "off")
    assert [r["verdict"] for r in found.values()] == [None, None]


# ---------------------------------------------------------------- at scale: one rank reads 8000 results


def test_rank_0_decides_for_8000_ranks_and_the_others_take_its_verdict(tmp_path):
    """The store part of the check at 1000 nodes × 8 ranks (a real in-memory c10d store, the results of the
    other ranks posted as they would): rank 0 names the node of a failed GPU and writes its 8 ranks'
    reports; any other rank takes the posted verdict without reading the 8000 results."""
    import torch.distributed as dist

    from hpc.core.spec import spec_from_dict
    from trainer.preflight import decide

    store, world = dist.HashStore(), 8000
    for rank in range(1, world):
        host = f"n{rank // 8 + 1}"
        store.set(f"preflight/host/{rank}", host)
        bad = "cuda:3 matmul wrong" if rank == 8 * 411 + 3 else None
        store.set(f"preflight/dev/{rank}", json.dumps({"rank": rank, "host": host, "device": bad}))
    run = SimpleNamespace(spec=spec_from_dict({"health": {"preflight_timeout_s": 5}}), run_dir=tmp_path,
                          site=parse_site({"scheduler": {"kind": "slurm"}}, "t", "<test>"))
    guard = SimpleNamespace(side=SimpleNamespace(incarnation=lambda restart: "77.0"), restart=0, step=0)
    found, record = decide(run, store, "dev", {"rank": 0, "host": "n1", "device": None}, world, 2**20, guard)
    assert found.blamed == {"n412": "cuda:3 matmul wrong"} and record["nodes"] == ["n412"]
    written = requeue.failure_reports(tmp_path, "77.0")
    assert sorted(r["rank"] for r in written) == list(range(8 * 411, 8 * 412))
    assert all(r["node_fault"] and r["host"] == "n412" for r in written)
    store.delete_key("preflight/dev/1")  # rank 5 reads no results: it takes the verdict
    taken, again = decide(run, store, "dev", {"rank": 5, "host": "n1", "device": None}, world, 2**20, guard)
    assert taken == found and again == record


# ---------------------------------------------------------------- the site's figure at the check's size


def test_a_gpu_sites_all_reduce_figure_is_the_planners_nccl_model_at_a_few_mb():
    """At 4 MiB latency counts: NCCL's model (the planner's) gives less than the link's 450 GB/s over 64
    ranks, and more than the floor's quarter of it: the floor does not fail a good node for the size."""
    from hpc.plan.resolve import preflight_busbw as modelled_busbw

    doc = {"scheduler": {"kind": "slurm"}, "network": {"fabric": "infiniband", "bandwidth_gbs": 400, "latency_us": 5},
           "node": {"gpus": 8, "gpu_model": "NVIDIA H100 80GB HBM3", "gpu_memory_gb": 80, "intra_link": "nvswitch",
                    "intra_bandwidth_gbs": 450, "intra_latency_us": 3}}
    site = parse_site(doc, "h", "<test>")
    many = modelled_busbw(site, 64, 8, 4 * 2**20)
    assert 0.25 * 400 < many < 400 and modelled_busbw(site, 64, 8, 256 * 2**20) > many  # larger: nearer the link
    assert modelled_busbw(site, 8000, 8, 4 * 2**20) < many  # more hops of latency
    assert modelled_busbw(site, 1, 1, 4 * 2**20) == 0.0  # alone: nothing to tell
    cpu = parse_site({"scheduler": {"kind": "slurm"}}, "c", "<test>")
    assert modelled_busbw(cpu, 4, 2, 4 * 2**20) == 0.0  # no figures: only logged


def test_the_launch_carries_the_figure_from_resolve_so_the_trainer_needs_no_planner():
    """``hpc.plan.resolve`` decides it once (a GPU site, the check on); the trainer reads ``Launch``."""
    from hpc.core.resolve import Launch
    from hpc.core.site import load_site
    from hpc.core.spec import load_spec
    from hpc.plan.resolve import resolve

    job, site = str(REPO / "jobs" / "tiny-ddp.toml"), load_site("dgx-h100")
    gpus = resolve(load_spec(job, ("job.nodes=2", "train.global_batch=32")), site)
    assert gpus.preflight_busbw_gbs and 0 < gpus.preflight_busbw_gbs < 450
    assert Launch.from_dict(gpus.to_dict()).preflight_busbw_gbs == gpus.preflight_busbw_gbs  # resolved.json
    off = ("job.nodes=2", "train.global_batch=32", "health.preflight=false")
    assert resolve(load_spec(job, off), site).preflight_busbw_gbs is None
    assert resolve(load_spec(job), load_site("local")).preflight_busbw_gbs is None  # no GPUs: only logged
    older = {k: v for k, v in gpus.to_dict().items() if k != "preflight_busbw_gbs"}
    assert Launch.from_dict(older).preflight_busbw_gbs is None  # a run folder from before


# ---------------------------------------------------------------- this rank's device, in one process


def test_a_lone_rank_whose_device_fails_reports_its_node_itself(tmp_path):
    """One rank without a process group (the sandbox's one-node job): no store, the rank decides and
    writes its own report, as rank 0 would for the blamed ranks."""
    from hpc.core.preflight import PreflightFailed
    from hpc.core.spec import spec_from_dict
    from trainer.preflight import check_start

    run = SimpleNamespace(spec=spec_from_dict({}), run_dir=tmp_path,
                          site=parse_site({"scheduler": {"kind": "slurm"}}, "t", "<test>"))
    guard = SimpleNamespace(side=SimpleNamespace(incarnation=lambda restart: "77.0"), restart=0, step=0)
    with pytest.raises(PreflightFailed) as err:
        check_start(run, 0, "n4", torch.device("cpu"), guard, device_check=lambda d, n, h: "cpu matmul wrong")
    assert str(err.value) == "preflight: n4 failed: cpu matmul wrong" and err.value.reported
    (report,) = requeue.failure_reports(tmp_path, "77.0")
    assert report["host"] == "n4" and report["node_fault"] and report["preflight"]["nodes"] == ["n4"]
    assert check_start(run, 0, "n4", torch.device("cpu"), guard).ok  # the real check passes on this CPU


def test_the_cpu_device_check_passes_and_its_matmul_is_exact():
    node = parse_site({"scheduler": {"kind": "slurm"}}, "t", "<test>").node
    assert matmul_right(torch.device("cpu")) and device_problem(torch.device("cpu"), node, "n1") == ""


def test_the_drill_hook_names_only_its_host(monkeypatch):
    node = parse_site({"scheduler": {"kind": "slurm"}}, "t", "<test>").node
    monkeypatch.setenv(DRILL_HOST, "n7")
    assert device_problem(torch.device("cpu"), node, "n7") == f"cpu failed the drill ({DRILL_HOST}=n7)"
    assert device_problem(torch.device("cpu"), node, "n70") == ""
    monkeypatch.setenv(DRILL_HOST, "@first")
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")  # a task of a Slurm job: its job side counts restarts
    monkeypatch.setenv("SLURM_JOB_ID", "5")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    assert device_problem(torch.device("cpu"), node, "n2") == f"cpu failed the drill ({DRILL_HOST}=@first)"
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # the requeued start passes wherever it lands
    assert device_problem(torch.device("cpu"), node, "n2") == ""
    monkeypatch.delenv("SLURM_RESTART_COUNT")
    assert device_problem(torch.device("cpu"), node, "n2") != ""  # no count: a first start
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    monkeypatch.delenv("SUBMITIT_EXECUTOR")
    assert device_problem(torch.device("cpu"), node, "n2") != ""  # no scheduler started it: a first start


@pytest.mark.gpu
def test_the_gpu_device_check_passes_on_a_good_gpu_and_catches_memory_the_site_overstates():
    assert torch.cuda.is_available()
    doc = {"scheduler": {"kind": "slurm"}, "node": {"gpus": 1, "gpu_model": torch.cuda.get_device_name(0),
                                                    "gpu_memory_gb": torch.cuda.mem_get_info(0)[1] / 1e9}}
    node = parse_site(doc, "t", "<test>").node
    assert device_problem(torch.device("cuda", 0), node, "n1") == ""
    node.gpu_memory_gb *= 2
    assert "expected" in device_problem(torch.device("cuda", 0), node, "n1")
    assert device_problem(torch.device("cuda", torch.cuda.device_count()), node, "n1").endswith("not visible")


# ---------------------------------------------------------------- the rank's failure handler


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_leaves_the_preflight_reports_as_written_and_reports_other_failures(run_dir, slurm_side, rank):
    from hpc.core.preflight import PreflightFailed
    from hpc.core.spec import Checkpoint
    from trainer.resilience import Resilience

    guard = Resilience(run_dir=run_dir, policy=Checkpoint(), max_requeues=3, seed=0, rank=rank, side=slurm_side,
                       phase="join")
    guard.failed(PreflightFailed("preflight: n2 failed: cuda:3 matmul wrong", reported=True))
    assert requeue.failure_reports(run_dir, "424242.1") == []  # the check wrote the blamed ranks' already
    guard.failed(PreflightFailed("preflight: every node failed (e.g. cuda:0 not visible): not one node's fault"))
    (report,) = requeue.failure_reports(run_dir, "424242.1")
    assert report["rank"] == rank and report["repeats"] is False and not report.get("node_fault")


# ---------------------------------------------------------------- end to end on the local site


@pytest.mark.slow
def test_a_local_job_whose_node_fails_the_check_never_trains_and_the_ledger_says_preflight(run_root):
    """The `local` site (submitit's controller; rank 0 decides): the drill hook names this machine, so every
    start fails its check; the first is requeued, the second (no progress) is not; nothing trained."""
    import socket

    from tests.conftest import hpcx
    from tests.resilience.resilience_lib import ledger

    out = hpcx("submit", str(REPO / "jobs" / "tiny-ddp.toml"), "--set", f"job.run_root={json.dumps(str(run_root))}",
               "--set", "train.steps=4", "--set", "job.max_requeues=3", "--set",
               f"env.set.PREFLIGHT_DRILL_FAIL_HOST={socket.gethostname()}", "--wait", timeout=600)
    run_dir = next(run_root.iterdir())
    stops = ledger(run_dir)
    assert [e["event"] for e in stops] == ["stop", "stop"], out.stdout + out.stderr  # no start line: never trained
    words = f"preflight: {socket.gethostname()} failed: cpu failed the drill (PREFLIGHT_DRILL_FAIL_HOST="
    assert all(e["error"].startswith(words) and e["preflight"]["nodes"] == [socket.gethostname()] for e in stops)
    assert stops[0]["requeued"] and stops[1]["not_requeued"] == "failed twice at step 0 without progress"
    assert stops[0]["node_fault"] and set(stops[0]["failed_ranks"]) <= {0, 1}  # the first report rank 0 read
    assert not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text().strip()
    status = json.loads(hpcx("status", str(run_dir), "--json").stdout)
    assert status["state"] == "FAILED" and status["last_stop"]["preflight"]["nodes"] == [socket.gethostname()]
    assert status["goodput"]["seconds"]["preflight"] > 0
