"""The MFU a study measured, for ``hpcx scale report STUDY --site-draft FILE``.

At the smallest measured point (the least communication) compute = the measured step time less
the planner's predicted communication; MFU = the planner's compute time at MFU 1 / that compute.
That is the figure the planner multiplies the peak by, so writing it into the site's ``node.mfu``
makes ``hpcx plan`` reproduce the measured step at that point.
"""

from __future__ import annotations

import time
import typing as tp
from pathlib import Path

from hpc import plan
from hpc.core.models import model_facts

from hpc.scale.predict import predicted_step
from hpc.scale.report import Study, study_site
from hpc.scale.study import read_study


def study_mfu(study_dir: Path, report: dict[str, tp.Any]) -> tuple[float, str] | None:
    """(MFU, where it came from) at the report's baseline point; None where nothing was measured or
    the site has no peak FLOP/s."""
    base = next((r for r in report["points"] if r["nodes"] == report.get("baseline_nodes")), None)
    if base is None or not base.get("step_time_s"):
        return None
    doc = read_study(study_dir)
    study = Study(study_dir, doc, study_site(doc))
    spec, nodes = study.spec(base["nodes"]), base["nodes"]
    comm = predicted_step(spec, study.site, nodes).get("comm_s") or 0.0
    at_peak = plan.compute_seconds(model_facts(spec.model), plan.setup_of(spec, study.site, nodes), study.site, 1.0)
    compute = base["step_time_s"] - comm
    if at_peak is None or compute <= 0:
        return None
    when = time.strftime("%Y-%m-%d", time.gmtime(doc.get("created_at") or time.time()))
    source = (f"scale study {doc['name']} ({study_dir.name}, {when}) at {nodes} node(s): step "
              f"{base['step_time_s'] * 1e3:.1f} ms - predicted communication {comm * 1e3:.1f} ms = compute "
              f"{compute * 1e3:.1f} ms")
    return at_peak / compute, source
