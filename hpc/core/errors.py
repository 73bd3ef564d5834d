"""The error a user can act on, as opposed to a bug.

Anything the user gave us that is wrong — a spec, a site profile, a ``--set``, a command-line
value, a checkpoint that is torn or lies about itself — raises ``UserError`` (or one of its
kinds) with one line per problem. The CLI prints each as ``error: <line>`` on stderr and exits
with status 2, never with a traceback. Everything else is a bug and keeps its traceback.
Torch-free.
"""

from __future__ import annotations

import typing as tp


class UserError(Exception):
    """One or more problems with user input, each a one-line message naming the file and key."""

    def __init__(self, messages: str | tp.Sequence[str]):
        self.messages = [messages] if isinstance(messages, str) else list(messages)
        super().__init__("\n".join(self.messages))


class ConfigError(UserError):
    """A problem in a job spec, a site profile, a ``--set`` override or a command-line value."""


class CheckpointError(UserError):
    """A checkpoint (or converted file) that is missing, torn, corrupt or not what it claims."""
