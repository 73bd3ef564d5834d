"""`hpcx status`'s two caches (``hpc.login.cache``): each site profile's run root (``hpc.login.siteroots``),
and the scheduler queries of the last list, started again before the list's code is imported
(``hpc.login.status.remembered_queries``, ``hpc.core.procs``). Either one may be stale, torn or hostile:
the list is then exactly what it is without it. Behaviour only: the timings are bench/cli_latency's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc.core import procs, site
from hpc.login import cache, siteroots, status
from tests.conftest import REPO
from tests.test_slurm_vars import bogus_conf, fake_runs

CONSOLE_SCRIPT = "import sys; from hpc.entry import main; main()"


# ---------------------------------------------------------------- the profiles' run roots


# every profile shipped in site/ (hpc._sites): each is shadowed, so no run root of the machine's is listed
BUNDLED = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "site").glob("*.toml"))

@pytest.fixture
def sites(tmp_path: Path, monkeypatch) -> Path:
    """A site path of its own (the bundled profiles shadowed by three of ours) and a cache of its own."""
    folder = tmp_path / "sites"
    folder.mkdir()
    monkeypatch.setenv("HPCX_SITE_PATH", str(folder))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.config/hpcx/sites of the user's
    for name in BUNDLED:  # the bundled ones, shadowed: none of the user's
        profile(folder, name, tmp_path / f"runs-{name}")
    return folder


def profile(folder: Path, name: str, root: str | Path, extra: str = "") -> Path:
    path = folder / f"{name}.toml"
    path.write_text(f'[scheduler]\nkind = "local"\n{extra}\n[storage]\nrun_root = {json.dumps(str(root))}\n')
    return path


def full_load(warn) -> list[Path]:
    """What the list's run roots were before the cache: every profile loaded (the oracle)."""
    from hpc.core import runroot
    from hpc.core.config import ConfigError

    roots = []
    for name, (path, _) in site.find_sites().items():
        try:
            roots.append(site.load_site(name).run_root())
        except ConfigError as exc:
            written = site.written_run_root(path)
            try:
                root = runroot.expand_run_root(written, str(path)) if written is not None else None
            except ConfigError:
                root = None
            also = f"; still looking for its runs in {root}" if root else ""
            warn(f"warning: site profile {path} does not load ({exc.messages[0]}){also}")
            roots += [root] if root else []
    return roots


def listed() -> tuple[list[Path], list[str]]:
    warnings: list[str] = []
    return siteroots.run_roots(warnings.append), warnings


def expected() -> tuple[list[Path], list[str]]:
    warnings: list[str] = []
    return full_load(warnings.append), warnings


@pytest.fixture
def loads(monkeypatch) -> list[str]:
    """The names of the profiles loaded (parsed and checked) from now on."""
    names: list[str] = []
    real = site.load_site
    monkeypatch.setattr(site, "load_site", lambda name, *a: names.append(Path(name).stem) or real(name, *a))
    return names


def test_a_second_list_loads_no_profile(sites, loads):
    first = listed()
    assert sorted(loads) == sorted(BUNDLED)
    loads.clear()
    assert listed() == first and loads == []
    assert first == expected()
    assert cache.cache_path(siteroots.CACHE).stat().st_mode & 0o777 == 0o600


def _same_size_edit(path: Path) -> None:
    text, info = path.read_text(), path.stat()
    path.write_text(text.replace("runs-sandbox", "runs-sandboX"))
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns))  # mtime and size as before: ctime tells


def _replaced(path: Path) -> None:
    new = path.with_name("new.tmp")
    new.write_text(path.read_text().replace("runs-sandbox", "runs-sandboX"))
    os.replace(new, path)


def _appended(path: Path) -> None:
    with open(path, "a") as f:
        f.write('\n[node]\ncpus = "many"\n')  # now it does not load


def _broken_in_place(path: Path) -> None:
    path.write_text(path.read_text().replace('kind = "local"', 'kind = "lokal"'))


def _touched(path: Path) -> None:
    os.utime(path, ns=(1, 1))


def _chmodded(path: Path) -> None:
    path.chmod(0o640)


