"""The straggler report's judgement (``hpc.core.straggler``, torch-free): medians of the other ranks, the
factor, the streak of intervals, the words; the run folder's record as ``hpcx status`` and the ledger's stop
line carry it; the optional exclusion of a straggler's node on the next requeue after a failure
(``hpc.core.health``); the ``[health]`` keys. The collective half runs in tests/trainer/test_straggler_gloo.py."""

from __future__ import annotations

import json
import math
import random
import statistics
import time

import pytest

from hpc.core import health, runs, straggler
from hpc.core.config import ConfigError
from hpc.core.spec import spec_from_dict
from hpc.core.straggler import Judge
from hpc.login.status import health_text
from hpc.login.submit import recorded_summary, stop_summary
from hpc.schedulers.slurm.requeue import after_srun
from tests.conftest import hpcx
from tests.resilience.test_failure_records import batch_log, srun_says, write_batch_log
from tests.resilience.test_node_health import GrantingSide
from tests.resilience.test_requeue import JOB, start, write_ledger


def brute_others(times):
    """The definition, slowly: each rank's median of the other ranks' known times."""
    out = []
    for i, _ in enumerate(times):
        rest = [float(t) for j, t in enumerate(times) if j != i and straggler.known(t)]
        out.append(statistics.median(rest) if rest else None)
    return out


# ---------------------------------------------------------------- medians and ratios


@pytest.mark.parametrize("times", [
    [1.0, 2.0], [1.0, 1.0, 1.0], [3.0, 1.0, 2.0, 2.0], [5.0, 5.0, 1.0, 1.0], [0.0, 0.0, 4.0],
    [2.0, 1.0, 1.0, 1.0, 9.0], [1.0, float("nan"), 3.0, 2.0], [-1.0, 2.0, 2.0], [float("inf"), 1.0, 3.0],
])
def test_the_median_of_the_others_is_the_definitions(times):
    assert straggler.median_of_others(times) == brute_others(times)


def test_the_median_of_the_others_at_1024_ranks_with_ties_matches_the_definition():
    rng = random.Random(7)
    times = [round(rng.uniform(1.0, 1.2), 1) for _ in range(1024)]  # a handful of values: ties everywhere
    times[3] = 2.5
    assert straggler.median_of_others(times) == brute_others(times)
    found = straggler.ratios(times)
    assert max(range(1024), key=lambda r: found[r] or 0) == 3 and found[3] > 2


def test_one_rank_has_no_others_and_no_ratio():
    assert straggler.ratios([2.0]) == [None]
    judge = Judge(1.5, 1)
    judge.observe([2.0])
    assert judge.named() == []


def test_two_ranks_compare_each_with_the_other_not_with_their_mean():
    assert straggler.ratios([2.0, 1.0]) == [2.0, 0.5]  # the plain median (1.5) would say 1.33


def test_unknown_times_have_no_ratio_and_stay_out_of_the_others_medians():
    found = straggler.ratios([float("nan"), 1.0, 1.0, 3.0, None, "x", True])  # type: ignore[list-item]
    assert found[0] is None and found[4] is None and found[5] is None and found[6] is None
    assert found[3] == 3.0 and found[1] == 0.5  # the others of rank 1: 1 and 3


def test_zero_times_name_no_one():
    assert straggler.ratios([0.0, 0.0, 0.0]) == [None, None, None]
    assert straggler.ratios([5.0, 0.0, 0.0]) == [None, 0.0, 0.0]  # the others' median is 0: no ratio


# ---------------------------------------------------------------- the streak


def run_judge(judge, intervals):
    for compute in intervals:
        judge.observe(compute)
    return judge.named()


def test_a_rank_over_the_factor_for_k_intervals_is_named_not_before():
    judge = Judge(1.5, 3)
    slow = [1.0, 1.0, 2.0, 1.0]
    assert run_judge(judge, [slow, slow]) == []
    assert run_judge(judge, [slow]) == [2]
    assert judge.streaks == [0, 0, 3, 0]


def test_a_rank_that_recovers_mid_streak_starts_over():
    judge = Judge(1.5, 3)
    slow, even = [1.0, 2.0, 1.0], [1.0, 1.0, 1.0]
    assert run_judge(judge, [slow, slow, even, slow, slow]) == []
    assert run_judge(judge, [slow]) == [1]
    assert run_judge(judge, [even]) == []  # named while it stays slow only


def test_a_ratio_exactly_at_the_factor_is_not_over_it():
    assert run_judge(Judge(2.0, 1), [[1.0, 2.0, 1.0]]) == []
    assert run_judge(Judge(2.0, 1), [[1.0, 2.0001, 1.0]]) == [1]


def test_all_ranks_slow_together_name_no_one():
    judge = Judge(1.5, 1)
    assert run_judge(judge, [[1.0] * 8, [5.0] * 8, [9.0] * 8]) == []


