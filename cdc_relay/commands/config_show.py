"""``cdc-relay config show [COMMAND]``: the settings a command would run with, each with where
it comes from (its environment variable, the configuration file, or the default), passwords
hidden; a table or one JSON object."""

from __future__ import annotations

import importlib
import json
import os
from datetime import datetime, timedelta
from typing import Any

import click
from click.core import ParameterSource

from cdc_relay.commands.config_file import loaded, options_of, root_of
from cdc_relay.commands.options import env_option
from cdc_relay.config import HIDDEN, hide_dsn_password, hide_secret_setting, is_setting
from cdc_relay.errors import RelayError, UsageError

# click 8.3 and later: the value of an option nobody set, before it becomes None (older
# versions have None there)
_UNSET: object = getattr(importlib.import_module("click._utils"), "UNSET", None)


@click.group("config")
def config_group() -> None:
    """The settings of the commands: flags, CDC_RELAY_* variables and the --config file."""


@config_group.command("show")
@click.argument("command", nargs=-1)
@env_option("--json", "as_json", is_flag=True, help="One JSON object instead of a table.")
@click.pass_context
def config_show(ctx: click.Context, command: tuple[str, ...], as_json: bool) -> None:
    """Print the settings COMMAND would run with (default: stream), and where each comes from:
    env (its CDC_RELAY_* variable), file:PATH (--config) or default. Passwords are hidden.

    COMMAND is a command's name, or a group's and its command's (dead-letters list). A value
    a command would refuse is an error here too, naming where it comes from.
    """
    root = root_of(ctx)
    path, target = _command(root, command or ("stream",))
    found = loaded(ctx)
    tables, defaults = {}, {}
    if found is not None:
        tables = {key: table for key, (_, table) in found.settings(root, path, ctx).items()}
        defaults = found.default_map(root, path, ctx)
    target_ctx = click.Context(target, info_name=path[-1], parent=ctx, default_map=defaults)
    in_file = {key: f"file:{found.path} {table}" for key, table in tables.items()} if found else {}
    rows = [
        _row(target_ctx, key, option, in_file.get(key))
        for key, option in options_of(target).items()
    ]
    if as_json:
        click.echo(
            json.dumps(
                {
                    "command": " ".join(path),
                    "config_file": str(found.path) if found else None,
                    "settings": {
                        key: {"value": value, "source": source} for key, value, source in rows
                    },
                }
            )
        )
        return
    click.echo(f"cdc-relay {' '.join(path)}, config file: {found.path if found else 'none'}")
    width = max(len(key) for key, _, _ in rows)
    values = [_text(value) for _, value, _ in rows]
    value_width = min(40, max(len(value) for value in values))
    for (key, _, source), value in zip(rows, values, strict=True):
        click.echo(f"{key:<{width}}  {value:<{value_width}}  {source}")


def _command(root: click.Group, words: tuple[str, ...]) -> tuple[tuple[str, ...], click.Command]:
    names = tuple(part for word in words for part in word.split("."))
    command: click.Command = root
    for depth, name in enumerate(names):
        if not isinstance(command, click.Group) or name not in command.commands:
            raise UsageError(
                f"config show: no command {' '.join(names[: depth + 1])}; see cdc-relay --help"
            )
        command = command.commands[name]
    if isinstance(command, click.Group):
        raise UsageError(
            f"config show: {' '.join(names) or 'cdc-relay'} is a group; name one of its "
            f"commands: {', '.join(command.commands)}"
        )
    return names, command


def _row(
    ctx: click.Context, key: str, option: click.Option, in_file: str | None
) -> tuple[str, Any, str]:
    """The option's value as the command would get it (checked and converted as it would
    check it, passwords hidden), and where it comes from."""
    try:
        value, _ = option.handle_parse_result(ctx, {}, [])
    except click.MissingParameter:
        return key, None, "not set (required)"
    except (click.BadParameter, RelayError) as exc:
        message = exc.message if isinstance(exc, click.BadParameter) else str(exc)
        raise UsageError(f"--{key} from {_where(ctx, option, in_file)}: {message}") from None
    return key, _shown(key, None if value is _UNSET else value), _where(ctx, option, in_file)


def _where(ctx: click.Context, option: click.Option, in_file: str | None) -> str:
    source = ctx.get_parameter_source(str(option.name))
    if source is ParameterSource.ENVIRONMENT:
        names = option.envvar if isinstance(option.envvar, list | tuple) else [option.envvar]
        return "env " + next((str(n) for n in names if os.environ.get(str(n))), str(names[0]))
    if source is ParameterSource.DEFAULT_MAP and in_file is not None:
        return in_file
    return "default"


def _shown(key: str, value: Any) -> Any:
    """``value`` as JSON would hold it, with passwords hidden."""
    if key == "dsn" and isinstance(value, str):
        return hide_dsn_password(value) or value
    if key == "kafka-config" and isinstance(value, tuple | list):
        # an item that is no setting (a variable split at a blank: "sasl.password:" and
        # "hunter2") is refused at start-up; here it is hidden whole, where a secret may be
        return [
            hide_secret_setting(item) or (item if is_setting(item) else HIDDEN) for item in value
        ]
    if isinstance(value, tuple | list):
        return [_shown(key, item) for item in value]
    if isinstance(value, dict):  # --topic-config, --topic-partitions-for: KEY=VALUE, as given
        return [f"{name}={_shown(key, item)}" for name, item in value.items()]
    if isinstance(value, timedelta):
        return f"{value.total_seconds():g}s"
    if isinstance(value, datetime):
        return value.isoformat()
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)  # a Path, a Shard: as it is written


def _text(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list):
        return " ".join(str(item) for item in value) if value else "-"
    return str(value)