@pytest.mark.parametrize("change", [_same_size_edit, _replaced, _appended, _broken_in_place, _touched, _chmodded])
def test_a_profile_changed_in_any_way_is_loaded_again(sites, loads, change):
    listed()
    loads.clear()
    change(sites / "sandbox.toml")
    now = listed()
    assert loads == ["sandbox"]  # that one only
    loads.clear()
    assert listed() == now and loads == []  # and remembered again
    assert now == expected()


def test_a_profile_added_or_removed_is_seen(sites, tmp_path, loads):
    listed()
    profile(sites, "extra", tmp_path / "runs-extra")
    roots, _ = listed()
    assert tmp_path / "runs-extra" in roots
    (sites / "pcie-4gpu.toml").unlink()
    roots, _ = listed()
    assert tmp_path / "runs-pcie-4gpu" not in roots and (roots, []) == expected()


def test_a_profile_whose_name_ends_in_toml_is_read_from_its_folder(sites, tmp_path, monkeypatch):
    profile(sites, "odd.toml", tmp_path / "runs-odd")  # odd.toml.toml: the name `odd.toml` looks like a path
    monkeypatch.chdir(tmp_path)  # where no odd.toml lies
    for _ in range(2):
        roots, warnings = listed()
        assert tmp_path / "runs-odd" in roots and warnings == []


def test_a_profile_shadowed_by_an_earlier_folder_is_not_listed_from_the_cache(sites, tmp_path, monkeypatch):
    listed()
    first = tmp_path / "first"
    first.mkdir()
    profile(first, "sandbox", tmp_path / "runs-shadow")
    monkeypatch.setenv("HPCX_SITE_PATH", f"{first}{os.pathsep}{sites}")
    roots, _ = listed()
    assert tmp_path / "runs-shadow" in roots and tmp_path / "runs-sandbox" not in roots


def _stale_code(record: dict) -> None:
    module = next(iter(record["code"]))
    record["code"][module] = [0, 0, 0, 0]


def _vanished_code(record: dict) -> None:
    record["code"]["/nonexistent/hpc/core/site.py"] = [1, 2, 3, 4]


def _other_python(record: dict) -> None:
    record["python"] = "3.10.0 (main) [GCC]"


def _other_install(record: dict) -> None:
    record["hpc"] = "/opt/other/hpc"


def _no_code(record: dict) -> None:
    record["code"] = {}


@pytest.mark.parametrize("change", [_stale_code, _vanished_code, _other_python, _other_install, _no_code])
def test_a_record_of_other_code_is_not_believed(sites, loads, change):
    listed()
    record = cache.read(siteroots.CACHE)
    for facts in record["profiles"].values():  # lies that a believed record would show
        facts["run_root"] = "/lie"
    change(record)
    cache.write(siteroots.CACHE, record)
    loads.clear()
    now = listed()
    assert len(loads) == len(BUNDLED) and now == expected()


def test_the_code_key_covers_the_modules_that_load_a_profile(sites):
    listed()
    modules = set(cache.read(siteroots.CACHE)["code"])
    for name in ("core/site.py", "core/config.py", "core/validate.py", "schedulers/__init__.py",
                 "schedulers/slurm/section.py", "schedulers/slurm/options.py", "login/siteroots.py"):
        assert str(REPO / "hpc" / name) in modules


def test_variables_in_a_run_root_are_expanded_at_every_call(sites, tmp_path, monkeypatch, loads):
    profile(sites, "scratch", "$HPCX_TEST_SCRATCH/runs")
    monkeypatch.setenv("HPCX_TEST_SCRATCH", str(tmp_path / "a"))
    assert tmp_path / "a" / "runs" in listed()[0]
    loads.clear()
    monkeypatch.setenv("HPCX_TEST_SCRATCH", str(tmp_path / "b"))
    roots, warnings = listed()
    assert tmp_path / "b" / "runs" in roots and tmp_path / "a" / "runs" not in roots and warnings == []
    monkeypatch.delenv("HPCX_TEST_SCRATCH")
    unset = listed()
    assert "HPCX_TEST_SCRATCH" in unset[1][0] and "does not load" in unset[1][0]
    assert loads == []  # none of this needed a profile loaded again
    assert unset == expected()


