"""MkDocs hook: the command reference, generated from the click commands at each build.

``docs/reference/commands.md`` holds the marker ``<!-- commands -->``; this hook puts in its
place every command of ``cdc-relay``, its help, and a table of its options with their
environment variables and defaults, read from the same objects ``--help`` is made of. So the
reference cannot drift from the code: a new option appears in both, or in neither.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import click
from click.core import UNSET
from click.types import _NumberRangeBase

MARKER = "<!-- commands -->"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if MARKER not in markdown:
        return markdown
    from cdc_relay.commands.cli import cli

    return markdown.replace(MARKER, reference(cli, "cdc-relay"))


def reference(group: click.Group, name: str) -> str:
    """Markdown for every command under ``group``, in the order ``--help`` lists them."""
    return "\n".join(_command(path, command) for path, command in _commands(group, name))


def _commands(command: click.Command, path: str) -> Iterator[tuple[str, click.Command]]:
    yield path, command
    if isinstance(command, click.Group):
        ctx = click.Context(command, info_name=path)
        for sub in command.list_commands(ctx):
            child = command.get_command(ctx, sub)
            if child is not None and not child.hidden:
                yield from _commands(child, f"{path} {sub}")


def _command(path: str, command: click.Command) -> str:
    ctx = click.Context(command, info_name=path)
    lines = [f"## `{path}`", ""]
    if command.help:
        lines += [inspect.cleandoc(click.unstyle(command.help)), ""]
    usage = " ".join([path, *command.collect_usage_pieces(ctx)])
    lines += ["```text", usage, "```", ""]
    arguments = [p for p in command.params if isinstance(p, click.Argument)]
    for argument in arguments:
        lines.append(f"Argument `{argument.human_readable_name}`: {_type(argument)}.")
    if arguments:
        lines.append("")
    options = [p for p in command.params if isinstance(p, click.Option) and not p.hidden]
    if options:
        lines += ["| Option | Environment variable | Default | Description |", "|---|---|---|---|"]
        lines += [_option(ctx, option) for option in options]
        lines.append("")
    return "\n".join(lines)


def _option(ctx: click.Context, option: click.Option) -> str:
    names = ", ".join(f"`{name}`" for name in option.opts + option.secondary_opts)
    if not option.is_flag and not option.count:
        names += f" `{option.make_metavar(ctx)}`"
    envvar = option.envvar
    if isinstance(envvar, (list, tuple)):
        envvar = ", ".join(envvar)
    env = f"`{envvar}`" if envvar else "none"
    cells = (names, env, _default(ctx, option), _help(option))
    return "| " + " | ".join(_cell(text) for text in cells) + " |"


def _default(ctx: click.Context, option: click.Option) -> str:
    if option.required:
        return "required"
    default = option.get_default(ctx, call=False)
    if default is UNSET or default is None or default == () or callable(default):
        return ""
    if option.is_flag and not option.count:
        return "on" if default else ""
    if isinstance(default, (list, tuple)):
        return " ".join(f"`{value}`" for value in default)
    return f"`{default}`"


def _help(option: click.Option) -> str:
    text = click.unstyle(option.help or "").strip()
    if isinstance(option.type, _NumberRangeBase):
        text += f" Range: {option.type._describe_range()}."
    if option.multiple and "repeatable" not in text.lower():
        text += " Repeatable."
    if isinstance(option.type, click.Choice):
        text += " One of: " + ", ".join(f"`{choice}`" for choice in option.type.choices) + "."
    return text


def _type(argument: click.Argument) -> str:
    if isinstance(argument.type, click.Choice):
        return "one of " + ", ".join(f"`{choice}`" for choice in argument.type.choices)
    return argument.type.name


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