def test_an_unknown_time_ends_a_streak():
    judge = Judge(1.5, 2)
    assert run_judge(judge, [[1.0, 3.0, 1.0], [1.0, float("nan"), 1.0], [1.0, 3.0, 1.0]]) == []


def test_two_stragglers_of_many_are_both_named():
    compute = [1.0] * 16
    compute[4], compute[11] = 2.0, 3.0
    judge = Judge(1.5, 2)
    assert run_judge(judge, [compute, compute]) == [4, 11]


def test_a_world_that_changes_size_starts_the_streaks_over():
    judge = Judge(1.5, 2)
    run_judge(judge, [[1.0, 3.0, 1.0]])
    assert run_judge(judge, [[1.0, 3.0, 1.0, 1.0]]) == []


def test_1024_ranks_with_one_straggler_name_it():
    compute = [1.0 + 0.01 * (r % 7) for r in range(1024)]
    compute[999] = 1.8
    judge = Judge(1.5, 3)
    assert run_judge(judge, [compute] * 3) == [999]
    named = straggler.stragglers(judge, straggler.ratios(compute), [f"n{r // 8}" for r in range(1024)])
    assert named == [{"rank": 999, "host": "n124", "intervals": 3, "ratio": 1.75}]


# ---------------------------------------------------------------- the words and the record


@pytest.mark.parametrize("found,words", [
    ({"rank": 3, "host": "n7", "ratio": 2.1, "intervals": 3},
     "straggler: rank 3 on n7, 2.1× the median over the last 3 intervals"),
    ({"rank": 0, "host": "", "ratio": 1.5432, "intervals": 1},
     "straggler: rank 0, 1.5× the median over the last interval"),
    ({"rank": 5, "host": "g1", "ratio": None, "intervals": 4},
     "straggler: rank 5 on g1, slower than the median over the last 4 intervals"),
])
def test_the_words_name_rank_host_ratio_and_intervals(found, words):
    assert straggler.words(found) == words


def test_the_interval_record_is_per_step_and_nested():
    record = straggler.interval_record(100, 50, [50.0, 100.0], [50.0, 0.0], [0.5, 2.0])
    assert record == {"kind": "ranks", "step": 100, "ranks": {
        "steps": 50, "compute_s": [1.0, 2.0], "wait_s": [1.0, 0.0], "median_compute_s": 1.5, "ratio": [0.5, 2.0]}}
    assert [k for k, v in record.items() if isinstance(v, (int, float))] == ["step"]  # no plot takes it for a metric
    assert straggler.interval_record(1, 1, [float("nan")], [0.0], [None])["ranks"]["compute_s"] == [None]


def test_every_rank_named_during_a_start_is_kept_with_its_newest_record():
    first = [{"rank": 2, "ratio": 1.6, "intervals": 3}]
    now = [{"rank": 0, "ratio": 2.0, "intervals": 3}, {"rank": 2, "ratio": 1.9, "intervals": 4}]
    assert straggler.merged(first, now) == [now[0], now[1]]
    assert straggler.merged(first, []) == first


def test_the_run_folders_record_is_read_back_per_start(tmp_path):
    assert straggler.read(tmp_path) == {} and straggler.of_start(tmp_path, "j.0") == []
    named = [{"rank": 1, "host": "n2", "ratio": 2.0, "intervals": 3}]
    straggler.write(tmp_path, {"step": 9, "incarnation": "j.0", "stragglers": [], "named": named})
    assert straggler.of_start(tmp_path, "j.0") == named and straggler.of_start(tmp_path, "j.1") == []
    straggler.path_of(tmp_path).write_text("{not json")
    assert straggler.read(tmp_path) == {}
    assert health.read_beats(tmp_path) == {}  # the record beside the heartbeats is not taken for one


# ---------------------------------------------------------------- status and the ledger


def test_status_names_the_stragglers_of_now():
    slow = [{"rank": 3, "host": "n7", "ratio": 2.1, "intervals": 3}]
    assert health_text({"stragglers": slow}) == "  straggler: rank 3 on n7, 2.1× the median over the last 3 intervals"
    both = health_text({"stragglers": slow, "excluded_nodes": {"n4": time.time() + 600}})
    assert both == "  excluded n4 (10 min more)  straggler: rank 3 on n7, 2.1× the median over the last 3 intervals"


def test_the_run_summary_carries_the_record_and_the_stop_lines_stragglers(run_dir):
    write_ledger(run_dir, [start(0)])
    assert "stragglers" not in recorded_summary(run_dir)
    slow = [{"rank": 1, "host": "n2", "ratio": 1.8, "intervals": 3}]
    straggler.write(run_dir, {"step": 30, "incarnation": f"{JOB}.0", "stragglers": slow, "named": slow})
    assert recorded_summary(run_dir)["stragglers"] == slow
    assert stop_summary({"event": "stop", "reason": "completed", "stragglers": slow})["stragglers"] == slow


