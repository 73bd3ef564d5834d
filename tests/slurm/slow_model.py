"""A user model (``model.arch = "slow_model:build"``) that sleeps ``sleep_s`` before each forward call in the
job's first start (``SLURM_RESTART_COUNT`` 0) and runs at full speed after a requeue; with ``until`` (a path),
it sleeps only while that file does not exist (the test creates it once its drill landed: the scheduler
``local`` has no restart count). A drill at step N then lands while the job still trains, whatever the
machine's load: the tiny model alone trains a step in ~25 ms and could finish before ``srun --overlap``
reaches the node."""

from __future__ import annotations

import os
import time
from pathlib import Path


def build(sleep_s: float = 0.05, until: str = "", **_: object):
    from hpc.core.models.gpt import gpt_shape
    from trainer.models.gpt import GPT

    model = GPT(gpt_shape("tiny"))
    if until:
        marker = Path(until)
        model.register_forward_pre_hook(lambda module, args: None if marker.exists() else time.sleep(sleep_s))
    elif os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
        model.register_forward_pre_hook(lambda module, args: time.sleep(sleep_s))
    return model
