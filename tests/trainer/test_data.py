"""The sampler: the same samples in the same order per optimizer step at any world size."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hpc.core.spec import Data
from trainer.data import GlobalSampler, SyntheticTokens, TokenFile, build_loader


def step_samples(num_samples, global_batch, micro_batch, world, step, seed=3, shuffle=True) -> list[int]:
    """All ranks' indices of one optimizer step, in global order (micro-step, then rank)."""
    samplers = [GlobalSampler(num_samples, global_batch, micro_batch, r, world, seed, shuffle) for r in range(world)]
    per_rank = [s.step_batches(step * global_batch) for s in samplers]
    out = []
    for micro in range(samplers[0].grad_accum):
        for r in range(world):
            out += per_rank[r][micro]
    return out


@pytest.mark.parametrize("world,micro", [(1, 1), (1, 8), (2, 1), (2, 4), (4, 1), (4, 2), (8, 1)])
def test_step_samples_do_not_depend_on_world_or_micro_batch(world, micro):
    for step in range(12):  # 12 steps × 8 = 96 samples: crosses an epoch of 40
        assert step_samples(40, 8, micro, world, step) == step_samples(40, 8, 1, 1, step)


def test_each_epoch_is_a_new_permutation_of_all_samples():
    epoch0 = sum((step_samples(40, 8, 1, 1, s) for s in range(5)), [])
    epoch1 = sum((step_samples(40, 8, 1, 1, s) for s in range(5, 10)), [])
    assert sorted(epoch0) == sorted(epoch1) == list(range(40)) and epoch0 != epoch1


def test_no_shuffle_is_sequential():
    assert step_samples(40, 8, 2, 2, 1, shuffle=False) == list(range(8, 16))


def test_resume_at_another_world_size_continues_exactly():
    one = GlobalSampler(40, 8, 1, 0, 1, 3, True)
    stream = iter(one)
    _ = [next(stream) for _ in range(8 * 3)]  # three steps on one rank
    one.advance(3)
    state = one.state_dict()
    assert state == {"consumed_samples": 24, "epoch": 0}
    four = [GlobalSampler(40, 8, 2, r, 4, 3, True) for r in range(4)]
    for s in four:
        s.load_state_dict(state)
    resumed = [next(iter(s)) for s in four]  # one micro-batch each = the whole step 3
    assert sum(resumed, []) == step_samples(40, 8, 1, 1, 3)


def test_sampler_checks_divisibility():
    with pytest.raises(ValueError, match="`train.global_batch` = 10 is not divisible by ranks × micro_batch = 2 × 2 = 4"):
        GlobalSampler(40, 10, 2, 0, 2, 0, True)


def test_loader_iterator_leaves_global_rng_alone():
    sampler = GlobalSampler(1 << 20, 4, 2, 0, 1, 0, False)
    loader = build_loader(SyntheticTokens(256, 8, 0), sampler, Data(), seed=0, pin_memory=False)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    first = next(iter(loader))
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(next(iter(loader)), first) and first.shape == (2, 9)


def test_token_file_samples_overlap_by_one(tmp_path):
    path = tmp_path / "t.bin"
    np.arange(1000, 1000 + 33, dtype=np.uint32).tofile(path)
    data = TokenFile(path, "uint32", seq_len=8)
    assert len(data) == 4
    assert data[1].tolist() == list(range(1008, 1017)) and data[1].dtype == torch.int64


def test_synthetic_is_seeded():
    a, b = SyntheticTokens(256, 8, 1), SyntheticTokens(256, 8, 2)
    assert torch.equal(a[5], SyntheticTokens(256, 8, 1)[5]) and not torch.equal(a[5], b[5])
    assert not torch.equal(a[5], a[6])
