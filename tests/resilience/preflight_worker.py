"""One rank of a torchrun launch running the pre-flight check (``trainer.preflight.check_start``) on gloo.

    torchrun --nproc_per_node=N tests/resilience/preflight_worker.py OUT_DIR PER_NODE CASE

Rank r plays host ``n{r // PER_NODE + 1}``. CASE: ``fine``; ``device:R`` (rank R's device check fails
through the injectable hook); ``stuck:R`` (rank R is stuck in its device check until every other rank
wrote its account, then goes on); ``drill:HOST`` (the drill hook's variable names HOST); ``off`` (the
check is switched off). Each rank writes OUT_DIR/rank-R.json: its verdict, or the
``PreflightFailed`` it raised. The failure reports go to OUT_DIR/run/requeue/ (incarnation ``77.0``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from hpc.core.preflight import PreflightFailed
from hpc.core.site import parse_site
from hpc.core.spec import spec_from_dict
from trainer.dist import detect_rank_env, init_distributed
from trainer.preflight import DRILL_HOST, check_start, device_problem

SITE = {"scheduler": {"kind": "slurm"}, "node": {"cpus": 2}, "network": {"fabric": "ethernet"}}


def run_of(out: Path, case: str) -> SimpleNamespace:
    health = {"preflight": case != "off", "preflight_timeout_s": 3}
    (out / "run").mkdir(exist_ok=True)
    return SimpleNamespace(spec=spec_from_dict({"health": health}), site=parse_site(SITE, "t", "<test>"),
                           run_dir=out / "run")


def hook(case: str, out: Path, world: int):
    """The device check, failing on the rank CASE names (``device:R``), or stuck there until every other
    rank wrote its account (``stuck:R``)."""
    def check(device: torch.device, node, host: str) -> str:
        kind, _, which = case.partition(":")
        named = kind in ("device", "stuck") and int(which) == int(os.environ["RANK"])
        if named and case.startswith("device:"):
            return f"{device} matmul wrong (injected)"
        while named and len(list(out.glob("rank-*.json"))) < world - 1:
            time.sleep(0.05)
        return device_problem(device, node, host)
    return check


def main(out: Path, per_node: int, case: str) -> None:
    env = detect_rank_env()
    init_distributed(env, "gloo", 60)
    host = f"n{env.rank // per_node + 1}"
    if case.startswith("drill:"):
        os.environ[DRILL_HOST] = case.split(":")[1]
    guard = SimpleNamespace(side=SimpleNamespace(incarnation=lambda restart: f"77.{restart}"), restart=0, step=0)
    try:
        found = check_start(run_of(out, case), env.rank, host, torch.device("cpu"), guard,  # type: ignore[arg-type]
                            device_check=hook(case, out, env.world_size), nbytes=256 * 1024)
        record = {"ok": True, "verdict": None if found is None else vars(found)}
    except PreflightFailed as exc:
        record = {"ok": False, "error": str(exc), "reported": exc.reported, "verdict": exc.verdict}
    (out / f".rank-{env.rank}.json").write_text(json.dumps(record))
    os.replace(out / f".rank-{env.rank}.json", out / f"rank-{env.rank}.json")
    os._exit(0)  # without tearing gloo down: a peer may have left already (the stuck case), or be leaving


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