def test_the_check_after_srun_puts_this_starts_stragglers_on_its_stop_line(run_dir, slurm_side):
    write_ledger(run_dir, [start(0)])
    slow = [{"rank": 1, "host": "n2", "ratio": 1.8, "intervals": 3}]
    straggler.write(run_dir, {"step": 30, "incarnation": f"{JOB}.1", "stragglers": [], "named": slow})
    granting = GrantingSide()
    write_batch_log(run_dir, batch_log((1, srun_says("n1: task 1: Exited with exit code 1"))))
    line = after_srun(run_dir, 1, granting)
    assert line["stragglers"] == slow and "excluded_nodes" not in line  # exclude_stragglers is off by default


def test_exclude_stragglers_adds_this_starts_straggler_node_on_the_requeue(run_dir, slurm_side):
    (run_dir / "resolved.json").write_text(json.dumps({"spec": {"health": {"exclude_stragglers": True}, "job": {"max_requeues": 3}}}))
    write_ledger(run_dir, [start(0)])
    slow = [{"rank": 1, "host": "n2", "ratio": 1.8, "intervals": 3}]
    straggler.write(run_dir, {"step": 30, "incarnation": f"{JOB}.1", "stragglers": slow, "named": slow})
    granting = GrantingSide()
    write_batch_log(run_dir, batch_log((0, srun_says("n1: task 0: Exited with exit code 1"))))
    line = after_srun(run_dir, 1, granting)
    assert line["requeued"], line.get("not_requeued")
    assert line["excluded_nodes"] == ["n2"] and granting.excluded == [["n2"]]


def test_an_earlier_starts_straggler_in_the_ledger_is_excluded_only_when_asked():
    ledger = [{"event": "stop", "time": 10.0, "stragglers": [{"rank": 1, "host": "n3"}]},
              {"event": "stop", "time": 20.0, "node_fault": True, "failed_nodes": ["n1"]}]
    assert health.faults(ledger) == [("n1", 20.0)]
    assert health.faults(ledger, stragglers=True) == [("n3", 10.0), ("n1", 20.0)]
    settings = health.Health(exclude_stragglers=True, exclude_nodes=1)
    assert health.exclusions(health.faults(ledger, True), 30.0, settings, None) == {"n1": 3620.0}  # newest first


# ---------------------------------------------------------------- the [health] keys


def test_the_straggler_defaults():
    spec = spec_from_dict({})
    assert (spec.health.straggler_every, spec.health.straggler_factor, spec.health.straggler_intervals,
            spec.health.exclude_stragglers) == (50, 1.5, 3, False)
    assert spec_from_dict({"health": {"straggler_every": 0}}).health.straggler_every == 0  # off


@pytest.mark.parametrize("doc,key", [
    ({"health": {"straggler_every": -1}}, "health.straggler_every"),
    ({"health": {"straggler_every": "50"}}, "health.straggler_every"),
    ({"health": {"straggler_every": 2.5}}, "health.straggler_every"),
    ({"health": {"straggler_factor": 0.9}}, "health.straggler_factor"),
    ({"health": {"straggler_factor": "x"}}, "health.straggler_factor"),
    ({"health": {"straggler_factor": math.inf}}, "health.straggler_factor"),
    ({"health": {"straggler_intervals": 0}}, "health.straggler_intervals"),
    ({"health": {"exclude_stragglers": "yes"}}, "health.exclude_stragglers"),
    ({"health": {"straggler_evry": 5}}, "did you mean `health.straggler_every`?"),
])
def test_bad_straggler_settings_are_named(doc, key):
    with pytest.raises(ConfigError) as err:
        spec_from_dict(doc)
    assert key in str(err.value)


@pytest.mark.parametrize("line,words", [
    ('straggler_factor = "fast"', "`health.straggler_factor` = 'fast' (str): expected a number"),
    ("straggler_every = 2.5", "`health.straggler_every` = 2.5 (float): expected an integer"),
    ("exclude_stragglers = 1", "`health.exclude_stragglers`"),
])
def test_a_bad_straggler_key_in_a_spec_file_is_one_line_and_exit_2(tmp_path, line, words):
    (tmp_path / "job.toml").write_text(f"[health]\n{line}\n")
    done = hpcx("submit", "job.toml", "--site", "local", cwd=tmp_path)
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("error: job.toml: ") and words in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.toml"]  # no run folder left behind


