"""A task's data beyond map-style datasets: an iterable dataset (no ``__len__``) read as a stream
(``trainer.data.StreamSampler``: the same samples per step at any world size, resume exact through the
dataset's ``state_dict``, replayed without one and said so), and a task's own sampler (``epoch_order``: its
order split over the ranks, reproducible per epoch). Drilled runs: tests/resilience/test_task_data_local.py."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import RandomSampler, SequentialSampler, default_collate

from hpc.core.errors import ConfigError
from hpc.core.spec import spec_from_dict
from tests.resilience.stream_task import StatefulStream, Stream, StreamTask, sample
from trainer.data import GlobalSampler, StreamSampler, epoch_order, is_stream, order_words

G = 8


def ids(batch) -> list[float]:
    """Each sample of a collated micro-batch by its first feature (the samples are distinct)."""
    return [round(float(v), 6) for v in batch[0][:, 0]]


def step_samples(make, world: int, micro: int, steps: int, **state) -> list[list[float]]:
    """Every step's samples over all ranks, in global order (rank-major micro-batches, as the loop sees)."""
    out: list[list[float]] = [[] for _ in range(steps)]
    for rank in range(world):
        stream = StreamSampler(make(), G, micro, rank, world, default_collate)
        if state:
            stream.load_state_dict(state["sampler"])
            stream.load_data_state(state.get("data", {}))
        batches = iter(stream)
        for s in range(steps):
            for micro_index in range(stream.grad_accum):
                out[s].append((micro_index, rank, ids(next(batches))))
    return [[x for _, _, b in sorted(step) for x in b] for step in out]


def map_step_samples(steps: int, samples: int) -> list[list[float]]:
    """The same stream as a map-style dataset (each epoch's samples) under hpcx's GlobalSampler, one rank."""
    sampler = GlobalSampler(samples, G, G, 0, 1, 0, False)
    per_epoch = [[round(float(sample(1, e, i)[0][0]), 6) for i in range(samples)] for e in range(4)]
    out = []
    for s in range(steps):
        (indices,) = sampler.step_batches(s * G)
        out.append([per_epoch[g // samples][i] for g, i in zip(range(s * G, s * G + G), indices)])
    return out


@pytest.mark.parametrize("world,micro", [(1, 8), (1, 2), (2, 2), (2, 4), (4, 1), (4, 2)])
def test_a_stream_gives_every_step_the_same_samples_at_any_world_size(world, micro):
    got = step_samples(lambda: StatefulStream(12), world, micro, steps=5)  # 40 samples: three epochs of 12
    assert got == map_step_samples(5, 12)


def resumed(make, steps_before: int, steps_after: int, world: int = 2) -> tuple[list, list, list]:
    """(uninterrupted steps, resumed steps, the resumed datasets) around a save after ``steps_before``."""
    first = StreamSampler(make(), G, 2, 0, world, default_collate)
    batches = iter(first)
    for _ in range(steps_before):
        for _ in range(first.grad_accum):
            next(batches)
        first.advance()
    state = {"sampler": first.state_dict(), "data": first.data_state()}
    made: list = []

    def fresh():
        made.append(make())
        return made[-1]

    whole = step_samples(make, world, 2, steps_before + steps_after)[steps_before:]
    return whole, step_samples(fresh, world, 2, steps_after, **state), made


def test_a_stateful_stream_resumes_exactly_without_reading_again():
    whole, again, made = resumed(lambda: StatefulStream(12), 4, 3)  # saved mid epoch 2 (32 of 36 samples)
    assert again == whole
    assert all(d.reads == 3 * G for d in made)  # only the samples of the 3 steps after the save were read


def test_a_stateful_stream_saved_at_the_very_end_of_an_epoch_goes_on_with_the_next():
    whole, again, _ = resumed(lambda: StatefulStream(16), 2, 3)  # 16 samples read: epoch 0 complete
    assert again == whole


def test_a_stateless_stream_is_replayed_and_skipped_and_says_resume_may_not_be_exact():
    whole, again, made = resumed(lambda: Stream(12), 4, 2)
    assert again == whole and all(d.reads == 6 * G for d in made)  # read again from the start
    words = StreamSampler(Stream(12), G, 2, 0, 2, default_collate).resume_words()
    assert words.startswith("Stream is an iterable dataset without state_dict()/load_state_dict(): a resume reads")
    assert StreamSampler(StatefulStream(12), G, 2, 0, 2, default_collate).resume_words() is None


def test_an_empty_stream_is_one_line():
    with pytest.raises(ValueError, match="Stream: the iterable dataset yielded no samples"):
        next(iter(StreamSampler(Stream(0), G, 2, 0, 1, default_collate)))


def test_the_seam_takes_an_iterable_dataset_and_the_tasks_sampler():
    from trainer.tasks import task_for

    def seam(kind: str):
        return task_for(spec_from_dict({"task": {"target": "tests.resilience.stream_task:StreamTask",
                                                 "kwargs": {"kind": kind}}}))

    assert is_stream(seam("stateful").train_dataset()) and is_stream(seam("stateless").train_dataset())
    task = seam("sampler")
    dataset = task.train_dataset()
    assert not is_stream(dataset) and len(task.own_sampler(dataset)) == 16
    assert seam("stateful").own_sampler(dataset) is None


def test_a_sampler_that_is_not_one_is_one_line(monkeypatch):
    from trainer.tasks import UserTask

    task = StreamTask("sampler")
    monkeypatch.setattr(task, "sampler", lambda dataset: 7)
    with pytest.raises(ConfigError, match=r"sampler\(dataset\) returned int, expected a sampler of the dataset's"):
        UserTask(task, "m:T", False).own_sampler(task.train_dataset())


def test_the_tasks_sampler_is_split_over_the_ranks_in_its_order_the_same_every_time():
    task = StreamTask("sampler")
    dataset = task.train_dataset()
    order = epoch_order(task.sampler(dataset), seed=3)
    assert order(0) == order(0) and order(0) != order(1) and len(order(0)) == 16 and order_words(order) is None
    torch.manual_seed(0)
    before = torch.rand(1)
    torch.manual_seed(0)
    order(5)
    assert torch.equal(torch.rand(1), before)  # the global RNG is left as it was
    whole = GlobalSampler(16, 8, 8, 0, 1, 3, False, order=order).step_batches(8)[0]
    split = [GlobalSampler(16, 8, 2, r, 2, 3, False, order=order).step_batches(8) for r in range(2)]
    assert whole == order(0)[8:16] and [i for m in range(2) for r in range(2) for i in split[r][m]] == whole


def test_a_sampler_with_a_generator_of_its_own_is_said_not_to_resume_exactly():
    own = RandomSampler(range(10), generator=torch.Generator().manual_seed(1))
    assert order_words(epoch_order(own, 0)).startswith("the task's sampler gives another order each time")
    assert order_words(epoch_order(SequentialSampler(range(10)), 0)) is None
