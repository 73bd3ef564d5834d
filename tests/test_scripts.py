"""scripts/test-all and scripts/sandbox-image: the parts that run before any test can report."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _lines(name: str) -> list[str]:
    return [line.strip() for line in (ROOT / "scripts" / name).read_text().splitlines()]


def test_test_all_sets_the_teardown_before_the_cluster_starts_and_before_the_image_build() -> None:
    lines = _lines("test-all")
    trap = next(n for n, line in enumerate(lines) if line.startswith("trap ") and "slurm-sandbox down" in line)
    for step in ("scripts/slurm-sandbox up", "scripts/sandbox-image"):
        assert trap < next(n for n, line in enumerate(lines) if line.startswith(step)), step


def _image(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "sandbox-image"), "--check", *args],
                          capture_output=True, text=True, env=full, timeout=120)


def test_sandbox_image_sources_given_explicitly_do_not_depend_on_home(tmp_path: Path) -> None:
    """The same explicit sources give the same image key (so the same --check answer) under any HOME."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    words = f"--find-links={wheels} --index-url file://{tmp_path}/simple"
    answers = {_image(env={"HOME": str(home), "HPCX_IMAGE_PIP_ARGS": words}).stdout
               for home in (tmp_path, Path("/nonexistent"), Path.home())}
    assert len(answers) == 1 and answers.pop().startswith(("missing:", "both images"))


def test_sandbox_image_refuses_a_source_it_cannot_use_in_one_line() -> None:
    for words, expected in [("--find-links", "no value follows"), ("--bogus=1", "expected --index-url"),
                            ("--index-url", "no value follows"), ("--pre", "expected --index-url")]:
        out = _image(env={"HPCX_IMAGE_PIP_ARGS": words})
        assert out.returncode == 1 and out.stderr.count("\n") == 1, (words, out.stderr)
        assert expected in out.stderr and "Traceback" not in out.stderr
