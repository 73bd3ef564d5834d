"""The pre-flight check's decisions (``hpc.core.preflight``): bus bandwidth, the site's figures, the floors,
and which node to blame from every rank's results, up to 1000 nodes × 8 ranks. Torch-free and pure; the
collectives themselves run in tests/resilience/test_preflight.py."""

from __future__ import annotations

import pytest

from hpc.core import preflight as pf
from hpc.core.config import ConfigError
from hpc.core.preflight import Expected
from hpc.core.spec import spec_from_dict

MB4 = 4 * 2**20


def ranks(speeds: list[float], per: int = 1, allreduce_s: float = 0.001, names: list[str] | None = None) -> list[dict]:
    """Every rank's results on a ring of nodes whose links run at ``speeds`` (GB/s per rank, one per node):
    a transfer between two nodes runs at the slower one's speed."""
    n = len(speeds)
    hosts = names or [f"n{k + 1}" for k in range(n)]
    out = []
    for k in range(n):
        fwd, bwd = min(speeds[k - 1], speeds[k]), min(speeds[(k + 1) % n], speeds[k])
        out += [{"rank": k * per + i, "host": hosts[k], "device": None, "allreduce_s": allreduce_s,
                 "fwd_gbs": fwd, "bwd_gbs": bwd} for i in range(per)]
    return out


LINK = Expected(allreduce_gbs=0.0, link_gbs=4.0)  # floor 1.0 at the default fraction


# ---------------------------------------------------------------- formulas


@pytest.mark.parametrize("nbytes,seconds,world,gbs", [
    (10**9, 1.0, 2, 1.0),  # 2(n-1)/n = 1
    (10**9, 1.0, 8, 1.75),
    (10**9, 0.5, 4, 3.0),
    (MB4, 0.001, 16, MB4 / 1e6 * 30 / 16),
    (10**9, 1.0, 1, 0.0),  # alone: no bus
    (10**9, 0.0, 4, 0.0),  # no time measured
])
def test_bus_bandwidth_is_nccl_tests_formula(nbytes, seconds, world, gbs):
    assert pf.bus_bandwidth(nbytes, seconds, world) == pytest.approx(gbs)


@pytest.mark.parametrize("gpus,intra,network,nodes,local,want", [
    (8, 450.0, 50.0, 1, 8, Expected(450.0, 0.0)),  # one node: its own links
    (8, 450.0, 50.0, 4, 8, Expected(50.0, 50.0 / 8)),  # across nodes: the slower, and each rank's share
    (8, 40.0, 400.0, 2, 8, Expected(40.0, 50.0)),  # a PCIe node slower than its fabric
    (0, 0.0, 0.0, 1, 4, Expected(0.0, 0.0)),  # a CPU site without figures: only logged
    (0, 0.0, 12.5, 2, 1, Expected(12.5, 12.5)),  # a CPU site that says its fabric
    (8, 450.0, 50.0, 1, 1, Expected(0.0, 0.0)),  # one rank on a node: no bus inside it
    (8, 450.0, 0.0, 3, 8, Expected(0.0, 0.0)),  # fabric unknown
])
def test_the_sites_figures_for_a_job(gpus, intra, network, nodes, local, want):
    assert pf.expected(gpus, intra, network, nodes, local) == want


@pytest.mark.parametrize("total,expected_gb,bad", [
    (85_000_000_000, 80.0, False),  # an "80 GB" H100 reports more than 80e9 bytes
    (75_000_000_000, 80.0, False),  # within 10 %
    (70_000_000_000, 80.0, True),
    (40_000_000_000, 80.0, True),  # the 40 GB card where the site says 80
    (1, 0.0, False),  # unknown memory: no check
])
def test_a_gpus_memory_against_the_site(total, expected_gb, bad):
    words = pf.memory_problem(total, expected_gb)
    assert bool(words) is bad
    if bad:
        assert words.startswith(f"memory {total / 1e9:.1f} GB, expected {expected_gb:g} GB")