BROKEN = [
    ('[scheduler]\nkind = "lokal"\n[storage]\nrun_root = "{root}"\n', True),  # a wrong choice, its root readable
    ('nodes = 3\n[storage]\nrun_root = "{root}"\n', True),  # an unknown key
    ('[storage]\nrun_root = "{root}%j"\n', False),  # a run root no kind accepts
    ('[storage]\nrun_root = 5\n', False),
    ('[storage\nrun_root = "{root}"\n', False),  # not TOML
    ('[node]\ngpus = 0\ngpu_model = "H100"\n[storage]\nrun_root = "{root}"\n', True),  # a cross-check
    ('[storage]\nrun_root = "$HPCX_TEST_UNSET_VAR/x"\n', False),
    ('\ufeff[storage]\nrun_root = "{root}"\n', False),  # a BOM: loads
]


@pytest.mark.parametrize("text,searched", BROKEN)
def test_a_profile_that_does_not_load_warns_the_same_from_the_cache(sites, tmp_path, text, searched):
    root = tmp_path / "broken-runs"
    (sites / "broken.toml").write_text(text.replace("{root}", str(root)))
    first, again = listed(), listed()
    assert first == again == expected()
    assert (root in first[0]) == (searched or "\ufeff" in text)


def test_a_profile_that_is_not_a_file_warns_the_same_from_the_cache(sites, tmp_path):
    os.mkfifo(sites / "fifo.toml")
    (sites / "dir.toml").mkdir()
    first = listed()
    assert first == listed() == expected()
    assert any("fifo.toml" in w for w in first[1]) and any("dir.toml" in w for w in first[1])


HOSTILE = {
    "torn": b'{"python": "3.11", "profiles": {',
    "deep": b"[" * 200000 + b"]" * 200000,
    "not an object": b"[1, 2, 3]",
    "profiles a list": None,
    "facts of wrong types": None,
    "a file key of wrong type": None,
    "not UTF-8": b"\xff\xfe{}",
    "too large": b" " * (cache.MAX_BYTES + 10) + b"{}",
}


def _hostile_record(kind: str) -> bytes:
    record = cache.read(siteroots.CACHE)
    if kind == "profiles a list":
        record["profiles"] = list(record["profiles"])
    elif kind == "facts of wrong types":
        for facts in record["profiles"].values():
            facts.update(loads="yes", run_root=5)
    elif kind == "a file key of wrong type":
        for facts in record["profiles"].values():
            facts.update(file="x", run_root="/lie")
    return json.dumps(record).encode()


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_a_torn_or_hostile_site_record_is_ignored_and_rewritten(sites, kind):
    listed()
    content = HOSTILE[kind] if HOSTILE[kind] is not None else _hostile_record(kind)
    cache.cache_path(siteroots.CACHE).write_bytes(content)
    assert listed() == expected()
    assert cache.read(siteroots.CACHE) is not None  # a good one again
    assert listed() == expected()


def _group_writable(path: Path) -> None:
    path.chmod(0o664)


def _someone_elses(path: Path) -> None:
    os.chown(path, 65534, 65534)


def _a_symlink(path: Path) -> None:
    real = path.with_name("real.json")
    os.replace(path, real)
    path.symlink_to(real)


@pytest.mark.parametrize("how", [_group_writable, _someone_elses, _a_symlink])
def test_a_record_others_could_have_written_is_not_read(sites, how):
    if how is _someone_elses and os.getuid() != 0:
        pytest.skip("needs root to give the file away")  # CI runs as root
    listed()
    record = cache.read(siteroots.CACHE)
    for facts in record["profiles"].values():
        facts["run_root"] = "/lie"
    cache.write(siteroots.CACHE, record)
    path = cache.cache_path(siteroots.CACHE)
    assert cache.read(siteroots.CACHE) is not None
    how(path)
    assert cache.read(siteroots.CACHE) is None
    assert Path("/lie") not in listed()[0] and listed() == expected()


