"""Run under torchrun (gloo, CPU): a DDP model trained a few steps with the loop's three straggler moments
(``trainer.straggler.StepSplit``: gradients synced, step worked, boundary), every rank's forward sleeping
``BASE_S`` and rank ``SLOW`` (-1: none) ``SLOW_S`` more. Real hooks, a real all-gather on the gloo side group,
rank 0's real metrics writer and run folder record. Usage: RUN_DIR SLOW STEPS EVERY INTERVALS."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from hpc.core.straggler import Judge
from trainer.metrics import MetricsWriter
from trainer.straggler import StepSplit

BASE_S, SLOW_S = 0.05, 0.25  # every rank's "compute", and the slow rank's more (the injected straggle)


class Sleeper(nn.Module):
    """A linear layer whose forward also spends ``seconds`` (this rank's compute, as far as any clock knows)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.layer = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return self.layer(x)


def main(run_dir: Path, slow: int, steps: int, every: int, intervals: int) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(Sleeper(BASE_S + (SLOW_S if rank == slow else 0.0)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    metrics = MetricsWriter(run_dir, rank == 0)
    split = StepSplit(run_dir, rank, world, "drill.0", every, Judge(1.5, intervals),
                      metrics=metrics if rank == 0 else None, host=f"host{rank}").attach(model)
    split.boundary(0)  # the loop's start: the first step's work begins
    for step in range(1, steps + 1):
        model(torch.randn(4, 8)).square().mean().backward()
        split.synced()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        split.worked()
        split.boundary(step)
    metrics.close()
    dist.barrier()  # no rank leaves while another still gathers
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
