"""One rank of tests/resilience/test_watchdog.py's teardown case: two gloo processes, each with a real
watchdog; rank 1 stops itself (SIGSTOP) before the teardown barrier; rank 0 waits in ``trainer.dist.shutdown``
under its watchdog's suspension, which finds rank 1 silent and fires. argv: rank, init file, run folder."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch.distributed as dist

import trainer.watchdog as watchdog
from hpc.core.health import Health
from trainer.dist import shutdown

rank, init, run = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
watchdog.SILENT_S, watchdog.BEAT_EVERY_S = 1.0, 0.2
dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)


def fired(verdict: dict) -> None:
    (run / f"fired-{rank}.json").write_text(json.dumps(verdict))
    os._exit(7)


w = watchdog.Watchdog(run, rank, 2, "5.0", Health(hang_timeout_s=1), 120.0, on_fire=fired, poll_s=0.05)
w.beat(1)
w.beat(2)  # the loop's last boundary
w.start()
if rank == 1:
    os.kill(os.getpid(), signal.SIGSTOP)  # stopped after the loop, before the teardown barrier
shutdown(600, watchdog.paused(w))
os._exit(0)
