"""Input hardening beyond the corpus (issue 14): what reaches the script, the screen and the disk.

The corpus (tests/corpus/, driven by test_spec.py) holds the one-file cases; here are the checks
that need a rendered script, bash, a second user, a full file system or the CLI as a whole.
"""

from __future__ import annotations

import json
import os
import resource
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from hpc.login import roots
from hpc.core import validate
from hpc.schedulers.slurm import limits as slurm_limits
from hpc.schedulers.slurm import options as slurm_options
from hpc.core.config import ConfigError, load_json_bounded
from hpc.login.render import render
from hpc.schedulers.slurm.scheduler import setup_lines, slurm_parameters
from hpc.plan.resolve import resolve
from hpc.core.site import load_site, parse_site
from hpc.core.spec import load_spec
from tests.conftest import REPO, hpcx

JOB = REPO / "jobs/tiny-ddp.toml"
CORPUS = REPO / "tests/corpus"


def sbatch_directive_words(line: str) -> list[str]:
    """The words sbatch takes from one ``#SBATCH`` line, read the way Slurm 22.05's directive parser
    reads them (src/sbatch/opt.c, _get_argument): whitespace separates words, single and double quotes
    group, a backslash escapes the next character *also inside quotes*, an unquoted ``#`` ends the line,
    and a quote left open is an error (ValueError here; sbatch stops with "Unmatched `'`").
    tests/slurm/test_inputs_slurm.py checks the same values against the real sbatch."""
    text, words, i = line[len("#SBATCH"):], [], 0
    while i < len(text):
        while i < len(text) and text[i].isspace():
            i += 1
        word, quote, started = [], "", False
        while i < len(text) and (quote or not text[i].isspace()):
            ch = text[i]
            if ch == "\\" and i + 1 < len(text):
                word.append(text[i + 1])
                i += 2
                continue
            if quote and ch == quote:
                quote = ""
            elif not quote and ch in "'\"":
                quote = ch
            elif not quote and ch == "#":
                i = len(text)
                break
            else:
                word.append(ch)
            started = True
            i += 1
        if quote:
            raise ValueError(f"unmatched {quote} in {line!r}")
        if word or started:
            words.append("".join(word))
    return words


NASTY = [r"a\b\\c", "back\\", "\\'", "q'uote", 'd"q', "hash #x", "sp ace", "$HOME`id`$(id)", "semi;colon&|",
         "uni日本é", 'mix \\" \'"\' \\\\\'', "--uid=0", "=", "%j%u", "a b\\ c", "'", '"', "\\\\\\"]


def sbatch_value(script: str, option: str) -> str:
    lines = [line for line in script.splitlines() if line.startswith(f"#SBATCH --{option}=")]
    assert len(lines) == 1, lines
    [word] = sbatch_directive_words(lines[0])
    return word.split("=", 1)[1]


def site_with(tmp_path: Path, extra: str, base: str = "sandbox") -> Path:
    path = tmp_path / f"{base}-x.toml"
    path.write_text((REPO / "site" / f"{base}.toml").read_text() + extra)
    return path


@pytest.mark.parametrize("value", NASTY)
def test_directive_values_survive_the_sbatch_parser(value: str, tmp_path: Path):
    """job.name, partition, account, qos and [scheduler.sbatch] values come back byte for byte."""
    site = load_site(str(site_with(tmp_path, f"[scheduler.sbatch]\ncomment = {json.dumps(value)}\n")))
    overrides = [f"job.name={json.dumps(value if not value.startswith('-') else 'x' + value)}",
                 f"job.account={json.dumps(value)}", f"job.qos={json.dumps(value)}", "job.nodes=1"]
    spec = load_spec(JOB, overrides)
    script = render(spec, site, resolve(spec, site), "/runs/RUN", "/venv/bin/python")
    assert sbatch_value(script, "comment") == value
    assert sbatch_value(script, "account") == value and sbatch_value(script, "qos") == value
    assert sbatch_value(script, "job-name") == spec.job.name


