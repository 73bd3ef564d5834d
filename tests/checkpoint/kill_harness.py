"""SIGKILL one rank in the middle of a save, at many points, and report what resume would see.

    kill_harness.py ROOT N_POINTS   -> ROOT/report.json

Imports torch once, then forks two gloo ranks per scenario (cheap on a 2-core box). Each scenario:
fsdp on 2 ranks saves steps 1 and 2 (keep=2), then saves step 3 while the victim rank counts I/O
events (shard writes, fsyncs, renames, removals, the shard digests its background thread writes, waited
for) and kills itself with SIGKILL at event K. A calibration run without a kill counts the events of
each rank (the same in every run: the digest threads are joined before arming and before counting); the K values spread over them,
the commit-and-prune tail of rank 0 included. The parent then kills the survivor (its own child)
and, after all scenarios, checks each run: ``latest_checkpoint`` must be step 3 if the rename
happened, else step 2, and loading it into a plain model must give the reference parameters.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.filesystem as dcp_fs

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ckpt_helpers import build, train_step  # noqa: E402

from trainer import checkpoint as ckpt  # noqa: E402

STEPS = (1, 2, 3)


class Counter:
    """Counts I/O events; SIGKILLs this process at event ``kill_at`` (0: never)."""

    def __init__(self, kill_at: int):
        self.kill_at, self.n, self.armed = kill_at, 0, False

    def tick(self) -> None:
        if not self.armed:
            return
        self.n += 1
        if self.n == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)


def instrument(counter: Counter) -> None:
    """Route shard writes, fsync, rename and rmtree through ``counter``."""
    real_create, real_fsync, real_rename, real_rmtree = (dcp_fs.FileSystem.create_stream, os.fsync, os.rename,
                                                          shutil.rmtree)

    class CountingStream:
        def __init__(self, stream):
            self._s = stream

        def write(self, b):
            counter.tick()
            return self._s.write(b)

        def __getattr__(self, name):
            return getattr(self._s, name)

    from contextlib import contextmanager

    @contextmanager
    def create_stream(self, path, mode):
        with real_create(self, path, mode) as stream:
            yield CountingStream(stream) if "w" in mode else stream

    def hooked(real):
        def call(*args, **kwargs):
            counter.tick()
            return real(*args, **kwargs)
        return call

    dcp_fs.FileSystem.create_stream = create_stream
    os.fsync, os.rename, shutil.rmtree = hooked(real_fsync), hooked(real_rename), hooked(real_rmtree)


def rank_main(rank: int, run: Path, store: Path, kill_rank: int, kill_at: int, counts: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(str(store), 2), rank=rank, world_size=2)
    counter = Counter(kill_at if rank == kill_rank else 0)
    instrument(counter)
    model, optimizer, scheduler = build("fsdp")
    saves = ckpt.Checkpointer(run, keep=2)
    for step in STEPS:
        train_step(model, optimizer, scheduler, step)
        saves.wait()  # the last save's digests (a background thread's fsyncs) are not step 3's events
        counter.armed = step == STEPS[-1]
        saves.save(step, model, optimizer, scheduler, {"step": step})
    saves.wait()  # and step 3's are, every time: the count does not depend on how far that thread got
    (counts / f"rank{rank}").write_text(str(counter.n))
    dist.destroy_process_group()


def scenario(root: Path, name: str, kill_rank: int, kill_at: int) -> dict:
    run, counts = root / name, root / f"{name}.counts"
    counts.mkdir(parents=True)
    pids = []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                rank_main(rank, run, root / f"{name}.store", kill_rank, kill_at, counts)
            except BaseException:  # noqa: BLE001  (a forked child reports only by its exit code)
                code = 1
            os._exit(code)
        pids.append(pid)
    status = _reap(pids, timeout=60)
    return {"name": name, "kill_rank": kill_rank, "kill_at": kill_at, "status": status,
            "counts": {p.name: int(p.read_text()) for p in counts.iterdir()}}


def _reap(pids: list[int], timeout: float) -> dict:
    """Wait for both ranks; once one has died, give the other 2 s, then SIGKILL it (it is our child)."""
    status, deadline, first_death = {}, time.monotonic() + timeout, None
    while len(status) < len(pids):
        for r, pid in enumerate(pids):
            if r in status:
                continue
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status[r] = os.waitstatus_to_exitcode(st)
                first_death = first_death or time.monotonic()
        now = time.monotonic()
        if (first_death and now - first_death > 2) or now > deadline:
            for r, pid in enumerate(pids):
                if r not in status:
                    os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)
    return status


def check(root: Path, result: dict, reference: Path) -> dict:
    """What resume would do with this run: which step, and whether it loads to the reference state."""
    from hpc.ckpt.convert import verify_checkpoints

    run = root / result["name"]
    latest = ckpt.latest_checkpoint(run)
    result["latest"] = latest.name if latest else None
    result["renamed"] = (run / "checkpoints" / "step-0000003").exists()
    if latest is not None:
        model, optimizer, scheduler = build("none", seed=5)
        ckpt.load_checkpoint(latest, model, optimizer, scheduler)
        result["equal_to_reference"] = verify_checkpoints(latest, reference / latest.name, model_only=True)["equal"]
    return result


def main(root: Path, n_points: int) -> None:
    calib = scenario(root, "calibrate", kill_rank=-1, kill_at=0)
    plan = []
    for rank in (0, 1):
        total = calib["counts"][f"rank{rank}"]
        plan += [(rank, max(1, round(total * (i + 1) / (n_points // 2 + 1)))) for i in range(n_points // 2)]
    plan += [(0, calib["counts"]["rank0"] - j) for j in range(4)]  # the commit and prune tail of rank 0
    results = [scenario(root, f"kill-r{r}-at{k}", r, k) for r, k in plan]
    reference = root / "calibrate" / "checkpoints"
    report = {"calibration": calib, "results": [check(root, r, reference) for r in results]}
    (root / "report.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
