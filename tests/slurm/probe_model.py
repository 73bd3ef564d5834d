"""A user model (`model.arch = "probe_model:build"`) that records what its rank saw.

Used by the sandbox tests to check that hostile strings reach the job byte-exact
and that secrets passed by name arrive without being written anywhere.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def build(out_dir: str, **_: object):
    from hpc.core.models.gpt import gpt_shape
    from trainer.models.gpt import GPT

    secret = os.environ.get("HF_TOKEN")
    record = {
        "MY_VAR": os.environ.get("MY_VAR"),
        "SLURM_JOB_NAME": os.environ.get("SLURM_JOB_NAME"),
        "HF_TOKEN_sha256": hashlib.sha256(secret.encode()).hexdigest() if secret else None,
    }
    rank = os.environ.get("SLURM_PROCID", "0")
    Path(out_dir, f"probe-{rank}.json").write_text(json.dumps(record))
    return GPT(gpt_shape("tiny"))