def test_directive_parser_model_reads_the_observed_bug():
    # what Slurm did before directive_value: a job named a\b\\c showed as ab\c
    assert sbatch_directive_words("#SBATCH --job-name='a\\b\\\\c'") == ["--job-name=ab\\c"]
    assert sbatch_directive_words("#SBATCH --job-name=abc#def") == ["--job-name=abc"]
    assert sbatch_directive_words("#SBATCH --constraint='x --uid=0'") == ["--constraint=x --uid=0"]
    with pytest.raises(ValueError):  # shlex.quote('back\\'): the backslash escapes the closing quote
        sbatch_directive_words("#SBATCH --comment='back\\'")


def test_flag_and_false_options(tmp_path: Path):
    site = load_site(str(site_with(tmp_path, "[scheduler.sbatch]\nexclusive = true\nhold = false\nnice = -5\n")))
    spec = load_spec(JOB, ["job.nodes=1"])
    script = render(spec, site, resolve(spec, site), "/runs/RUN", "/venv/bin/python")
    assert "#SBATCH --exclusive\n" in script and "--hold" not in script
    assert sbatch_value(script, "nice") == "-5"


def test_site_env_names_render_as_plain_exports_and_run_nothing(tmp_path: Path):
    """Allowed [nccl] names (GLOO_*, PYTORCH_* included) with hostile values: bash runs the setup
    lines and gets every value back byte for byte; nothing else runs."""
    marker = tmp_path / "ran"
    hostile = f"$(touch {marker});`touch {marker}`'\"\\ *"
    table = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "GLOO_SOCKET_IFNAME": hostile,
             "NCCL_DEBUG": "INFO", "TORCH_NCCL_BLOCKING_WAIT": hostile}
    site = parse_site({"scheduler": {"kind": "slurm"}, "nccl": table}, "x", "x.toml")
    spec = load_spec(JOB, [f"env.set.MY_VAR={json.dumps(hostile)}"])
    lines = setup_lines(spec, site)
    names = sorted([*table, "MY_VAR"])
    script = "\n".join(lines + [f'printf "%s\\0" "${n}"' for n in names])
    env = {k: v for k, v in os.environ.items() if k not in table}
    out = subprocess.run(["bash", "-c", script], capture_output=True, env=env, check=True)
    got = dict(zip(names, out.stdout.decode().split("\0")))
    assert got == {**table, "MY_VAR": hostile}
    assert not marker.exists()


def test_passthrough_and_user_code_are_stated(tmp_path: Path):
    spec = tmp_path / "job.toml"
    spec.write_text('[model]\narch = "os:system"\nkwargs = {command = "id"}\nseq_len = 8\nvocab_size = 16\n'
                    '[env]\npassthrough = ["HPCX_TEST_SET", "HPCX_TEST_UNSET"]\n[parallel]\nstrategy = "ddp"\n')
    env = {"HPCX_TEST_SET": "1"}
    os.environ.pop("HPCX_TEST_UNSET", None)
    out = hpcx("render", str(spec), env=env)
    assert out.returncode == 0, out.stderr
    assert ("warning: `env.passthrough` names HPCX_TEST_UNSET, but it is not set in this shell: the job "
            "will not see it") in out.stderr.splitlines()
    assert "HPCX_TEST_SET, but" not in out.stderr
    assert ("# user code: every task will import the Python module 'os' and call system(command) (model.arch); "
            "it runs with your permissions, so check it is the code you mean") in out.stderr.splitlines()
    gpt = hpcx("render", str(JOB))
    assert "user code" not in gpt.stderr and "warning" not in gpt.stderr


def test_render_of_a_device_fails_at_once():
    for path in ("/dev/zero", "/dev/urandom"):
        out = hpcx("render", path, timeout=30)
        assert out.returncode == 2
        assert out.stderr == f"error: {path}: a character device: expected a regular TOML file\n"


def test_error_lines_are_printable(tmp_path: Path):
    """A file name or key with control characters is escaped on the way to the terminal."""
    spec = tmp_path / "evil\b\b\b\x1b[2J\u2028.toml"
    spec.write_text('[job]\n"na\\u0007me" = 1\n')
    out = hpcx("render", str(spec))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert all(ch.isprintable() for line in out.stderr.splitlines() for ch in line), repr(out.stderr)
    assert "evil\\x08\\x08\\x08\\x1b[2J\\u2028.toml" in out.stderr and "job.na\\x07me" in out.stderr


