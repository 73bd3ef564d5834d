"""One test per private torch/submitit API in ``hpc/compat.py``.

When a torch or submitit upgrade breaks one, its test fails with a message naming the
private API, where hpcx uses it and what to do; nothing else should need to be read.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import pickle
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest

from hpc import compat


@contextlib.contextmanager
def private_api(name: str, used_by: str, fix: str):
    """Turn any failure inside the block into one message that says what changed and what to do."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001  (any change of the private API is this failure)
        pytest.fail(f"private API {name} changed ({type(exc).__name__}: {exc}); hpcx uses it in {used_by}. "
                    f"To do: {fix}", pytrace=False)


def recorded_globals(data: bytes) -> set[tuple[str, str]]:
    """The (module, name) globals a pickle names, resolved as pickle would."""
    seen: set[tuple[str, str]] = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module: str, name: str):
            seen.add((module, name))
            if module == "torch._utils":  # rebuilding needs the storages; only the names matter here
                return lambda *args, **kwargs: None
            return super().find_class(module, name)

        def persistent_load(self, pid):
            return None

    Recorder(io.BytesIO(data)).load()
    return seen


def torch_save_pickle(obj) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    with zipfile.ZipFile(buf) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))


def test_compat_imports_neither_torch_nor_submitit() -> None:
    code = ("import sys, hpc.compat; bad = {'torch', 'submitit'} & set(sys.modules); "
            "assert not bad, f'hpc.compat imported {bad}'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_make_sbatch_string(tmp_path: Path) -> None:
    with private_api("submitit.slurm.slurm._make_sbatch_string", "hpc/render.py (hpcx render/submit)",
                     "adapt hpc.compat.make_sbatch_string to submitit's new signature, then refresh the "
                     "render goldens (tests/goldens) and check the diff"):
        text = compat.make_sbatch_string(command="python -c pass", folder=str(tmp_path), job_name="x", nodes=2)
        assert text.startswith("#!/bin/bash") and "#SBATCH --nodes=2" in text and "python -c pass" in text


def test_submitit_submit_module(tmp_path: Path) -> None:
    import importlib.util

    import submitit

    with private_api(f"{compat.SUBMITIT_SUBMIT_MODULE} (SlurmExecutor._submitit_command_str)",
                     "hpc/render.py (the command line of the sbatch script)",
                     "set hpc.compat.SUBMITIT_SUBMIT_MODULE to the module submitit's executor now runs"):
        assert importlib.util.find_spec(compat.SUBMITIT_SUBMIT_MODULE) is not None
        command = submitit.SlurmExecutor(folder=tmp_path)._submitit_command_str
        assert f"-m {compat.SUBMITIT_SUBMIT_MODULE} " in command, command


def test_local_requeue_exit_code() -> None:
    with private_api("submitit.local.local.LOCAL_REQUEUE_RETURN_CODE", "trainer/resilience.py (requeue on "
                     "local sites)", "find how submitit's local controller now recognises a requeue and "
                     "update hpc.compat.local_requeue_exit_code"):
        import submitit.local.local as local

        code = compat.local_requeue_exit_code()
        assert isinstance(code, int) and 0 < code < 256
        assert "LOCAL_REQUEUE_RETURN_CODE" in inspect.getsource(local.Controller.run)  # what the controller checks


def test_local_timeout_s() -> None:
    with private_api("submitit.local.local's SUBMITIT_LOCAL_TIMEOUT_S", "hpc/schedulers/local/scheduler.py "
                     "(LocalJobSide.seconds_left: a time limit told from a preemption on local sites)",
                     "find how submitit's local controller now passes its time limit and update "
                     "hpc.compat.local_timeout_s"):
        import submitit.local.local as local

        assert compat.LOCAL_TIMEOUT_ENV in inspect.getsource(local.start_controller)  # exported to the tasks
        assert compat.LOCAL_TIMEOUT_ENV in inspect.getsource(local.Controller.__init__)  # what it counts down
        assert compat.local_timeout_s({compat.LOCAL_TIMEOUT_ENV: "60"}) == 60.0
        assert compat.local_timeout_s({}) is None and compat.local_timeout_s({compat.LOCAL_TIMEOUT_ENV: "x"}) is None


def test_storage_info(tmp_path: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    with private_api("torch.distributed.checkpoint.filesystem._StorageInfo", "hpc/ckpt/dcp.py, "
                     "hpc/ckpt/safe_pickle.py (reading and writing DCP .metadata)",
                     "update hpc.compat.storage_info/STORAGE_INFO to the class FileSystemWriter records"):
        info = compat.storage_info("__0_0.distcp", 8, 16)
        assert (info.relative_path, info.offset, info.length) == ("__0_0.distcp", 8, 16)
        dcp.save({"w": torch.ones(3)}, checkpoint_id=tmp_path, no_dist=True)
        names = recorded_globals((tmp_path / ".metadata").read_bytes())
        assert compat.STORAGE_INFO in names, names
        assert compat.STORAGE_INFO == (compat.storage_info_type().__module__, compat.storage_info_type().__name__)


def test_metadata_pickle_names_only_allow_listed_globals(tmp_path: Path) -> None:
    """_get_layout and _MEM_FORMAT_ENCODING, and whatever else DCP's .metadata pickle names."""
    import torch
    import torch.distributed.checkpoint as dcp

    from hpc.ckpt.safe_pickle import ALLOWED

    with private_api(f"{compat.GET_LAYOUT}, {compat.MEM_FORMAT_ENCODING} (globals of DCP's .metadata pickle)",
                     "hpc/ckpt/safe_pickle.py (the allow-list unpickler)",
                     "add the new global to hpc.compat and ALLOWED after checking that it only builds data"):
        dcp.save({"w": torch.ones(3), "o": {"lr": 0.1}}, checkpoint_id=tmp_path, no_dist=True)
        names = recorded_globals((tmp_path / ".metadata").read_bytes())
        assert {compat.GET_LAYOUT, compat.MEM_FORMAT_ENCODING} <= names, names
        assert {n for n in names if n not in ALLOWED and n[0] != "torch"} == set()
        assert compat.get_layout()("torch.strided") is torch.strided
        assert compat.mem_format_encoding().__name__ == compat.MEM_FORMAT_ENCODING[1]


def test_rebuild_globals_torch_save_writes() -> None:
    import torch

    with private_api("torch._utils._rebuild_tensor_v2/_v3/_rebuild_parameter", "hpc/ckpt/torch_zip.py "
                     "(the streaming torch.save reader's allow-list)",
                     "teach TensorUnpickler the new rebuild function (hpc.compat.REBUILD_*); until then torch "
                     "files fall back to torch.load(weights_only=True)"):
        data = torch_save_pickle({"p": torch.nn.Parameter(torch.ones(2)), "t": torch.ones(2),
                                  "u16": torch.arange(3).to(torch.uint16)})
        rebuilds = {n for n in recorded_globals(data) if n[0] == "torch._utils"}
        known = {compat.REBUILD_TENSOR_V2, compat.REBUILD_TENSOR_V3, compat.REBUILD_PARAMETER}
        assert rebuilds == known, f"torch.save names {sorted(rebuilds)}"
        for module, name in known:
            assert callable(getattr(sys.modules[module], name))


def test_torch_file_writer(tmp_path: Path) -> None:
    import torch

    with private_api("torch._C.PyTorchFileWriter", "hpc/ckpt/torch_write.py (streamed torch.save output)",
                     "adapt hpc.compat.torch_file_writer to torch's zip writer, or fall back to torch.save"):
        buf = io.BytesIO()
        w = compat.torch_file_writer(buf, True, 64)
        t = torch.arange(4.0)
        w.write_record("data/0", t.untyped_storage(), t.nbytes)
        w.write_end_of_file()
        with zipfile.ZipFile(buf) as z:
            assert z.read("archive/data/0") == t.numpy().tobytes() and z.testzip() is None


def test_streamed_pickle_is_torch_saves() -> None:
    """hpcx writes data.pkl itself (REBUILD_* and the storage classes, as torch.save names them)."""
    import torch

    from hpc.ckpt.entries import Scratch
    from hpc.ckpt.torch_write import Stored, TorchWriter

    state = {"f": torch.ones(2, 3), "h": torch.ones(4).half(), "b": torch.ones(1).bfloat16(), "u": torch.ones(2).to(
        torch.uint16), "f8": torch.zeros(3).to(torch.float8_e4m3fn), "s": torch.tensor(1), "e": torch.zeros(0, 2),
        "x": {"lr": 0.1, "betas": (0.9, 0.95)}}
    layout = {k: Stored(k, v.dtype, tuple(v.shape)) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    with private_api("torch.save's data.pkl layout (_rebuild_tensor_v2/_v3, storage classes, persistent ids)",
                     "hpc/ckpt/torch_write.py (--to torch, --to dcp)",
                     "make TorchWriter's pickler produce what torch.save now does (compare the two pickles)"):
        buf = io.BytesIO()
        writer = TorchWriter(buf, layout)
        writer.write_storages(lambda stored, out: out.copy_(state[stored.key]), Scratch())
        writer.finish()
        assert torch_save_pickle(state) == zipfile.ZipFile(buf).read("archive/data.pkl")


def test_flatten_state_dict() -> None:
    import torch

    with private_api("torch.distributed.checkpoint._nested_dict.flatten_state_dict",
                     "hpc/ckpt/torchsave.py (keys of a torch.save file)",
                     "update hpc.compat.flatten_state_dict; keys must stay DCP's ('a.b.0')"):
        t = torch.ones(1)
        flat, paths = compat.flatten_state_dict({"a": {"b": t, "c": [1, 2]}})
        assert flat["a.b"] is t and paths["a.b"] == ("a", "b")
        assert set(flat) == {"a.b", "a.c"} or set(flat) == {"a.b", "a.c.0", "a.c.1"}, flat


def test_set_element() -> None:
    with private_api("torch.distributed.checkpoint._traverse.set_element", "trainer/checkpoint.py "
                     "(SafeLoadPlanner.load_bytes)", "update hpc.compat.set_element"):
        root: dict = {}
        compat.set_element(root, ("a", "b"), 3)
        assert root == {"a": {"b": 3}}


def test_narrow_tensor_by_index() -> None:
    import torch

    with private_api("torch.distributed._shard._utils.narrow_tensor_by_index", "trainer/checkpoint.py "
                     "(loading a resharded chunk)", "update hpc.compat.narrow_tensor_by_index or narrow by hand"):
        t = torch.arange(12).view(3, 4)
        assert torch.equal(compat.narrow_tensor_by_index(t, [1, 2], [2, 2]), t[1:3, 2:4])


def test_crc32_off_uses_the_public_switch(tmp_path: Path) -> None:
    import torch

    def record_crc(path: Path) -> int:
        with zipfile.ZipFile(path) as z:
            return next(i.CRC for i in z.infolist() if "/data/" in i.filename)

    with private_api("torch.serialization.set_crc32_options (public)", "trainer/checkpoint.py, "
                     "hpc/ckpt/dcp.py (shard writes)", "check torch.serialization.config.save.compute_crc32"):
        with compat.crc32_off():
            torch.save(torch.ones(8), tmp_path / "off.pt")
            assert torch.serialization.get_crc32_options() is False
        torch.save(torch.ones(8), tmp_path / "on.pt")
        assert record_crc(tmp_path / "off.pt") == 0 and record_crc(tmp_path / "on.pt") != 0
        assert torch.serialization.get_crc32_options() is True


def test_crc32_off_blocks_in_two_threads_take_turns_and_restore_the_setting() -> None:
    import torch

    inside, release, order = threading.Event(), threading.Event(), []

    def other() -> None:
        with compat.crc32_off():
            inside.set()
            release.wait(10)
            order.append("other")

    t = threading.Thread(target=other)
    t.start()
    inside.wait(10)
    threading.Timer(0.2, release.set).start()
    with compat.crc32_off():  # waits for the other thread's block
        order.append("main")
        assert torch.serialization.get_crc32_options() is False
        with compat.crc32_off():  # nested in one thread
            pass
        assert torch.serialization.get_crc32_options() is False
    t.join(10)
    assert order == ["other", "main"] and torch.serialization.get_crc32_options() is True
    torch.serialization.set_crc32_options(False)  # a user's own setting survives a block
    try:
        with compat.crc32_off():
            pass
        assert torch.serialization.get_crc32_options() is False
    finally:
        torch.serialization.set_crc32_options(True)


def test_foreach_norm() -> None:
    import torch

    with private_api("torch._foreach_norm", "trainer/optim.py (gradient clipping)",
                     "update hpc.compat.foreach_norm (torch.linalg.vector_norm per tensor is the slow fallback)"):
        norms = compat.foreach_norm([torch.tensor([3.0, 4.0]), torch.ones(4, dtype=torch.float64)])
        assert [float(n) for n in norms] == [5.0, 2.0]


def test_foreach_mul_() -> None:
    import torch

    with private_api("torch._foreach_mul_", "trainer/optim.py (gradient clipping)",
                     "update hpc.compat.foreach_mul_ (a mul_ per tensor is the slow fallback)"):
        tensors = [torch.tensor([1.0, 2.0]), torch.ones(3)]
        compat.foreach_mul_(tensors, torch.tensor(0.5))
        assert [t.tolist() for t in tensors] == [[0.5, 1.0], [0.5, 0.5, 0.5]]


def test_dump_flight_recorder() -> None:
    import pickle

    import torch

    name = "_dump_nccl_trace" if torch.cuda.is_available() else "_dump_fr_trace"
    with private_api(f"torch._C._distributed_c10d.{name}", "bench/gpu_check/run.py (the flight recorder "
                     "part)", "update hpc.compat.dump_flight_recorder"):
        if torch.cuda.is_available():
            assert hasattr(torch._C._distributed_c10d, "_dump_nccl_trace")
        which, dump = compat.dump_flight_recorder()
        trace = pickle.loads(dump)
        assert isinstance(trace, dict) and "version" in trace
        assert which == ("nccl" if hasattr(torch._C._distributed_c10d, "_dump_nccl_trace") else "generic")


def test_checkpoint_wrapper() -> None:
    import torch

    with private_api("torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper",
                     "trainer/parallelize.py (activation checkpointing)",
                     "update hpc.compat.checkpoint_wrapper (torchtitan's import is the model)"):
        wrapped = compat.checkpoint_wrapper()(torch.nn.Linear(2, 2))
        x = torch.ones(1, 2, requires_grad=True)
        wrapped(x).sum().backward()
        assert x.grad is not None and x.grad.shape == (1, 2)


def test_set_pg_timeout() -> None:
    import torch.distributed as dist

    from hpc.compat import fake_store, set_pg_timeout

    with private_api("torch.distributed.distributed_c10d._set_pg_timeout", "trainer/dist.py set_timeout "
                     "(the collective timeout drops after the first step)",
                     "find torch's switch for an existing group's timeout, or recreate the groups"):
        dist.init_process_group("fake", store=fake_store(), rank=0, world_size=2)
        try:
            set_pg_timeout(dist.group.WORLD, 30.0)
        finally:
            dist.destroy_process_group()


def test_default_store() -> None:
    import torch.distributed as dist

    from hpc.compat import default_store

    with private_api("torch.distributed.distributed_c10d._get_default_store", "trainer/preflight.py (the "
                     "pre-flight check posts each rank's results in the job's store)",
                     "find torch's accessor for the default group's store, or pass the rendezvous store along"):
        store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            found = default_store()
            found.set("preflight/x", "1")
            assert found.get("preflight/x") == b"1" and found.add("preflight/n", 1) == 1
        finally:
            dist.destroy_process_group()


def test_fake_store_and_sharding_cache() -> None:
    with private_api("torch.testing._internal.distributed.fake_pg.FakeStore and "
                     "torch.distributed.tensor.debug._clear_sharding_prop_cache", "hpc/fake_pg.py (hpcx dryrun)",
                     "find where torch moved its fake-backend store and DTensor's cache reset"):
        assert type(compat.fake_store()).__name__ == "FakeStore"
        compat.clear_sharding_cache()


def test_submitit_executors_take_their_command_from_submitit_command_str() -> None:
    import submitit

    with private_api("submitit's Executor._submitit_command_str", "hpc/compat.py ExecutorHooks "
                     "(every task starts through trainer.entry with its signals held)",
                     "find submitit's new hook for the task command and override that"):
        for executor in (submitit.SlurmExecutor, submitit.LocalExecutor):
            assert isinstance(inspect.getattr_static(executor, "_submitit_command_str"), property), executor


def test_submitit_local_executor_starts_its_controller_in_submit_command() -> None:
    import submitit

    with private_api("submitit's LocalExecutor._submit_command (it starts the controller)",
                     "hpc/compat.py ExecutorHooks (the local controller's stdio detached from the caller's)",
                     "find where submitit now starts the local controller and detach its stdio there"):
        assert callable(inspect.getattr_static(submitit.LocalExecutor, "_submit_command"))
        source = inspect.getsource(submitit.LocalExecutor._submit_command)
        assert "start_controller(" in source
