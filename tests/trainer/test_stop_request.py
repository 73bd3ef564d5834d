"""One stop request for the trainer and script mode (issue 41): ``trainer.preemption.PreemptionFlag`` with
script mode's callbacks. The handlers are called as the signal module calls them; tests/trainer/test_launch.py
and tests/script_mode send real signals to real tasks."""

from __future__ import annotations

import signal

from trainer.preemption import PreemptionFlag

USR2, TERM = int(signal.SIGUSR2), int(signal.SIGTERM)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        self.now += 1
        return self.now


def test_the_first_request_is_timed_and_announced_once_and_every_signal_is_forwarded():
    touched: list[float] = []
    forwarded: list[int] = []
    clock = Clock()
    flag = PreemptionFlag(clock, on_first_request=lambda: touched.append(clock.now), forward=forwarded.append)
    flag._handle(USR2, None)
    flag._handle(USR2, None)  # a second warning (the scheduler's, then a drill's)
    flag._terminate(TERM, None)
    assert flag.requested and flag.terminated and flag.requested_at == 101.0
    assert touched == [101.0]  # the flag file is created once, at the first request
    assert forwarded == [USR2, USR2, TERM]  # the command gets each signal
    assert flag.mine() == [1, 1]


def test_a_cancel_alone_is_no_preemption_and_chains_the_previous_handler():
    seen: list[int] = []
    flag = PreemptionFlag(forward=seen.append)
    flag._previous_term = lambda signum, frame: seen.append(-signum)  # submitit's SIGTERM logger
    flag._terminate(TERM, None)
    assert flag.terminated and not flag.requested and flag.requested_at is None
    assert seen == [-TERM, TERM] and flag.mine() == [0, 1]


def test_the_trainers_flag_has_no_callbacks():
    flag = PreemptionFlag()
    flag._handle(USR2, None)
    assert flag.requested and flag.requested_at is not None and flag.mine() == [1, 0]


def test_script_mode_reads_its_stop_from_the_same_type():
    from trainer.script import ScriptRank

    assert isinstance(ScriptRank.terminated, property) and isinstance(ScriptRank.preempted_at, property)
    rank = ScriptRank.__new__(ScriptRank)
    rank.stop = PreemptionFlag()
    rank.stop._terminate(TERM, None)
    assert rank.terminated and rank.preempted_at is None