def test_huge_job_name_is_refused_in_one_short_line():
    with pytest.raises(ConfigError) as info:
        load_spec(JOB, ["job.name=" + "x" * 50_000_000])
    [message] = info.value.messages
    assert message.endswith("`job.name` is 50000000 characters long: expected at most 128")
    assert len(message) < 300


def test_secret_values_are_never_printed(tmp_path: Path, monkeypatch):
    """Every secrets case plants `value-must-not-be-shown` or a token: no message may show it."""
    from tests.test_spec import run_case

    planted = ("value-must-not-be-shown", "hunter2", "ghp_", "hf_", "AKIA", "eyJ", "xoxb", "BEGIN", "12345678")
    for case in sorted((CORPUS / "secrets").glob("*.toml")):
        folder = tmp_path / case.stem
        folder.mkdir()
        messages = run_case(case, folder, monkeypatch) or []
        assert not [m for m in messages for p in planted if p in m.split(": ", 1)[1]], case


SECRET_NAMES = ["GITHUB_PAT", "DB_PASS", "DB_PASSWD", "MYSQL_PWD", "MY_CREDENTIALS", "PRIVATE_KEY_PEM",
                "GPG_PASSPHRASE", "CI_JOB_JWT", "DATABASE_URL", "APIKEY", "AWS_ACCESS_KEY_ID", "HF_TOKEN2", "hf_token",
                "WandbApiKey", "SLACK_WEBHOOK_SECRET", "TWINE_PASSWORD", "CELERY_BROKER_URL", "PG_DSN",
                "OAUTH_REFRESH_TOKEN", "ID_TOKEN_FILE", "X_AUTH"]


@pytest.mark.parametrize("name", SECRET_NAMES)
def test_secret_names(name: str):
    assert validate.looks_secret(name)


@pytest.mark.parametrize("name", ["NCCL_DEBUG", "OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM", "PATH", "PWD", "OLDPWD",
                                  "PYTHONPATH", "NCCL_IB_PKEY", "SSH_AUTH_SOCK", "pad_token_id", "num_key_value_heads",
                                  "max_tokens", "HF_HOME", "KEYBOARD", "MASTER_PORT", "PYTORCH_CUDA_ALLOC_CONF"])
def test_not_secret_names(name: str):
    assert not validate.looks_secret(name)


# ---------------------------------------------------------------------------------- data files


def test_unreadable_data_file(tmp_path: Path):
    """A token file the submitting user cannot read is refused on the login node. As root (who reads
    everything) the check runs as `nobody`."""
    folder = Path(tempfile.mkdtemp(prefix="hpcx-unreadable-"))
    try:
        folder.chmod(0o755)
        tokens = folder / "tokens.bin"
        tokens.write_bytes(b"\0\0" * 1000)
        tokens.chmod(0)
        spec = folder / "job.toml"
        spec.write_text(f'[data]\nsource = "{tokens}"\n')
        spec.chmod(0o644)
        command = [sys.executable, "-m", "hpc.cli", "render", str(spec)]
        if os.geteuid() == 0:
            command = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", *command]
        out = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=60,
                             env={**os.environ, "HOME": str(folder)})
        assert out.returncode == 2, out.stderr
        assert out.stderr == f"error: {spec}: `data.source` = '{tokens}': cannot open: Permission denied\n"
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_data_source_is_recorded_absolute(tmp_path: Path, monkeypatch):
    (tmp_path / "tokens.bin").write_bytes(b"\1\0" * 1000)
    monkeypatch.chdir(tmp_path)
    spec = load_spec(JOB, ['data.source="tokens.bin"'])
    assert spec.data.source == str(tmp_path / "tokens.bin")


# --------------------------------------------------------------------------- run roots and index


