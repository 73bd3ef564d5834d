"""The straggler report's collective half (``trainer.straggler``) in real gloo processes under torchrun: a
rank slowed by a sleep injected into its forward is named (metrics line per interval, the run folder's
record, rank 0's log); evenly loaded ranks name no one. The ratios are judged by ``hpc.core.straggler``
(tests/resilience/test_straggler.py, with exact numbers); here only the naming and the split's shape are
asserted: the injected sleep is 5× every rank's own."""

from __future__ import annotations

import json
from pathlib import Path

from hpc.core import straggler
from tests.trainer.trainer_testlib import torchrun

WORKER = str(Path(__file__).with_name("straggler_worker.py"))


def trained(run_dir: Path, ranks: int, slow: int, steps: int = 9, every: int = 3, intervals: int = 2) -> list[dict]:
    run_dir.mkdir()
    out = torchrun(ranks, [WORKER, str(run_dir), str(slow), str(steps), str(every), str(intervals)], timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_rank_slowed_in_its_compute_is_named_and_the_others_wait_for_it(tmp_path):
    lines = trained(tmp_path / "run", 3, slow=2)
    assert [r["kind"] for r in lines] == ["ranks"] * 3 and [r["step"] for r in lines] == [3, 6, 9]
    for record in lines:
        split = record["ranks"]
        assert split["steps"] == 3 and len(split["compute_s"]) == len(split["wait_s"]) == 3
        assert max(range(3), key=lambda r: split["ratio"][r]) == 2 and split["ratio"][2] > 1.5
        assert min(split["wait_s"][:2]) > split["wait_s"][2]  # the fast ranks wait in the gradient sync, not it
    found = straggler.read(tmp_path / "run")
    assert [s["rank"] for s in found["stragglers"]] == [2] and found["stragglers"][0]["host"] == "host2"
    assert found["incarnation"] == "drill.0" and found["step"] == 9 and found["named"][0]["intervals"] == 2  # the first: warm-up
    assert straggler.words(found["stragglers"][0]).startswith("straggler: rank 2 on host2, ")


def test_evenly_loaded_ranks_name_no_one_and_leave_an_empty_record(tmp_path):
    lines = trained(tmp_path / "run", 2, slow=-1, steps=6)
    assert [r["step"] for r in lines] == [3, 6]
    assert all(max(r["ranks"]["ratio"]) < 1.5 for r in lines)
    assert straggler.read(tmp_path / "run") == {"step": 3, "time": straggler.read(tmp_path / "run")["time"],
                                                "incarnation": "drill.0", "stragglers": [], "named": []}