@pytest.mark.parametrize("hosts,peers", [
    (["a", "a", "b", "b"], (2, 2)),
    (["a", "b", "c"], (1, 3)),
    (["a", "a", "a", "a"], None),  # one node: no shift across nodes
    (["a", "b", "a", "b"], None),  # not in blocks
    (["a", "a", "b"], None),  # unequal blocks
    ([], None),
])
def test_shifts_need_equal_blocks_over_several_nodes(hosts, peers):
    assert pf.shift_peers(hosts) == peers


def test_a_node_receives_what_its_slowest_rank_gets_from_its_better_neighbour():
    results = [{"rank": 0, "host": "a", "fwd_gbs": 1.0, "bwd_gbs": 3.0}, {"rank": 1, "host": "a", "fwd_gbs": 2.0,
                                                                          "bwd_gbs": 0.5},
               {"rank": 2, "host": "b", "fwd_gbs": 4.0, "bwd_gbs": 4.0}, {"rank": 3, "host": "c"}]
    assert pf.node_receive(results) == {"a": 2.0, "b": 4.0}


# ---------------------------------------------------------------- device failures and stuck ranks


def test_all_fine_is_ok_and_reports_the_bus_bandwidth():
    found = pf.verdict(ranks([4.0] * 3, per=2, allreduce_s=0.01), {}, LINK, 0.25, 2, MB4)
    assert found.ok and not found.blamed and not found.warning
    assert found.busbw_gbs == pytest.approx(round(MB4 / 0.01 / 1e9 * 10 / 6, 3))


def test_a_failed_device_names_its_node_and_what_failed():
    results = ranks([4.0] * 4, per=2)
    results[5]["device"] = "cuda:1 matmul wrong"
    found = pf.verdict(results, {}, LINK, 0.25, 2)
    assert not found.ok and found.blamed == {"n3": "cuda:1 matmul wrong"}
    assert found.words() == "preflight: n3 failed: cuda:1 matmul wrong"
    assert pf.blamed_ranks(results, {}, found) == [4, 5]


def test_several_failed_devices_on_one_node_name_it_once_with_its_first():
    results = ranks([4.0] * 2, per=4)
    results[6]["device"], results[5]["device"] = "cuda:2 not visible", "cuda:1 memory 40.0 GB, expected 80 GB"
    assert pf.verdict(results, {}, LINK, 0.25, 2).blamed == {"n2": "cuda:1 memory 40.0 GB, expected 80 GB"}


def test_failed_devices_on_more_nodes_than_may_be_excluded_name_the_first_ones():
    results = ranks([4.0] * 6)
    for r in (4, 1, 2):
        results[r]["device"] = f"cuda:0 bad on n{r + 1}"
    assert list(pf.verdict(results, {}, LINK, 0.25, 2).blamed) == ["n2", "n3"]
    assert list(pf.verdict(results, {}, LINK, 0.25, 0).blamed) == ["n2"]  # 0: the node is still named


def test_a_rank_that_posted_nothing_names_its_node():
    results = [r for r in ranks([4.0] * 3, per=2) if r["rank"] != 3]
    found = pf.verdict(results, {3: "n2"}, LINK, 0.25, 2)
    assert found.blamed == {"n2": "rank 3 did not finish the check in time (stuck or gone)"}
    assert pf.blamed_ranks(results, {3: "n2"}, found) == [2, 3]


def test_a_failed_device_comes_before_a_stuck_rank_when_only_one_is_named():
    results = [r for r in ranks([4.0] * 3) if r["rank"] != 2]
    results[1]["device"] = "cuda:0 matmul wrong"
    assert list(pf.verdict(results, {2: "n3"}, LINK, 0.25, 1).blamed) == ["n2"]


def test_a_collective_that_failed_on_some_ranks_names_their_node():
    results = ranks([4.0] * 3)
    results[0]["error"] = "all-reduce did not complete: timed out"
    results[0]["allreduce_s"] = None
    assert pf.verdict(results, {}, LINK, 0.25, 2).blamed == {"n1": "all-reduce did not complete: timed out"}


