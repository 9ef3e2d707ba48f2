"""The command reference of the documentation site (docs/hooks/commands.py) lists every command,
every option with its environment variable, as --help does."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import click

from cdc_relay.commands.cli import cli

HOOK = Path(__file__).resolve().parents[2] / "docs" / "hooks" / "commands.py"


def _hook() -> object:
    spec = importlib.util.spec_from_file_location("docs_commands", HOOK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _every_command(group: click.Group, path: str) -> list[tuple[str, click.Command]]:
    found = []
    ctx = click.Context(group, info_name=path)
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        assert command is not None
        found.append((f"{path} {name}", command))
        if isinstance(command, click.Group):
            found += _every_command(command, f"{path} {name}")
    return found


def test_every_command_and_option_is_in_the_reference_with_its_variable() -> None:
    text = _hook().reference(cli, "cdc-relay")  # type: ignore[attr-defined]
    sections = {block.split("`", 2)[1]: block for block in text.split("\n## ")[1:] if "`" in block}
    commands = _every_command(cli, "cdc-relay")
    assert len(commands) > 10
    for path, command in commands:
        assert path in sections, f"{path} is missing from the reference"
        section = sections[path]
        for option in command.params:
            if not isinstance(option, click.Option) or option.hidden:
                continue
            row = next(
                (line for line in section.splitlines() if f"`{option.opts[0]}`" in line), None
            )
            assert row is not None, f"{path} {option.opts[0]} is missing from the reference"
            if option.envvar:  # a list: the variable, then a deprecated one (prune's)
                names = [option.envvar] if isinstance(option.envvar, str) else option.envvar
                assert f"`{', '.join(names)}`" in row, row


def test_the_page_has_the_marker_the_hook_fills() -> None:
    page = HOOK.parents[1] / "reference" / "commands.md"
    assert _hook().MARKER in page.read_text()  # type: ignore[attr-defined]
