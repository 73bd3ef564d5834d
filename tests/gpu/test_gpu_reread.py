"""What only a GPU shows of issue 36 (tests/trainer/test_gpu_path.py checks the rest on the CPU): an
evaluation left out of the event clock, masked steps without a host sync, deterministic attention
backward at seq 1024, every GPU's RNG state in a checkpoint, the one-process NCCL group bound to its GPU,
and the flight recorder that holds NCCL's entries. ``gpu``-marked: skipped where CUDA is absent."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_gpu import gpu_run

pytestmark = pytest.mark.gpu


def queue_matmuls(n: int) -> None:
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(n):
        a = a @ a / 4096


def test_an_evaluation_is_left_out_of_the_next_steps_phases():
    from trainer.metrics import PhaseClock

    clock = PhaseClock(torch.device("cuda", 0))
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    queue_matmuls(40)  # the evaluation's kernels, still running when the host moves on
    end.record()
    clock.skip()
    clock.lap("boundary")
    window = clock.take(1)
    assert window["boundary"] < 0.1 * begin.elapsed_time(end) / 1000


def test_masked_steps_never_wait_for_the_gpu(tmp_path):
    from trainer.loop import train_step
    from trainer.run import load_run
    from trainer.train import build_trainer

    run = gpu_run(tmp_path, "masked", 1, ["parallel.strategy='none'", "train.micro_batch=2", "train.global_batch=4",
                                          "job.tasks_per_node=1"])
    trainer, _ = build_trainer(load_run(run), 0, torch.device("cuda", 0))
    batches = iter(trainer.loader)
    gen = torch.Generator().manual_seed(0)

    def step() -> None:
        micro = [next(batches) for _ in range(2)]
        train_step(trainer, [(t, (torch.rand(t.shape, generator=gen) < 0.5).pin_memory()) for t in micro])

    step()  # allocator and kernels warmed up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_deterministic_attention_backward_is_bit_for_bit_at_seq_1024():
    import torch.nn.functional as F

    from trainer.loop import set_determinism

    def grads() -> list:
        torch.manual_seed(0)
        q, k, v = (torch.randn(4, 8, 1024, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        F.scaled_dot_product_attention(q, k, v, is_causal=True).float().square().sum().backward()
        return [t.grad for t in (q, k, v)]

    set_determinism(True)
    try:
        first, second = grads(), grads()
    finally:
        set_determinism(False)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_a_checkpoint_holds_every_visible_gpus_rng_state():
    from trainer.checkpoint import rng_state, set_rng_state

    torch.cuda.init()
    state = rng_state()
    assert state["cuda"].shape[0] == torch.cuda.device_count()
    torch.cuda.manual_seed_all(123)
    set_rng_state(state)
    assert all(torch.equal(torch.cuda.get_rng_state(i), state["cuda"][i]) for i in range(torch.cuda.device_count()))


def test_the_one_process_nccl_group_is_bound_to_its_gpu_and_its_recorder_is_nccls():
    import torch.distributed as dist

    from hpc import compat
    from trainer.dist import init_single, shutdown

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    init_single("nccl", 60, device)
    try:
        assert dist.distributed_c10d._get_default_group().bound_device_id == device
        dist.all_reduce(torch.ones(1, device=device))
        torch.cuda.synchronize()
        assert compat.dump_flight_recorder()[0] == "nccl"
    finally:
        shutdown(30)