def test_run_root_is_expanded_and_absolute(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("HPCX_TEST_SCRATCH", str(tmp_path))
    spec = load_spec(JOB, ['job.run_root="${HPCX_TEST_SCRATCH}/a/../runs"'])
    assert spec.job.run_root == str(tmp_path / "runs")


def test_unset_site_run_root_fails_render_not_load(tmp_path: Path, monkeypatch):
    monkeypatch.delenv("HPCX_TEST_SCRATCH", raising=False)
    site_file = tmp_path / "scratch.toml"
    site_file.write_text('[storage]\nrun_root = "$HPCX_TEST_SCRATCH/runs"\n')
    site = load_site(str(site_file))  # planning needs no run root
    out = hpcx("render", str(JOB), "--site", str(site_file), env={"HPCX_TEST_SCRATCH": ""})
    assert site.name == "scratch"
    assert out.returncode == 0  # set (even empty) is not unset: `/runs`
    env = {k: v for k, v in os.environ.items() if k != "HPCX_TEST_SCRATCH"}
    out = subprocess.run([sys.executable, "-m", "hpc.cli", "render", str(JOB), "--site", str(site_file)],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
    assert out.returncode == 2
    assert out.stderr == (f"error: {site_file}: `storage.run_root` = '$HPCX_TEST_SCRATCH/runs': "
                          "$HPCX_TEST_SCRATCH is not set in this shell: set it, or write the path out\n")


def fake_run(root: Path, name: str, job_id: str) -> Path:
    """A finished run folder as submit leaves it (no scheduler is asked about a COMPLETED run)."""
    run = root / name
    (run / "logs").mkdir(parents=True)
    (run / "resolved.json").write_text(json.dumps({"version": 1, "launch": {"strategy": "ddp", "world_size": 2}}))
    (run / "job.json").write_text(json.dumps({"job_id": job_id, "scheduler": "slurm"}))
    (run / "states.jsonl").write_text(json.dumps({"state": "COMPLETED", "time": 0}) + "\n")
    (run / "logs" / "rank-0.log").write_text("hello from rank 0\n")
    return run


def test_runs_under_a_spec_run_root_are_found_by_name_and_job_id(tmp_path: Path):
    state = tmp_path / "state"
    elsewhere = tmp_path / "elsewhere"
    run = fake_run(elsewhere, "mine-20260101-000000-abcdef", "987654321")
    env = {"XDG_STATE_HOME": str(state)}
    assert hpcx("status", run.name, env=env).returncode == 2  # not in any site's run root, not indexed
    index = state / "hpcx" / "run-roots"
    index.parent.mkdir(parents=True)
    index.write_text(f"{tmp_path / 'gone'}\n{elsewhere}\n")
    by_name = hpcx("status", run.name, "--json", env=env)
    assert by_name.returncode == 0, by_name.stderr
    assert json.loads(by_name.stdout)["run_dir"] == str(run)
    by_id = hpcx("status", "987654321", "--json", env=env)
    assert json.loads(by_id.stdout)["run_dir"] == str(run)
    assert hpcx("logs", run.name, env=env).stdout == "hello from rank 0\n"
    assert run.name in hpcx("status", env=env).stdout


def test_index_remembers_each_root_once_and_drops_vanished_ones(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    for root in (a, b, a):
        roots.remember(root)
    assert roots.index_path().read_text() == f"{a}\n{b}\n"
    b.rmdir()
    assert roots.remembered() == [a]
    monkeypatch.setattr(roots, "MAX_LINES", 2)
    c = tmp_path / "c"
    c.mkdir()
    roots.remember(c)  # over the limit: rewritten without the vanished b
    assert roots.index_path().read_text() == f"{a}\n{c}\n"


# ------------------------------------------------------------------------------------ full disk


def submit_with_file_limit(limit: int, root: Path, site: str = "local") -> subprocess.CompletedProcess:
    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return subprocess.run([sys.executable, "-m", "hpc.cli", "submit", str(JOB), "--site", site,
                           "--set", f"job.run_root={json.dumps(str(root))}"],
                          capture_output=True, text=True, cwd=REPO, timeout=120, preexec_fn=cap,
                          env={**os.environ, "XDG_STATE_HOME": str(root.parent / "state")})


@pytest.mark.parametrize("limit", [0, 1, 300, 2000])
def test_file_size_limit_at_submit_leaves_nothing(limit: int, tmp_path: Path):
    """RLIMIT_FSIZE makes writes past `limit` bytes fail (EFBIG) as a full disk would: one line,
    exit 2, no run folder, no temporary file; nothing was submitted (every limit here is below the
    size of resolved.json). tests/slurm/test_inputs_slurm.py fills a real tmpfs instead."""
    root = tmp_path / "runs"
    out = submit_with_file_limit(limit, root)
    assert out.returncode == 2, out.stdout + out.stderr
    [line] = out.stderr.splitlines()
    assert line.startswith(f"error: {root}/tiny-ddp-") and "cannot write the run folder (File too large)" in line
    assert line.endswith("nothing was submitted and the folder was removed")
    assert list(root.iterdir()) == []


def test_write_atomic_leaves_no_temp_file_when_the_disk_fills(tmp_path: Path):
    from hpc.core import runs

    script = ("import resource, sys; from pathlib import Path; from hpc.core import runs\n"
              "resource.setrlimit(resource.RLIMIT_FSIZE, (100, 100))\n"
              "try:\n    runs.write_atomic(Path(sys.argv[1]), 'x' * 1000)\nexcept OSError as e:\n    print(e.errno)\n")
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "f.txt")], capture_output=True, text=True,
                         cwd=REPO, timeout=60)
    assert out.stdout.strip() == "27", out.stderr  # EFBIG
    assert list(tmp_path.iterdir()) == []
    runs.write_atomic(tmp_path / "ok.txt", "fine")
    assert [p.name for p in tmp_path.iterdir()] == ["ok.txt"]