def test_every_node_failing_its_devices_is_no_nodes_fault():
    results = ranks([4.0] * 3)
    for r in results:
        r["device"] = "cuda:0 not visible"
    found = pf.verdict(results, {}, LINK, 0.25, 5)
    assert not found.ok and found.failed and not found.blamed and "not one node's fault" in found.warning


def test_the_only_node_failing_its_device_is_to_blame():
    results = ranks([4.0], per=4)
    results[2]["device"] = "cuda:2 matmul wrong"
    assert pf.verdict(results, {}, LINK, 0.25, 2).blamed == {"n1": "cuda:2 matmul wrong"}


# ---------------------------------------------------------------- bandwidth


def test_a_slow_node_is_named_with_its_figure_and_the_floor():
    found = pf.verdict(ranks([4.0, 4.0, 0.3, 4.0], per=2), {}, LINK, 0.25, 2)
    assert found.blamed == {"n3": "receives 0.3 GB/s, expected ≥ 1 GB/s of 4 GB/s from its neighbours"}


def test_the_neighbours_of_a_slow_node_are_not_blamed():
    found = pf.verdict(ranks([4.0, 4.0, 0.3, 4.0, 4.0]), {}, LINK, 0.25, 5)
    assert list(found.blamed) == ["n3"]


def test_a_slow_link_between_two_nodes_blames_neither():
    results = ranks([4.0] * 4)
    results[2]["fwd_gbs"] = 0.1  # only n2 → n3 is slow: one direction of each, not a node
    found = pf.verdict(results, {}, LINK, 0.25, 2)
    assert found.ok and not found.warning


def test_two_slow_nodes_name_the_slowest_first_within_the_cap():
    speeds = [4.0, 0.5, 4.0, 0.2, 4.0, 0.5, 4.0]
    assert list(pf.verdict(ranks(speeds), {}, LINK, 0.25, 2).blamed) == ["n4", "n2"]
    assert list(pf.verdict(ranks(speeds), {}, LINK, 0.25, 1).blamed) == ["n4"]


def test_slow_nodes_that_tie_are_named_in_order_of_their_names():
    assert list(pf.verdict(ranks([4.0, 0.5, 4.0, 0.5, 4.0]), {}, LINK, 0.25, 1).blamed) == ["n2"]
    named = ["zeta", "alpha", "mid", "beta"]
    assert list(pf.verdict(ranks([0.5, 4.0, 4.0, 0.5], names=named), {}, LINK, 0.25, 1).blamed) == ["beta"]


def test_every_node_slow_is_the_fabric_and_only_warns():
    found = pf.verdict(ranks([0.2] * 4, per=2), {}, LINK, 0.25, 2)
    assert found.ok and not found.blamed and "every node is slow (4 nodes)" in found.warning


def test_two_nodes_with_one_slow_cannot_be_told_apart():
    found = pf.verdict(ranks([4.0, 0.2]), {}, LINK, 0.25, 2)  # each receives only from the slow one
    assert found.ok and "every node is slow" in found.warning


def test_the_floor_follows_the_fraction():
    results = ranks([4.0, 1.5, 4.0, 4.0])
    assert pf.verdict(results, {}, LINK, 0.25, 2).ok
    assert pf.verdict(results, {}, LINK, 0.5, 2).blamed == {
        "n2": "receives 1.5 GB/s, expected ≥ 2 GB/s of 4 GB/s from its neighbours"}
    assert pf.verdict(ranks([4.0, 0.01, 4.0]), {}, LINK, 0.0, 2).ok  # 0: no floor


def test_a_slow_all_reduce_on_one_node_blames_it():
    want = Expected(allreduce_gbs=50.0)
    seconds = MB4 / (3.1e9 / (2 * 7 / 8))  # a bus bandwidth of 3.1 GB/s over 8 ranks
    found = pf.verdict(ranks([4.0], per=8, allreduce_s=seconds), {}, want, 0.25, 2, MB4)
    assert found.blamed == {"n1": "all-reduce 3.1 GB/s, expected ≥ 12.5 GB/s of 50 GB/s"}


