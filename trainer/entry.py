"""``python -m trainer.entry SUBMITIT_FOLDER``: what every task of an hpcx job runs.

It is submitit's own ``python -m submitit.core._submit`` (load the pickled ``TrainTask``, run it, write
the result), with one change at the very start: the preemption signal (USR2) and SIGTERM are held
(blocked) from the first line. Without that, a USR2 that arrives before the trainer's handler exists
kills the task (its default action), and a SIGTERM (``hpcx cancel``) is dropped by submitit's "bypass"
handler. Held signals stay pending until ``PreemptionFlag.install`` unblocks them into its handlers:
the first step boundary then acts on them. The task command (``hpc.schedulers.base.task_command``)
already starts the interpreter with both blocked where coreutils' ``env --block-signal`` exists;
elsewhere USR2 is ignored (and a USR2 lost) only for the interpreter's own start, before this line.

Torch-free; nothing but ``signal`` is imported before the signals are held. The task command runs this
module as ``python -u -c BOOT trainer.entry FOLDER`` (``hpc.core.imports``: hpcx's own ``trainer``, not
the submit folder's); before it, ``BOOT`` only drops the current folder from ``sys.path`` and checks that
``hpc`` and ``trainer`` are hpcx's (about a millisecond: one listing, one small file, no import).
"""

from __future__ import annotations

import os
import signal


def held_signals() -> set[signal.Signals]:
    """The preemption signal (``SUBMITIT_PREEMPT_SIGNAL``, default USR2) and SIGTERM."""
    return {signal.Signals["SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2")], signal.SIGTERM}


def hold_signals() -> None:
    """Block the held signals in this (the main) thread; threads started later inherit the mask."""
    signal.pthread_sigmask(signal.SIG_BLOCK, held_signals())


def release_signals() -> None:
    """Unblock them: what arrived meanwhile is delivered now, to the handlers installed by then."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, held_signals())


def main() -> None:
    hold_signals()
    from submitit.core.submission import submitit_main  # lazy: submitit

    submitit_main()  # reads the folder from sys.argv


if __name__ == "__main__":
    main()
