"""User models (``model.arch = "startup_models:NAME"``) that fail before the first step of a job on the
sandbox: the way a restart would repeat (an import error, a module without ``reset_parameters``) and
the way it would not (a connection refused in the first start only)."""

from __future__ import annotations

import os


def missing_dependency(**_: object):
    import hpcx_no_such_dependency  # noqa: F401  (ModuleNotFoundError in the job, every time)


def no_reset_parameters(**_: object):
    import torch
    from torch import nn

    class Scale(nn.Module):  # owns a parameter, defines no reset_parameters
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(16))

        def forward(self, x):
            return x * self.gain

    from hpc.core.models.gpt import gpt_shape
    from trainer.models.gpt import GPT

    model = GPT(gpt_shape("tiny"))
    model.extra = Scale()
    return model


def refused_once(**_: object):
    """A data service that refuses the first start's connection (ConnectionRefusedError), then works."""
    if os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
        raise ConnectionRefusedError(111, "Connection refused: tokenizer service at 10.200.0.1:9")
    from hpc.core.models.gpt import gpt_shape
    from trainer.models.gpt import GPT

    return GPT(gpt_shape("tiny"))
