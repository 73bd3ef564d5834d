"""Pieces shared by the Click command modules (no torch)."""

from __future__ import annotations

import json
import typing as tp

import click

from hpc.config import ConfigError

JSON_HELP = "Print machine-readable JSON instead of text."


class ErrorsGroup(click.Group):
    """Turns ConfigError into one ``error:`` line per problem on stderr and exit code 2, never a
    traceback; also when a sub-group is used on its own."""

    def invoke(self, ctx: click.Context) -> tp.Any:
        try:
            return super().invoke(ctx)
        except ConfigError as exc:
            for message in exc.messages:
                click.echo(f"error: {message}", err=True)
            ctx.exit(2)


def echo_json(obj: tp.Any) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=True, default=str))
