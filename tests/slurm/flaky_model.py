"""A user model (``model.arch = "flaky_model:build"``) whose rank ``fail_rank`` raises once: in the first
start of the job (``SLURM_RESTART_COUNT`` 0), at forward call ``fail_after``. The restart runs clean. The
error reads as the machine's (NCCL's words): an error of the job's own code would fail it after one
attempt (hpc.core.failures), and this test is about the requeue of a transient failure."""

from __future__ import annotations

import os


def build(fail_rank: int = 1, fail_after: int = 8, **_: object):
    from hpc.core.models.gpt import gpt_shape
    from trainer.models.gpt import GPT

    model = GPT(gpt_shape("tiny"))
    first_start = os.environ.get("SLURM_RESTART_COUNT", "0") == "0"
    if first_start and os.environ.get("SLURM_PROCID") == str(fail_rank):
        calls = [0]

        def fail(module, args):
            calls[0] += 1
            if calls[0] >= fail_after:
                raise RuntimeError(f"NCCL error: unhandled system error (flaky rank {fail_rank}: injected failure "
                                   f"in forward call {calls[0]})")

        model.register_forward_pre_hook(fail)
    return model
