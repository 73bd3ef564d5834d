"""Pieces shared by the Click command modules (no torch)."""

from __future__ import annotations

import json
import typing as tp

import click

from hpc.core.errors import UserError
from hpc.core.validate import shown

JSON_HELP = "Print machine-readable JSON instead of text."

# The options every command that reads a spec shares.
site_option = click.option("--site", "site_name", metavar="NAME|PATH",
                           help="Site profile (default: $HPCX_SITE, then job.site, then 'local').")
set_option = click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                          help="Override a spec value, e.g. --set train.steps=100 (repeatable).")
json_option = click.option("--json", "as_json", is_flag=True, help=JSON_HELP)


class ErrorsGroup(click.Group):
    """Turns UserError into one ``error:`` line per problem on stderr and exit code 2, never a
    traceback; also when a sub-group is used on its own."""

    def invoke(self, ctx: click.Context) -> tp.Any:
        try:
            return super().invoke(ctx)
        except UserError as exc:
            for message in exc.messages:  # a file name or key from the user may hold control characters
                click.echo(f"error: {shown(message, 4000)}", err=True)
            ctx.exit(getattr(exc, "exit_code", 2))


def echo_json(obj: tp.Any) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=True, default=str))