def test_a_slow_all_reduce_across_nodes_with_fine_links_is_the_fabric():
    want = Expected(allreduce_gbs=50.0, link_gbs=4.0)
    found = pf.verdict(ranks([4.0] * 3, per=2, allreduce_s=1.0), {}, want, 0.25, 2, MB4)
    assert found.ok and "the fabric, no one node" in found.warning and found.busbw_gbs is not None


def test_the_slowest_rank_sets_the_all_reduce_time():
    results = ranks([4.0], per=4, allreduce_s=0.001)
    results[3]["allreduce_s"] = 1.0
    found = pf.verdict(results, {}, Expected(allreduce_gbs=50.0), 0.25, 2, MB4)
    assert found.busbw_gbs == pytest.approx(round(pf.bus_bandwidth(MB4, 1.0, 4), 3)) and not found.ok


def test_without_the_sites_figures_bandwidth_is_only_measured():
    found = pf.verdict(ranks([0.001] * 2 + [4.0], allreduce_s=5.0), {}, Expected(), 0.25, 2, MB4)
    assert found.ok and not found.warning and found.busbw_gbs == pytest.approx(
        round(pf.bus_bandwidth(MB4, 5.0, 3), 3))


def test_a_lone_rank_has_no_bus_to_measure():
    found = pf.verdict([{"rank": 0, "host": "n1", "device": None}], {}, Expected(50.0), 0.25, 2)
    assert found.ok and found.busbw_gbs is None


# ---------------------------------------------------------------- at scale


def test_one_bad_node_among_1000_nodes_of_8_ranks_is_named():
    speeds = [4.0] * 1000
    speeds[536] = 0.4
    found = pf.verdict(ranks(speeds, per=8), {}, LINK, 0.25, 2, MB4)
    assert found.blamed == {"n537": "receives 0.4 GB/s, expected ≥ 1 GB/s of 4 GB/s from its neighbours"}
    assert pf.blamed_ranks(ranks(speeds, per=8), {}, found) == list(range(536 * 8, 537 * 8))


def test_one_failed_gpu_and_one_stuck_rank_among_8000_ranks_are_both_named():
    results = ranks([4.0] * 1000, per=8)
    results[8 * 411 + 3]["device"] = "cuda:3 matmul wrong"
    del results[8 * 900 + 7]
    found = pf.verdict(results, {8 * 900 + 7: "n901"}, LINK, 0.25, 2)
    assert found.blamed == {"n412": "cuda:3 matmul wrong",
                            "n901": f"rank {8 * 900 + 7} did not finish the check in time (stuck or gone)"}


def test_a_fabric_slow_everywhere_at_1000_nodes_excludes_nobody():
    found = pf.verdict(ranks([0.3] * 1000, per=8), {}, LINK, 0.25, 2)
    assert found.ok and found.blamed == {} and "1000 nodes" in found.warning


# ---------------------------------------------------------------- the [health] keys


def test_the_preflight_keys_default_and_can_be_set():
    health = spec_from_dict({}).health
    assert health.preflight is True and health.preflight_min_bandwidth_fraction == 0.25
    assert health.preflight_timeout_s == 120.0
    set_ = spec_from_dict({"health": {"preflight": False, "preflight_min_bandwidth_fraction": 0.5,
                                      "preflight_timeout_s": 30}}).health
    assert (set_.preflight, set_.preflight_min_bandwidth_fraction, set_.preflight_timeout_s) == (False, 0.5, 30)


@pytest.mark.parametrize("value,key", [
    ({"preflight": "no"}, "health.preflight"),
    ({"preflight": 0}, "health.preflight"),
    ({"preflight_min_bandwidth_fraction": 1.5}, "health.preflight_min_bandwidth_fraction"),
    ({"preflight_min_bandwidth_fraction": -0.1}, "health.preflight_min_bandwidth_fraction"),
    ({"preflight_min_bandwidth_fraction": "a quarter"}, "health.preflight_min_bandwidth_fraction"),
    ({"preflight_timeout_s": 0}, "health.preflight_timeout_s"),
    ({"preflight_timeout_s": True}, "health.preflight_timeout_s"),
    ({"preflight_timout_s": 5}, "did you mean `health.preflight_timeout_s`?"),
])
def test_bad_preflight_keys_are_named(value, key):
    with pytest.raises(ConfigError) as err:
        spec_from_dict({"health": value})
    assert key in str(err.value) and len(str(err.value).splitlines()) == 1