# --------------------------------------------------------------------------------- bounded JSON


def test_bounded_json_loader():
    assert load_json_bounded('{"a": [1, {"b": "[[[[{{{{"}]}', "x") == {"a": [1, {"b": "[[[[{{{{"}]}
    assert load_json_bounded(b'{"s": "\\"[[[["}', "x") == {"s": '"[[[['}
    nested: list = []
    for _ in range(31):
        nested = [nested]
    assert load_json_bounded("[" * 32 + "]" * 32, "x") == nested
    for text, message in (
        ("[" * 33 + "]" * 33, "hdr: JSON nested deeper than 32 levels (line 1, column 33)"),
        ("[" * 100000, "hdr: JSON nested deeper than 32 levels (line 1, column 33)"),
        ('{"a": ' * 50 + "1" + "}" * 50, "hdr: JSON nested deeper than 32 levels (line 1, column 193)"),
        ("{'a': 1}", "hdr: not valid JSON: Expecting property name enclosed in double quotes: "
                     "line 1 column 2 (char 1)"),
        (b"\xff\xfe", "hdr: not UTF-8 JSON (byte 0)"),
    ):
        with pytest.raises(ConfigError) as info:
            load_json_bounded(text, "hdr")
        assert info.value.messages == [message]


def test_bounded_json_loader_takes_the_callers_error_kind():
    from hpc.core.errors import CheckpointError

    header = b'{"__metadata__": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    with pytest.raises(CheckpointError):
        load_json_bounded(header, "model.safetensors header", CheckpointError)


def test_toml_nesting_scanner_skips_strings_and_comments():
    from hpc.core.config import TOML_SYNTAX, nesting_error

    deep = "[" * 40
    for text in (f'a = "{deep}"', f"a = '{deep}'", f'a = """\n{deep}\n"""', f"a = '''{deep}'''", f"# {deep}",
                 f'a = "\\"{deep}"'):
        assert nesting_error(text, TOML_SYNTAX) is None, text
    assert nesting_error(f'a = "x" # c\nb = {deep}', TOML_SYNTAX) == (2, 37)


def test_sbatch_abbreviation_rule_is_prefix_based():
    assert slurm_options.check_sbatch_key("k", "exclusive") == []
    assert slurm_options.check_sbatch_key("k", "gres-flags") == []
    assert slurm_options.check_sbatch_key("k", "time-min") == []
    for key in ("outp", "ou", "e", "ex", "job", "t", "no-re", "sig", "part", "acc", "gpus-per"):
        assert slurm_options.check_sbatch_key("k", key), key


