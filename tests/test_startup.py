"""What a login command imports before it answers: only what it needs. A check of the modules loaded
(deterministic), not of time; the timings are bench/cli_latency's."""

from __future__ import annotations

import json
import subprocess
import sys

import hpc.plan
from tests.conftest import REPO

PROBE = ("import json, sys\n"
         "from hpc.entry import main\n"  # what the installed `hpcx` runs
         "try:\n    main()\n"
         "except SystemExit:\n    pass\n"
         "print('MODULES=' + json.dumps(sorted(sys.modules)), file=sys.stderr)\n")
# The planner's own modules: `resolve` needs them only to decide `parallel.strategy = "auto"`.
PLANNER = ("hpc.plan.rows", "hpc.plan.explain", "hpc.plan.advice", "hpc.plan.table", "hpc.plan.comm",
           "hpc.plan.collectives", "hpc.plan.memory", "hpc.plan.timing")
# Never on a login command that renders: torch and what only the job, a study or a conversion needs.
HEAVY = ("torch", "numpy", "trainer", "hpc.ckpt", "hpc.dryrun", "hpc.scale", "hpc.data", "hpc.cli.plan",
         "hpc.cli.scale", "hpc.cli.ckpt", "hpc.cli.data", "hpc.cli.plot")


def loaded(*args: str) -> list[str]:
    """The modules loaded once ``hpcx ARGS`` has answered (exit status 0)."""
    done = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=60,
                          cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    line = next(x for x in done.stderr.splitlines() if x.startswith("MODULES="))
    return json.loads(line.removeprefix("MODULES="))


def under(modules: list[str], names: tuple[str, ...]) -> list[str]:
    return [m for m in modules if m in names or m.startswith(tuple(f"{n}." for n in names))]


def test_render_of_a_set_strategy_imports_no_planner():
    modules = loaded("render", str(REPO / "jobs/tiny-hsdp-2node.toml"), "--site", "sandbox")
    assert {"hpc.login.render", "hpc.plan.resolve", "hpc.schedulers.slurm.scheduler"} <= set(modules)
    # only the memory model: a set strategy the plan knows runs out of memory is warned about (hpc.plan.warn)
    assert under(modules, PLANNER) == ["hpc.plan.memory"] and "hpc.plan.warn" in modules
    assert under(modules, HEAVY) == []
    assert "hpc.core.failures" not in modules  # how a start failed: the job's and status's, not render's


def test_render_of_auto_runs_the_planner():
    modules = loaded("render", str(REPO / "jobs/gpt-13b-auto.toml"), "--site", "dgx-h100")
    assert set(PLANNER) - {"hpc.plan.table"} <= set(modules)  # the plan is made, not printed
    assert under(modules, HEAVY) == []


def test_the_planners_names_are_found_where_they_are_defined():
    for name, module in hpc.plan.LAZY.items():
        assert getattr(hpc.plan, name) is getattr(__import__(module, fromlist=[name]), name)
    assert set(hpc.plan.__all__) <= {*hpc.plan.LAZY, *vars(hpc.plan)}
