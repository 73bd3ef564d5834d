"""Errors of the job's own code, told from the machine's (``hpc.core.failures.user_code_error``) and said in
one line naming the file and line: at import of the task module (not only ImportError), in the task's
constructor, its loss, forward, metrics, collate, dataset (in the loader's process or a worker's), a loss
without grad; what looks like the machine or the network (NCCL, gloo, CUDA, a lost peer, OOM) is not
blamed on the code. ``hpcx dryrun`` names the task module. The runs themselves:
tests/resilience/test_user_errors_local.py."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from hpc.core.errors import ConfigError
from hpc.core.failures import code_roots, first_failure_account, user_code_error, would_repeat
from hpc.core.spec import spec_from_dict
from tests.conftest import hpcx

TASK = '''
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset


class Broken(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return {"x": torch.ones(4)}["y"]


class Good:
    def __init__(self, mode="ok"):
        self.mode = mode
        if mode == "init":
            raise ValueError("width must be even")

    def build_model(self):
        return nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4)), nn.Linear(4, 2))

    def units(self, model):
        return nn.ModuleList([model[1]])

    def train_dataset(self):
        return Broken() if self.mode == "dataset" else TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))

    def loss(self, model, batch):
        x, y = batch
        if self.mode == "key":
            return {"loss": 1}["los"]
        if self.mode == "shape":
            x = x[:, :3]
        loss = nn.functional.cross_entropy(model(x), y)
        if self.mode == "detach":
            return loss.detach()
        if self.mode == "item":
            return torch.tensor(loss.item())
        if self.mode == "nograd":
            with torch.no_grad():
                return nn.functional.cross_entropy(model(x), y)
        if self.mode == "nccl":
            raise RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error")
        if self.mode == "peer":
            raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]:4000")
        if self.mode == "oom":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if self.mode == "reset":
            raise ConnectionResetError(104, "Connection reset by peer")
        return loss

    def metrics(self, model, batch):
        return {"accuracy": (1, 1 / 0)}

    def collate(self, samples):
        if self.mode == "collate":
            return samples.stack()
        return torch.utils.data.default_collate(samples)
'''


@pytest.fixture
def tasks(tmp_path, monkeypatch):
    package = tmp_path / "mytasks"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "good.py").write_text(textwrap.dedent(TASK))
    (package / "syntax.py").write_text("x = 1\ndef broken(:\n    pass\n")
    (package / "name.py").write_text("import torch\n\nWIDTH = undefined_width * 2\n")
    (package / "zero.py").write_text("import torch\n\n\nclass T:\n    pass\n\n\nRATIO = 1 / 0\n")
    (package / "missing.py").write_text("import not_a_package_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield package
    for name in [m for m in sys.modules if m == "mytasks" or m.startswith("mytasks.")]:
        sys.modules.pop(name)


def seam(module: str, cls: str = "Good", **kwargs):
    from trainer.tasks import task_for

    return task_for(spec_from_dict({"task": {"target": f"mytasks.{module}:{cls}", "kwargs": kwargs}}))


def one_message(info: pytest.ExceptionInfo) -> str:
    (message,) = info.value.messages
    assert len(message.splitlines()) == 1 and "Traceback" not in message
    assert would_repeat(info.value, "train", 50)  # never requeued, whatever the step
    return message


@pytest.mark.parametrize("module,words,line", [
    ("syntax", "importing 'mytasks.syntax' raised SyntaxError: invalid syntax", "syntax.py:2)"),
    ("name", "importing 'mytasks.name' raised NameError: name 'undefined_width' is not defined", "name.py:3 in <module>)"),
    ("zero", "importing 'mytasks.zero' raised ZeroDivisionError: division by zero", "zero.py:8 in <module>)"),
    ("missing", "cannot import 'mytasks.missing' here: No module named 'not_a_package_anywhere'", ""),
])
def test_an_error_at_import_of_the_task_module_is_one_line_naming_its_file_and_line(tasks, module, words, line):
    with pytest.raises(ConfigError) as info:
        seam(module, "T")
    message = one_message(info)
    assert message.startswith(f"`task.target` = 'mytasks.{module}:T': {words}") and message.endswith(line), message
    if line:
        assert str(tasks / f"{module}.py") in message


def test_an_error_in_the_tasks_constructor_names_its_line(tasks):
    with pytest.raises(ConfigError) as info:
        seam("good", mode="init")
    message = one_message(info)
    assert "Good(**task.kwargs) raised ValueError: width must be even (at " in message
    assert f"{tasks / 'good.py'}:" in message and message.endswith("in __init__)")


@pytest.mark.parametrize("mode", ["detach", "item", "nograd"])
def test_a_loss_without_grad_is_one_line_naming_the_method(tasks, mode):
    task = seam("good", mode=mode)
    model = task.meta_model().to_empty(device="cpu")
    batch = task.collate([task.train_dataset()[i] for i in range(4)])
    with pytest.raises(ConfigError) as info:
        task.micro_loss(model, batch, 1.0, torch.autocast("cpu", enabled=False))
    message = one_message(info)
    assert f"loss(model, batch) (defined at {tasks / 'good.py'}:" in message
    assert message.endswith("returned a loss that does not require grad: computed without the model's parameters, "
                            "under no_grad, or detached")


def raised(call) -> BaseException:
    try:
        call()
    except BaseException as exc:  # noqa: BLE001
        return exc
    raise AssertionError("nothing raised")


def run_loss(task, mode: str):
    model = task.meta_model().to_empty(device="cpu")
    batch = task.collate([task.train_dataset()[i] for i in range(4)])
    return lambda: task.micro_loss(model, batch, 1.0, torch.autocast("cpu", enabled=False))


@pytest.mark.parametrize("mode,cls,function", [
    ("key", "KeyError", "loss"), ("shape", "RuntimeError", "loss"),
])
def test_an_error_in_the_loss_or_the_forward_is_the_codes(tasks, mode, cls, function):
    exc = raised(run_loss(seam("good", mode=mode), mode))
    where = user_code_error(exc, code_roots(["mytasks.good"]))
    assert type(exc).__name__ == cls and where is not None and where.endswith(f" in {function}")
    assert where.startswith(f"{tasks / 'good.py'}:")


@pytest.mark.parametrize("mode", ["nccl", "peer", "oom", "reset"])
def test_the_machines_and_the_networks_failures_are_not_the_codes_even_under_it(tasks, mode):
    exc = raised(run_loss(seam("good", mode=mode), mode))
    assert user_code_error(exc, code_roots(["mytasks.good"])) is None


def test_an_error_in_the_metrics_and_in_collate_is_the_codes(tasks):
    task = seam("good")
    model = task.meta_model().to_empty(device="cpu")
    batch = task.collate([task.train_dataset()[i] for i in range(4)])
    with torch.no_grad():
        exc = raised(lambda: task.eval_terms(model, batch, 4, torch.autocast("cpu", enabled=False)))
    assert isinstance(exc, ZeroDivisionError) and user_code_error(exc, code_roots(["mytasks"])).endswith("in metrics")
    collating = seam("good", mode="collate")
    exc = raised(lambda: collating.collate([collating.train_dataset()[0]]))
    assert user_code_error(exc, code_roots(["mytasks.good"])).endswith("in collate")


@pytest.mark.parametrize("workers", [0, 1])
def test_an_error_in_the_dataset_is_the_codes_in_this_process_or_a_loader_worker(tasks, workers):
    task = seam("good", mode="dataset")
    loader = DataLoader(task.train_dataset(), batch_size=2, num_workers=workers)
    exc = raised(lambda: next(iter(loader)))
    where = user_code_error(exc, code_roots(["mytasks.good"]))
    assert isinstance(exc, KeyError) and where is not None and where.endswith("in __getitem__"), exc


def test_an_error_outside_the_jobs_code_is_not_the_codes(tasks):
    exc = raised(lambda: torch.ones(2) @ torch.ones(3))
    assert user_code_error(exc, code_roots(["mytasks.good"])) is None
    assert user_code_error(KeyboardInterrupt(), code_roots(["mytasks.good"])) is None


def test_the_rank_that_failed_first_on_its_own_is_named():
    echo = {"rank": 0, "time": 3.0, "error": "RuntimeError: Connection closed by peer [127.0.0.1]:2"}
    own = [{"rank": 2, "time": 2.0, "error": "ValueError: b"}, {"rank": 1, "time": 1.0, "error": "KeyError: a"}]
    reports = sorted([echo, *own], key=lambda r: r["time"])
    assert first_failure_account(reports, []) == {"failed_ranks": [1], "reported_ranks": [0, 1, 2],
                                                  "error": "KeyError: a"}
    killed = first_failure_account([echo], [{"ranks": [0, 3], "first": True}])
    assert killed["failed_ranks"] == [3] and killed["reported_ranks"] == [0]
    assert killed["error"] == ("rank 3 ended without a Python error (killed: out of memory, SIGKILL); rank 0 then "
                               "lost the connection to it")
    assert first_failure_account([echo], [])["failed_ranks"] == [0] and first_failure_account([], []) == {}


def test_dryrun_names_the_task_module_for_its_import_error(tmp_path):
    # a class with the whole protocol (the login-side check reads it with ast and passes it); its body
    # fails only when imported
    methods = "".join(f"\n    def {m}(self, *a):\n        pass\n" for m in ("build_model", "units", "train_dataset",
                                                                         "loss"))
    (tmp_path / "bad_task.py").write_text("import torch\n\nclass T:\n    width = undefined_width\n" + methods)
    (tmp_path / "job.toml").write_text('[job]\nname = "bad"\n[task]\ntarget = "bad_task:T"\n')
    out = hpcx("dryrun", "job.toml", cwd=tmp_path, timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    line = out.stderr.strip().splitlines()[-1]
    assert "importing 'bad_task' raised NameError: name 'undefined_width' is not defined" in line, out.stderr
    assert f"{tmp_path / 'bad_task.py'}:4 in T)" in line and "build_model" not in line


def test_a_plain_modules_helpers_beside_it_are_the_jobs_code_but_not_hpcx_nor_a_venv(tmp_path, monkeypatch):
    (tmp_path / "plain_task.py").write_text("import plain_helper\n\n\ndef run():\n    return plain_helper.bad()\n")
    (tmp_path / "plain_helper.py").write_text("def bad():\n    return {}['missing']\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        import plain_task

        exc = raised(plain_task.run)
        roots = code_roots(["plain_task"])
        assert roots == [str(tmp_path.resolve())]
        assert user_code_error(exc, roots) == f"{tmp_path.resolve() / 'plain_helper.py'}:2 in bad"
    finally:
        sys.modules.pop("plain_task", None)
        sys.modules.pop("plain_helper", None)
    from hpc.core.failures import HPCX_PACKAGES, in_roots

    checkout = str(Path(HPCX_PACKAGES[0]).parent)  # a task submitted from hpcx's own checkout
    assert not in_roots(f"{checkout}/trainer/loop.py", [checkout]) and in_roots(f"{checkout}/examples/x.py", [checkout])
    assert not in_roots(f"{checkout}/.venv/lib/python3.11/site-packages/torch/nn/x.py", [checkout])
