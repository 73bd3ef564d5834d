"""Evaluation as training does it (issue 44): the eval loss is the training's chunked cross-entropy (no
fp32 logits of a whole micro-batch), a tensor-parallel group adds its eval sums and its loss-mask count
once (true counts, not tp times them: real gloo ranks), and the eval batches come through a DataLoader
with the training loader's workers and pinned memory."""

from __future__ import annotations

import os
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import default_collate

import trainer.objective as objective
from hpc.core.models.gpt import GPTShape
from trainer.evaluate import Evaluator, evaluate
from trainer.models.gpt import GPT
from trainer.tasks.lm import token_task
from trainer.objective import counted_targets, eval_token_losses, masked_scale, sum_over_data, token_losses

VOCAB, SEQ = 211, 16


def _spy(monkeypatch) -> list[tuple[int, torch.dtype]]:
    """(rows, dtype) of every cross-entropy call the objective makes."""
    calls: list[tuple[int, torch.dtype]] = []
    real = objective.F.cross_entropy

    def spy(x, *args, **kwargs):
        calls.append((x.shape[0], x.dtype))
        return real(x, *args, **kwargs)

    monkeypatch.setattr(objective.F, "cross_entropy", spy)
    return calls


@pytest.mark.parametrize("chunk_logits", [VOCAB, 5 * VOCAB, 10 ** 9])
def test_eval_losses_are_the_chunked_training_losses(monkeypatch, chunk_logits):
    monkeypatch.setattr("hpc.core.models.decoder.LOSS_CHUNK_LOGITS", chunk_logits)
    logits = torch.randn(3, SEQ, VOCAB, dtype=torch.bfloat16)
    tokens = torch.randint(0, VOCAB, (3, SEQ + 1))
    want = token_losses(logits, tokens)
    calls = _spy(monkeypatch)
    got = eval_token_losses(logits, tokens)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    rows = min(3 * SEQ, max(1, chunk_logits // VOCAB))
    assert calls and all(n <= rows for n, _ in calls) and len(calls) == -(-3 * SEQ // rows)


def test_the_language_models_eval_terms_never_hold_fp32_logits_of_the_batch(monkeypatch):
    from trainer.tasks.lm import LanguageModelTask

    monkeypatch.setattr("hpc.core.models.decoder.LOSS_CHUNK_LOGITS", 4 * VOCAB)  # 4 tokens per chunk
    torch.manual_seed(0)
    model = GPT(GPTShape(1, 16, 2, SEQ, VOCAB)).eval()
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1))
    with torch.no_grad():
        want = token_losses(model(tokens[:, :-1]), tokens).double().sum()
        calls = _spy(monkeypatch)
        sums = LanguageModelTask.__new__(LanguageModelTask).eval_terms(model, tokens, 2, torch.autocast("cpu", enabled=False))
    assert float(sums[0]) == pytest.approx(float(want), rel=1e-12) and float(sums[1]) == 2 * SEQ
    assert len(calls) == 2 * SEQ // 4 and all(n == 4 for n, _ in calls)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        tokens = torch.zeros(2, 9, dtype=torch.long)
        mask = torch.zeros(2, 9, dtype=torch.bool)
        mask[:, 1:4] = True  # 3 counted targets per row: 6 per micro-batch, the same on every rank of a group
        out = {}
        for tp in (1, 2):
            sums = sum_over_data(torch.tensor([2.5, 6.0], dtype=torch.float64), world, tp)
            count = counted_targets([(tokens, mask)], world, tp)
            assert count is not None
            out[tp] = (sums.tolist(), int(count), float(masked_scale(count, world // tp)))
        queue.put((rank, out))
    finally:
        dist.destroy_process_group()


def test_a_tensor_parallel_group_adds_its_sums_once():
    """2 gloo ranks: as one tp-2 group they hold one batch, so the eval sums and the loss mask's count
    are one rank's (and the loss scale is 1 data-parallel rank / count); as two data-parallel ranks they
    add up. The scale of the gradients is the same either way (world / tp ranks average them)."""
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for rank in (0, 1):
        assert results[rank][2] == ([2.5, 6.0], 6, pytest.approx(1 / 6))
        assert results[rank][1] == ([5.0, 12.0], 12, pytest.approx(2 / 12))


class _Samples(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.arange(SEQ + 1) * (i + 1) % VOCAB


@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true but no accelerator")
def test_the_eval_loader_has_workers_and_pinned_memory_and_gives_the_same_record():
    torch.manual_seed(0)
    t = SimpleNamespace(model=GPT(GPTShape(1, 16, 2, SEQ, VOCAB)), device=torch.device("cpu"), amp_dtype=None,
                        world_size=1, dims=SimpleNamespace(tp=1))
    batches = [[0, 1, 2], [3, 4], []]  # a padding pass reads sample 0 and counts nothing
    records = []
    for workers in (0, 2):
        ev = Evaluator(_Samples(), batches, 1, 5, task=token_task(), workers=workers, pin_memory=workers > 0)
        records.append(evaluate(t, ev, 1))
        loader = ev.loader(default_collate)
        assert loader.num_workers == workers and loader.persistent_workers == (workers > 0)
        assert loader.pin_memory == (workers > 0)
        assert ev.loader(default_collate) is loader  # kept from one evaluation to the next
    assert records[0]["eval_loss"] == records[1]["eval_loss"] and records[0]["eval_tokens"] == 5 * SEQ