def test_the_interval_line_is_no_metric_to_plot_status_or_goodput(run_dir):
    from hpc.cli.plot import plotted_keys
    from hpc.core.goodput import by_cause

    train = {"step": 10, "loss": 2.0, "lr": 1e-3, "tokens_per_s": 100.0, "step_time_s": 0.5}
    ranks = {**straggler.interval_record(10, 10, [5.0, 9.0], [4.0, 0.0], [0.56, 1.8]), "start": 0}
    assert plotted_keys([train, ranks]) == plotted_keys([train])
    assert by_cause([], [train, ranks]) == by_cause([], [train])
    (run_dir / "metrics.jsonl").write_text(json.dumps(train) + "\n" + json.dumps(ranks) + "\n")
    shown = recorded_summary(run_dir)
    assert shown["step"] == 10 and shown["loss"] == 2.0 and shown["tokens_per_s"] == 100.0


# ---------------------------------------------------------------- exclusion on a requeue rank 0 was granted


class ExcludingSide(GrantingSide):
    """A job side that grants the requeue and records the nodes it is asked to exclude (or refuses them)."""

    def __init__(self, spare: int | None = 5, refuse: str | None = None) -> None:
        super().__init__(spare)
        self.refuse = refuse

    def exclude(self, nodes):
        super().exclude(nodes)
        return self.refuse


SLOW = [{"rank": 1, "host": "n2", "ratio": 1.8, "intervals": 3}]


@pytest.mark.parametrize("settings,named,spare,expected", [
    (health.Health(), SLOW, 5, {}),  # exclude_stragglers is off by default
    (health.Health(exclude_stragglers=True), [], 5, {}),  # nobody named: the scheduler's list stays
    (health.Health(exclude_stragglers=True), SLOW, 5, {"excluded_nodes": ["n2"], "excluded_until": {"n2": 3700.0}}),
    (health.Health(exclude_stragglers=True), SLOW, 0, {}),  # no node to spare: none excluded, none before
    (health.Health(exclude_stragglers=True, exclude_nodes=0), SLOW, 5, {}),
    (health.Health(exclude_stragglers=True, exclude_minutes=1), SLOW + [{"rank": 4, "host": "n5"}], 5,
     {"excluded_nodes": ["n5", "n2"], "excluded_until": {"n5": 160.0, "n2": 160.0}}),  # newest, then by name
])
def test_a_granted_requeue_excludes_this_starts_stragglers_only_when_asked(settings, named, spare, expected):
    side = ExcludingSide(spare)
    assert straggler.exclusion_after_requeue([], named, settings, side, 100.0) == expected
    assert side.excluded == ([expected["excluded_nodes"]] if expected else [])


def test_the_exclusion_keeps_the_ledgers_failed_nodes_and_records_a_refusal():
    ledger = [{"event": "stop", "time": 90.0, "node_fault": True, "failed_nodes": ["n1"],
               "excluded_until": {"n1": 3690.0}}]
    side = ExcludingSide(refuse="scontrol update failed: no")
    found = straggler.exclusion_after_requeue(ledger, SLOW, health.Health(exclude_stragglers=True), side, 100.0)
    assert found == {"excluded_nodes": ["n2", "n1"], "excluded_until": {"n2": 3700.0, "n1": 3690.0},
                     "exclude_failed": "scontrol update failed: no"}
    capped = straggler.exclusion_after_requeue(ledger, SLOW, health.Health(exclude_stragglers=True), ExcludingSide(0),
                                               100.0)
    assert capped == {"excluded_nodes": [], "excluded_until": {}}  # n1 was out: the list is set anew, to none


@pytest.mark.parametrize("exclude", [True, False])
def test_rank_0s_preemption_stop_line_names_the_stragglers_and_excludes_their_nodes_when_asked(run_dir, exclude):
    from trainer.preemption import PreemptionFlag
    from trainer.resilience import Resilience
    from hpc.core.spec import Checkpoint

    class Side(ExcludingSide):
        def job_id(self) -> str:
            return "777"

        def restart_count(self) -> int:
            return 0

        def leave_for_requeue(self) -> None:
            pass

        def seconds_left(self):
            return None

    side, flag = Side(), PreemptionFlag()
    flag.requested, flag.requested_at = True, time.time()
    write_ledger(run_dir, [{"event": "start", "step": 0, "job_id": "777"}])
    straggler.write(run_dir, {"step": 30, "incarnation": side.incarnation(0), "stragglers": SLOW, "named": SLOW})
    guard = Resilience(run_dir, Checkpoint(), 3, 0, rank=0, preemption=flag, side=side, step=12, reason="preempted",
                       health=health.Health(exclude_stragglers=exclude))
    guard.stopped()
    stop = runs.RunDir(run_dir).read_ledger()[-1]
    assert stop["reason"] == "preempted" and stop["requeued"] and stop["stragglers"] == SLOW
    assert stop.get("excluded_nodes") == (["n2"] if exclude else None) and side.excluded == ([["n2"]] if exclude else [])