# ---------------------------------------------------------------- the check after srun (the node-fault path)


def preflight_reports(run_dir, ranks_: list[int], host: str, why: str) -> dict:
    from hpc.core import requeue

    record = {"nodes": [host], "reasons": {host: why}, "check_s": 1.5, "lost_s": 42.0}
    for rank in ranks_:
        requeue.report_failure(run_dir, "424242.1", rank, step=0, error=f"preflight: {host} failed: {why}",
                               terminated=False, host=host, save_s=0.0, saves=0, phase="join", repeats=False,
                               node_fault=True, preflight=record)
    return record


def test_a_failed_preflight_check_is_a_node_fault_excluded_on_the_requeue(run_dir, slurm_side):
    from hpc.core.goodput import by_cause
    from hpc.core.runs import RunDir
    from hpc.login.submit import stop_summary
    from tests.resilience.test_failure_records import batch_log, srun_says, write_batch_log
    from tests.resilience.test_node_health import GrantingSide
    from hpc.schedulers.slurm.requeue import after_srun

    side = GrantingSide()
    record = preflight_reports(run_dir, [2, 3], "n2", "cuda:3 matmul wrong")
    write_batch_log(run_dir, batch_log((1, srun_says("n1: task 0: Exited with exit code 1",
                                                     "n2: task 2: Exited with exit code 1"))))
    line = after_srun(run_dir, 1, side)
    assert line["requeued"] and line["failed_ranks"] == [2, 3] and line["failed_nodes"] == ["n2"]
    assert line["node_fault"] is True and line["excluded_nodes"] == ["n2"] and side.excluded == [["n2"]]
    assert line["error"] == "preflight: n2 failed: cuda:3 matmul wrong" and line["preflight"] == record
    assert stop_summary(line)["preflight"]["nodes"] == ["n2"]
    assert by_cause(RunDir(run_dir).read_ledger(), [{"step": 1, "step_time_s": 1.0}])["seconds"]["preflight"] == 42.0


def test_a_preflight_failure_after_progress_is_requeued_and_keeps_earlier_exclusions(run_dir, slurm_side):
    import json
    import time

    from tests.resilience.test_node_health import GrantingSide
    from tests.resilience.test_requeue import start, write_ledger
    from hpc.schedulers.slurm.requeue import after_srun

    recent = time.time() - 60
    write_ledger(run_dir, [start(0, 0), {"event": "stop", "reason": "failed", "step": 3, "time": recent,
                                         "failed_nodes": ["n5"], "node_fault": True}])
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 3, "loss": 1.0}) + "\n")
    preflight_reports(run_dir, [0], "n1", "receives 0.2 GB/s, expected ≥ 1 GB/s of 4 GB/s from its neighbours")
    side = GrantingSide()
    line = after_srun(run_dir, 1, side)
    assert line["requeued"] and line["excluded_nodes"] == ["n1", "n5"] and line["failed_nodes"] == ["n1"]


@pytest.mark.parametrize("key_value,words", [
    ("health.preflight=maybe", "`health.preflight` = 'maybe' (str): expected a boolean"),
    ("health.preflight_min_bandwidth_fraction=2", "`health.preflight_min_bandwidth_fraction` = 2: expected a value <= 1"),
    ("health.preflight_timeout_s=0", "`health.preflight_timeout_s` = 0"),
])
def test_a_bad_preflight_key_on_the_command_line_is_one_line_and_exit_2(key_value, words):
    from click.testing import CliRunner

    from hpc.cli import cli
    from tests.conftest import REPO

    result = CliRunner().invoke(cli, ["render", str(REPO / "jobs" / "tiny-ddp.toml"), "--set", key_value])
    assert result.exit_code == 2 and words in result.output and "Traceback" not in result.output
    assert len([line for line in result.output.splitlines() if line.strip()]) == 1