def test_slurm_parameters_pass_bounds_through(tmp_path: Path):
    site = load_site(str(site_with(tmp_path, "")))
    spec = load_spec(JOB, ["job.nodes=1", f"job.time_limit_min={slurm_limits.SLURM_TIME_MAX_MIN}",
                           f"job.signal_lead_s={slurm_limits.SLURM_SIGNAL_MAX}"])
    params = slurm_parameters(spec, site, resolve(spec, site), str(tmp_path / "run"), "/venv/bin/python")
    assert (params["time"], params["signal_delay_s"]) == (35_791_393, 65_535)


def test_token_sample_reads_at_most_4_mib(tmp_path: Path):
    path = tmp_path / "big.bin"
    with path.open("wb") as f:
        f.truncate(200 * 2**20)  # sparse: 200 MB of token 0
    reads = []

    class Counting:
        def __init__(self, f):
            self.f = f

        def seek(self, n):
            self.f.seek(n)

        def read(self, n):
            data = self.f.read(n)
            reads.append(len(data))
            return data

    with path.open("rb") as f:
        assert validate.largest_token(Counting(f), path.stat().st_size, 2) == (0, 0)
    assert sum(reads) <= 4 * 2**20 and len(reads) == 64


def test_stat_modes_named():
    assert validate.file_kind(stat.S_IFDIR) == "a directory"
    assert validate.file_kind(stat.S_IFIFO) == "a FIFO (named pipe)"


def test_shell_quoting_of_setup_is_still_shlex():
    site = parse_site({"scheduler": {"kind": "slurm"}, "nccl": {"NCCL_DEBUG": "a b"}}, "x", "x.toml")
    spec = load_spec(JOB)
    assert f'[ -n "${{NCCL_DEBUG+x}}" ] || export NCCL_DEBUG={shlex.quote("a b")}' in setup_lines(spec, site)


def test_scale_node_counts_are_bounded():
    from hpc import scale

    with pytest.raises(ConfigError) as info:
        scale.parse_nodes("1,2147483648")
    assert info.value.messages == ["--nodes '1,2147483648': expected node counts from 1 to 2147483647, e.g. 1,2,4,8"]


@pytest.mark.parametrize("run_dir, message", [
    ("/runs/%u/x", "error: --run-dir '/runs/%u/x': expected a path without `%`: Slurm reads %u, %j … in "
                   "--output/--error as file-name patterns (use $USER and friends, which hpcx expands)"),
    ("/runs/\b", "error: `--run-dir` contains a backspace character (U+0008), which is not allowed in values that "
                 "reach the job script"),
])
def test_render_run_dir_option_is_checked_like_a_run_root(run_dir: str, message: str):
    out = hpcx("render", str(JOB), "--run-dir", run_dir)
    assert out.returncode == 2 and out.stderr.splitlines() == [message]


def test_site_list_escapes_profile_names(tmp_path: Path):
    (tmp_path / "evil\x1b[2J\b.toml").write_text("[node]\ngpus = 'x'\n")
    out = hpcx("site", "list", env={"HPCX_SITE_PATH": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert all(ch.isprintable() for line in out.stdout.splitlines() for ch in line), repr(out.stdout)
    assert "evil\\x1b[2J\\x08" in out.stdout


def test_hostile_run_folder_json_is_one_line(tmp_path: Path):
    """A run folder from elsewhere with deep or torn JSON: `status` says so in one line, or skips the line."""
    run = fake_run(tmp_path, "odd-20260101-000000-abcdef", "1")
    (run / "states.jsonl").write_text("[" * 100000 + "\n" + json.dumps({"state": "COMPLETED", "time": 0}) + "\n")
    out = hpcx("status", str(run), "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["state"] == "COMPLETED", out.stderr
    (run / "job.json").write_text('{"job_id": ' * 5000)
    out = hpcx("status", str(run))
    assert out.returncode == 2
    assert out.stderr == f"error: {run / 'job.json'}: JSON nested deeper than 32 levels (line 1, column 353)\n"