@pytest.mark.parametrize("where", ["a file", "a folder that cannot be written", "a fifo"])
def test_a_cache_that_cannot_be_written_is_no_error(sites, tmp_path, monkeypatch, where):
    target = tmp_path / "cache-x"
    if where == "a file":
        target.write_text("x")
        monkeypatch.setenv("XDG_CACHE_HOME", str(target))
    elif where == "a fifo":
        (target / "hpcx").mkdir(parents=True)
        os.mkfifo(target / "hpcx" / siteroots.CACHE)
        monkeypatch.setenv("XDG_CACHE_HOME", str(target))
    else:
        (target / "hpcx" / siteroots.CACHE).mkdir(parents=True)  # a folder where the file should be
        monkeypatch.setenv("XDG_CACHE_HOME", str(target))
    assert listed() == listed() == expected()


def test_many_site_paths_keep_the_record_bounded(sites, tmp_path, monkeypatch):
    for n in range(siteroots.MAX_PROFILES // 4 + 3):
        folder = tmp_path / f"project-{n}"
        folder.mkdir()
        for name in ("local", "sandbox", "dgx-h100", "pcie-4gpu", "own"):
            profile(folder, name, tmp_path / f"runs-{n}-{name}")
        monkeypatch.setenv("HPCX_SITE_PATH", str(folder))
        assert listed() == expected()
    assert len(cache.read(siteroots.CACHE)["profiles"]) <= siteroots.MAX_PROFILES


# ---------------------------------------------------------------- the scheduler queries, started early


@pytest.fixture
def tools(tmp_path: Path, monkeypatch) -> Path:
    """squeue and sacct that log each start (tool, pid, arguments) and answer: every asked job is
    RUNNING (squeue) and COMPLETED (sacct); a slurm.conf that names no controller (nothing to probe)."""
    shims = tmp_path / "bin"
    shims.mkdir()
    log = tmp_path / "tools.log"
    (shims / "squeue").write_text(f'#!/bin/sh\necho "squeue $$ $*" >> {log}\n'
                                  'for id in $(echo "$3" | tr , " "); do echo "$id|RUNNING|n1"; done\n')
    (shims / "sacct").write_text(f'#!/bin/sh\necho "sacct $$ $*" >> {log}\nsleep 0.2\n'
                                 'for id in $(echo "$2" | tr , " "); do echo "$id|COMPLETED|n1|0:0"; done\n')
    for tool in ("squeue", "sacct"):
        (shims / tool).chmod(0o755)
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=fake\n")
    root = tmp_path / "runs"
    fake_runs(root, 3)
    folder = tmp_path / "sites"
    folder.mkdir()
    for name in BUNDLED:
        profile(folder, name, root)
    env = {"PATH": f"{shims}:{os.environ['PATH']}", "SLURM_CONF": str(conf), "HPCX_SITE_PATH": str(folder),
           "XDG_CACHE_HOME": str(tmp_path / "cache"), "XDG_STATE_HOME": str(tmp_path / "state"),
           "HOME": str(tmp_path / "home")}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return log


def started(log: Path) -> list[tuple[str, int, str]]:
    lines = log.read_text().splitlines() if log.exists() else []
    return [(tool, int(pid), args) for tool, pid, args in (line.split(" ", 2) for line in lines)]


def fast_status(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CONSOLE_SCRIPT, "status", *args], capture_output=True, text=True,
                          timeout=300, cwd=REPO, env=os.environ.copy())  # a hang guard, far below the 3600 s sleeps


