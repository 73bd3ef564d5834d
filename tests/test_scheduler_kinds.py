"""The scheduler registry (``hpc.schedulers``) as a new kind meets it: a site's ``[scheduler]`` section is
joined from the fields every kind has and each kind's own (``<kind>/section.py``), the kinds' rules on
paths and CPUs are asked through the registry, and ``hpcx site detect`` goes to the first kind that drafts.

A made-up kind ``pbs`` (a package written into tmp_path) stands in for the next scheduler."""

from __future__ import annotations

import dataclasses
import importlib
import sys
import textwrap
from pathlib import Path

import pytest

from hpc import schedulers
from hpc.core import site as site_mod
from hpc.core.errors import ConfigError

PBS_SECTION = '''
from dataclasses import dataclass
from hpc.core.config import field

CROSS_CHECKED = ("scheduler.queue",)


@dataclass
class Section:
    queue: str = field("workq", doc="Default PBS queue (`-q`).")
    place: str = field("scatter", doc="How chunks are placed (`-l place=`).", choices=("scatter", "pack"))


def path_problem(value):
    return "expected a path without `:` (qsub reads host:path)" if ":" in value else None
'''


@pytest.fixture
def pbs(tmp_path: Path, monkeypatch):
    """A second kind with a section of its own, importable as ``pbs_kind.section``."""
    package = tmp_path / "pbs_kind"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "section.py").write_text(textwrap.dedent(PBS_SECTION))
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("pbs_kind.section")
    real = schedulers._sections()
    monkeypatch.setattr(schedulers, "_sections", lambda: {**real, "pbs": module})
    yield module
    sys.modules.pop("pbs_kind.section", None)
    sys.modules.pop("pbs_kind", None)


def _names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def test_the_section_is_the_common_fields_then_each_kinds_own():
    names = _names(site_mod.Scheduler)
    common = _names(site_mod.CommonScheduler)
    assert names[:len(common)] == common and common[0] == "kind"
    assert names[len(common):] == list(site_mod.Scheduler.KIND_FIELDS["slurm"])
    assert {"partition", "account", "qos", "gpu_directive", "sbatch"} == set(site_mod.Scheduler.KIND_FIELDS["slurm"])


def test_a_new_kinds_fields_join_the_section_in_order(pbs):
    cls = schedulers.section_class(site_mod.CommonScheduler)
    assert _names(cls)[-2:] == ["queue", "place"]
    assert cls.KIND_FIELDS["pbs"] == ("queue", "place")
    assert cls().queue == "workq" and cls(kind="slurm", queue="long").queue == "long"
    assert schedulers.cross_checked()[-1] == "scheduler.queue"


def test_a_new_kinds_fields_load_from_a_profile_with_their_rules(pbs, tmp_path: Path, monkeypatch):
    cls = schedulers.section_class(site_mod.CommonScheduler)
    monkeypatch.setitem(site_mod.SECTIONS, "scheduler", cls)
    good = tmp_path / "pbs-site.toml"
    good.write_text('[scheduler]\nqueue = "gpu"\nplace = "pack"\n')
    loaded = site_mod.load_site(str(good))
    assert (loaded.scheduler.queue, loaded.scheduler.place) == ("gpu", "pack")
    bad = tmp_path / "bad.toml"
    bad.write_text('[scheduler]\nqueu = "gpu"\nplace = "spread"\n')
    with pytest.raises(ConfigError) as exc:
        site_mod.load_site(str(bad))
    text = "\n".join(exc.value.messages)
    assert "did you mean `scheduler.queue`?" in text and "`scheduler.place`" in text and "spread" in text


def test_two_kinds_declaring_one_field_is_refused(tmp_path: Path, monkeypatch):
    package = tmp_path / "clash_kind"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "section.py").write_text(textwrap.dedent('''
        from dataclasses import dataclass
        from hpc.core.config import field

        @dataclass
        class Section:
            partition: str = field("", doc="x")
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("clash_kind.section")
    real = schedulers._sections()
    monkeypatch.setattr(schedulers, "_sections", lambda: {**real, "clash": module})
    try:
        with pytest.raises(TypeError, match=r"clash.*partition.*slurm"):
            schedulers.section_class(site_mod.CommonScheduler)
        # a kind may not take a common field either
        monkeypatch.setattr(schedulers, "_sections", lambda: {"clash": type("M", (), {
            "Section": dataclasses.make_dataclass("Section", [("kind", str, dataclasses.field(default=""))])})})
        with pytest.raises(TypeError, match=r"kind.*CommonScheduler"):
            schedulers.section_class(site_mod.CommonScheduler)
    finally:
        sys.modules.pop("clash_kind.section", None)
        sys.modules.pop("clash_kind", None)


@pytest.mark.parametrize("value,problem", [
    ("/scratch/%u/runs", "without `%`"), ("/scratch/a%jb", "without `%`"), ("/scratch/a\\b", "without `\\`"),
    ("/scratch/plain", None), ("/scratch/ünï/ok", None), ("~/runs-%", "without `%`")])
def test_log_path_problems_come_from_the_kinds(value, problem):
    found = schedulers.path_problem(value)
    assert (found is None) if problem is None else (problem in found)


def test_a_new_kinds_path_problem_is_asked_too(pbs, tmp_path: Path):
    assert "qsub reads host:path" in schedulers.path_problem("/scratch/a:b")
    from hpc.core import runroot

    assert "host:path" in runroot.check_run_root("storage.run_root", "/scratch/a:b")[0]
    assert runroot.check_run_root("storage.run_root", "/scratch/ab") == []


@pytest.mark.parametrize("sbatch,kind,allocated", [
    ({}, "slurm", True), ({"overcommit": True}, "slurm", False), ({"overcommit": False}, "slurm", True),
    ({"overcommit": 1}, "slurm", False), ({"constraint": "x"}, "slurm", True), ({}, "local", False),
    ({"overcommit": True}, "local", False)])
def test_whether_tasks_get_cpus_of_their_own_is_the_kinds_word(sbatch, kind, allocated):
    section = site_mod.Scheduler(kind=kind, sbatch=sbatch)
    assert schedulers.get(kind).cpus_allocated(section) is allocated


def test_detect_goes_to_the_first_kind_that_drafts(monkeypatch):
    calls = []

    def declines(self, name, saved):
        calls.append((self.kind, name, dict(saved)))
        return None

    for kind in schedulers.KINDS:
        monkeypatch.setattr(type(schedulers.get(kind)), "detect", declines)
    from hpc.core.errors import UserError

    with pytest.raises(UserError, match="no scheduler kind can draft"):
        schedulers.detect_site("x", {"topo": "t"})
    assert [c[0] for c in calls] == list(schedulers.KINDS) and calls[0][2] == {"topo": "t"}
