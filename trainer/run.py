"""A run folder as the trainer sees it: ``resolved.json`` read back into typed objects."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from hpc.core.resolve import RESOLVED_VERSION, Launch, decided
from hpc.core.runs import RunDir
from hpc.core.site import SiteProfile, parse_site
from hpc.core.spec import JobSpec, spec_from_dict



@dataclass
class Run:
    """Everything one rank needs: the spec, the site, the launch and the folder."""

    run_dir: Path
    spec: JobSpec
    site: SiteProfile
    launch: Launch

    @property
    def logs_dir(self) -> Path:
        return RunDir(self.run_dir).logs


def load_run(run_dir: str | Path) -> Run:
    """Read ``RUN_DIR/resolved.json``; the folder given wins over the one recorded (it may have moved)."""
    run_dir = Path(run_dir).resolve()
    resolved = RunDir(run_dir).resolved
    doc = json.loads(resolved.read_text())
    if doc.get("version") not in (1, RESOLVED_VERSION):
        raise ValueError(f"{resolved}: version {doc.get('version')!r}, this trainer reads versions "
                         f"1 to {RESOLVED_VERSION}")
    spec = spec_from_dict(doc["spec"], str(resolved), read_hf_config=False)
    site_doc = dict(doc["site"])
    name, source = site_doc.pop("name"), site_doc.pop("source", "")
    site = parse_site(site_doc, name, source or str(resolved))
    return Run(run_dir=run_dir, spec=spec, site=site, launch=decided(spec, Launch.from_dict(doc["launch"])))