def click_status(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpc.cli", "status", *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env=os.environ.copy())


def test_the_remembered_queries_are_the_ones_the_list_takes(tools):
    first = fast_status()
    assert first.returncode == 0 and first.stdout.count("  RUNNING  ") == 3, first.stderr
    assert sorted(t for t, _, _ in started(tools)) == ["sacct", "squeue"]
    remembered = status.remembered_queries()
    assert sorted(cmd[0] for cmd in remembered) == ["sacct", "squeue"]
    again = fast_status()
    assert sorted(t for t, _, _ in started(tools)) == ["sacct", "sacct", "squeue", "squeue"]  # once each, not twice
    assert status.remembered_queries() == remembered
    assert again.stdout == first.stdout == click_status().stdout


def test_the_started_queries_are_handed_to_the_list_not_run_again(tools):
    fast_status()
    before = len(started(tools))
    procs.start_ahead(status.remembered_queries())
    try:
        deadline = time.monotonic() + 120
        while len(started(tools)) < before + 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(started(tools)) == before + 2  # both running before the list is asked for
        infos = status.recent(lambda message: None)
        assert procs._AHEAD == {}  # both taken
    finally:
        assert procs.stop_ahead() == 0
    assert len(started(tools)) == before + 2  # and neither started again
    assert [i["state"] for i in infos] == ["RUNNING"] * 3


PROBE = ("import sys\n"
         "from hpc.core import procs\n"
         "real = procs.start_ahead\n"
         "def spy(cmds):\n"
         "    cmds = list(cmds)\n"
         "    print('AHEAD', len(cmds), *[m for m in ('hpc.login.submit', 'hpc.core.runs', 'dataclasses', 'tomllib',\n"
         "          'hpc.core.site', 'hpc.schedulers') if m in sys.modules], file=sys.stderr)\n"
         "    real(cmds)\n"
         "procs.start_ahead = spy\n"
         "from hpc.entry import main\n"
         "main()\n")


def test_the_queries_start_before_the_list_imports_its_code(tools):
    fast_status()
    done = subprocess.run([sys.executable, "-c", PROBE, "status"], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env=os.environ.copy())
    assert done.returncode == 0, done.stderr
    assert "AHEAD 2" in done.stderr.splitlines()  # two commands, and none of those modules loaded yet


def test_the_second_list_parses_no_profile_and_imports_no_toml_parser(tools):
    fast_status()
    probe = ("import sys\nfrom hpc.entry import main\ntry:\n    main()\nexcept SystemExit:\n    pass\n"
             "print('LOADED', *[m for m in ('tomllib', 'tomli', 'hpc.core.site') if m in sys.modules], file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", probe, "status"], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env=os.environ.copy())
    assert "LOADED" in done.stderr.splitlines(), done.stderr


def running(marker: str) -> list[int]:
    """The processes whose command line holds ``marker``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read() and procs.pid_alive(int(pid)):
                    found.append(int(pid))
        except OSError:
            pass
    return found


def test_queries_this_list_does_not_ask_are_killed_when_it_ends(tools, tmp_path):
    hang = tmp_path / "bin" / "hpcx-test-hang"
    hang.write_text("#!/bin/sh\nexec sleep 3600.25\n")
    hang.chmod(0o755)
    cache.write(status.QUERIES, {"commands": [["hpcx-test-hang"], ["sacct", "-j", "123,456", "-X"]]})
    done = fast_status()  # its timeout is the hang guard: it never waits for a query it does not take
    assert done.returncode == 0 and done.stdout.count("  RUNNING  ") == 3, done.stderr
    assert running("3600.25") == [] and running("hpcx-test-hang") == []  # killed and reaped
    assert [a for t, _, a in started(tools) if t == "sacct" and not a.startswith("-j 123,456")]  # its own ran
    assert sorted(cmd[0] for cmd in status.remembered_queries()) == ["sacct", "squeue"]  # what it did ask


def test_a_wrapper_that_leaves_a_child_holding_the_pipe_is_killed_with_it(tools, tmp_path):
    wrapper = tmp_path / "bin" / "hpcx-test-wrapper"
    wrapper.write_text("#!/bin/sh\nsleep 3600.75 &\nexec sleep 3600.5\n")  # its child keeps stdout open
    wrapper.chmod(0o755)
    cache.write(status.QUERIES, {"commands": [["hpcx-test-wrapper"]]})
    done = fast_status()  # its timeout is the hang guard: the pipes are not read to the end
    assert done.returncode == 0 and done.stdout.count("  RUNNING  ") == 3, done.stderr
    assert running("3600.5") == [] and running("3600.75") == []  # the wrapper and its child


def test_a_controller_that_went_down_leaves_no_query_behind(tools, tmp_path, monkeypatch):
    fast_status()
    (tmp_path / "bin" / "squeue").write_text("#!/bin/sh\nexec sleep 3600.5\n")
    monkeypatch.setenv("SLURM_CONF", str(bogus_conf(tmp_path)))  # the probe finds no controller: squeue unasked
    done = fast_status()
    assert done.returncode == 0 and done.stdout.count("  COMPLETED  ") == 3, done.stderr  # sacct's word
    assert running("3600.5") == []
    assert [cmd[0] for cmd in status.remembered_queries()] == ["sacct"]  # not started again next time


def test_a_query_that_fails_ahead_fails_as_it_would_have(tools, tmp_path):
    fast_status()
    (tmp_path / "bin" / "sacct").write_text("#!/bin/sh\necho 'sacct: error: slurmdbd down' >&2\nexit 1\n")
    (tmp_path / "bin" / "squeue").write_text("#!/bin/sh\nexit 0\n")  # nothing queued: the answer is sacct's
    fast, click = fast_status(), click_status()
    assert (fast.returncode, fast.stdout, fast.stderr) == (click.returncode, click.stdout, click.stderr)
    assert fast.stdout.count("  UNKNOWN  ") == 3


BAD_RECORDS = [
    {"commands": [["/bin/touch", "{marker}"]]},  # a path, not a name on $PATH
    {"commands": [["./touch", "{marker}"]]},
    {"commands": [["-touch", "{marker}"]]},
    {"commands": [[""]]},
    {"commands": [[]]},
    {"commands": [["touch", 5]]},
    {"commands": [["touch", "{marker}\u0000x"]]},
    {"commands": "touch {marker}"},
    {"commands": [["touch", "{marker}"]] * (status.MAX_QUERIES + 1)},
    {"command": [["touch", "{marker}"]]},
    [["touch", "{marker}"]],
]


@pytest.mark.parametrize("record", BAD_RECORDS)
def test_a_malformed_query_record_starts_nothing(tools, tmp_path, record):
    marker = tmp_path / "marker"
    cache.write(status.QUERIES, json.loads(json.dumps(record).replace("{marker}", str(marker))))
    assert status.remembered_queries() == []
    done = fast_status()
    assert done.returncode == 0 and done.stdout.count("  RUNNING  ") == 3
    assert not marker.exists()


@pytest.mark.parametrize("how", [_group_writable, _someone_elses, _a_symlink])
def test_a_query_record_others_could_have_written_starts_nothing(tools, tmp_path, how):
    if how is _someone_elses and os.getuid() != 0:
        pytest.skip("needs root to give the file away")  # CI runs as root
    marker = tmp_path / "marker"
    cache.write(status.QUERIES, {"commands": [["touch", str(marker)]]})
    assert status.remembered_queries() == [["touch", str(marker)]]  # believed while it is the caller's alone
    how(cache.cache_path(status.QUERIES))
    assert status.remembered_queries() == []
    fast_status()
    assert not marker.exists()


@pytest.mark.parametrize("content", [b"", b"{", b"[" * 100000, b"\xff", b"null", b'{"commands": null}'])
def test_a_torn_query_record_is_replaced_by_what_the_list_asked(tools, content):
    cache.cache_path(status.QUERIES).parent.mkdir(parents=True, exist_ok=True)
    cache.cache_path(status.QUERIES).write_bytes(content)
    cache.cache_path(status.QUERIES).chmod(0o600)
    done = fast_status()
    assert done.returncode == 0 and done.stdout.count("  RUNNING  ") == 3
    assert sorted(cmd[0] for cmd in status.remembered_queries()) == ["sacct", "squeue"]


@pytest.mark.parametrize("value", ["", "relative/cache", "./x"])
def test_a_cache_home_that_is_not_absolute_means_the_default(monkeypatch, tmp_path, value):
    monkeypatch.setenv("XDG_CACHE_HOME", value)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache.cache_path("x.json") == tmp_path / ".cache" / "hpcx" / "x.json"
