"""The configuration file (``--config FILE``, CDC_RELAY_CONFIG): TOML whose keys are the long
option names, the keys several commands share at the top level and a table per command
(``[stream]``, ``[setup-slot]``, ``[dead-letters.list]``: the command's path, a dot between
words) for the rest. It fills click's ``default_map`` of the command run, so a flag wins over
its environment variable, which wins over the file, which wins over the option's default.

One file serves every command: a command takes what it has an option for, from the top level
and from its tables, and leaves the rest to the others. A key no command takes (a typo), a key
in a command's table that the command has no option for, and a table of no command are errors
naming the key and the file, whatever command runs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import click

from cdc_relay.config import (
    CONFIG_ENV,
    HIDDEN,
    SASL_PASSWORD_ENV,
    hide_dsn_password,
    hide_secret_setting,
    read_toml,
)
from cdc_relay.errors import UsageError

CONFIG = "config"
"""The long name of the option that names the file; every command takes it."""
_META = "cdc_relay.config_file"


def long_name(param: click.Parameter) -> str | None:
    """The long name of an option, without its dashes (``--kafka-bootstrap`` ->
    ``kafka-bootstrap``): its key in the file and its environment variable's name."""
    if not isinstance(param, click.Option):
        return None
    return next((opt[2:] for opt in param.opts if opt.startswith("--")), None)


def options_of(command: click.Command) -> dict[str, click.Option]:
    """The options of ``command`` by long name, the file's own option left out."""
    found = {}
    for param in command.params:
        name = long_name(param)
        if name is not None and name != CONFIG and isinstance(param, click.Option):
            found[name] = param
    return found


def commands_below(command: click.Command) -> list[tuple[tuple[str, ...], click.Command]]:
    """Every command under ``command`` (itself if it is one) with its path of names."""
    if not isinstance(command, click.Group):
        return [((), command)]
    return [
        ((name, *path), leaf)
        for name, sub in command.commands.items()
        for path, leaf in commands_below(sub)
    ]


@dataclass(frozen=True)
class ConfigFile:
    """A configuration file, read and checked against every command of ``root``."""

    path: Path
    tables: dict[str, Any]

    @classmethod
    def read(cls, path: Path, root: click.Group) -> ConfigFile:
        found = cls(path, read_toml(path))
        found._check(found.tables, root, ())
        return found

    def _check(self, table: Mapping[str, Any], node: click.Command, where: tuple[str, ...]) -> None:
        takes = {name for _, leaf in commands_below(node) for name in options_of(leaf)}
        for key, value in table.items():
            if key == CONFIG and not isinstance(value, dict):
                raise UsageError(
                    f"{self.path}: {self.place(where, key)}: a config file cannot name another; "
                    f"give one file, with --config or {CONFIG_ENV}"
                )
            secret = _secret_in(key, value)
            if secret is not None:
                raise UsageError(
                    f"{self.path}: {self.place(where, key)} holds {secret}; the config file "
                    f"holds no passwords: {_SAFER}"
                )
            if isinstance(node, click.Group) and key in node.commands:
                if not isinstance(value, dict):
                    raise UsageError(
                        f"{self.path}: {'.'.join((*where, key))} is a command: its settings go "
                        f"in the table [{'.'.join((*where, key))}]"
                    )
                self._check(value, node.commands[key], (*where, key))
            elif key not in takes and "password" in key:
                raise UsageError(
                    f"{self.path}: {self.place(where, key)}: passwords have no place in the "
                    f"config file; {_SAFER}"
                )
            elif isinstance(value, dict) and key not in takes:
                raise UsageError(
                    f"{self.path}: [{'.'.join((*where, key))}] is no command of cdc-relay; "
                    f"a table is named after its command: {_examples(node, where)}"
                )
            elif key not in takes:
                raise UsageError(self._unknown(node, where, key))

    def _unknown(self, node: click.Command, where: tuple[str, ...], key: str) -> str:
        name = " ".join(where)
        if where and not isinstance(node, click.Group):
            return (
                f"{self.path}: {self.place(where, key)}: {name} has no option --{key} "
                f"(cdc-relay {name} --help lists them)"
            )
        commands = f"command of {name}" if where else "command"
        return (
            f"{self.path}: {self.place(where, key)}: no {commands} has an option --{key}; keys "
            "are long option names, as cdc-relay COMMAND --help lists them"
        )

    @staticmethod
    def place(where: tuple[str, ...], key: str) -> str:
        """Where a key is, as an error says it: ``[stream] workers``, ``workers (top level)``."""
        return f"[{'.'.join(where)}] {key}" if where else f"{key} (top level)"

    def settings(
        self, root: click.Group, path: tuple[str, ...], ctx: click.Context
    ) -> dict[str, tuple[Any, str]]:
        """What the file sets for the command at ``path``: by the option's long name, its value
        (checked, as the file has it) and the table it is in (``[stream]``, ``top level``); a
        table's key wins over the same key further out."""
        found: dict[str, tuple[Any, str]] = {}
        table: Any = self.tables
        options = options_of(command_at(root, path))
        for depth in range(len(path) + 1):
            where = path[:depth]
            node = command_at(root, where)
            for key, value in table.items():
                # a command's table is not its option (_check); any other table where an
                # option's value goes is refused by _checked, never left out in silence
                if key in options and not (isinstance(node, click.Group) and key in node.commands):
                    found[key] = (value, self.place(where, key))
            if depth < len(path):
                table = table.get(path[depth], {})
        command_name = " ".join(path)
        return {
            key: (
                self._checked(options[key], key, value, place, command_name, ctx),
                place.rsplit(" ", 1)[0] if place.startswith("[") else "top level",
            )
            for key, (value, place) in found.items()
        }

    def default_map(
        self, root: click.Group, path: tuple[str, ...], ctx: click.Context
    ) -> dict[str, Any]:
        """``settings`` as click's default_map of the command: by parameter name."""
        options = options_of(command_at(root, path))
        return {
            options[key].name: value
            for key, (value, _) in self.settings(root, path, ctx).items()
            if options[key].name is not None
        }

    def _checked(
        self,
        option: click.Option,
        key: str,
        value: Any,
        place: str,
        command: str,
        ctx: click.Context,
    ) -> Any:
        """``value`` if it is of the option's kind (a boolean for a flag, a number for a
        number, a list for a repeatable option, else a string) and the option takes it."""
        where = f"{self.path}: {place}"
        if option.multiple:
            if isinstance(value, str):
                value = [value]
            if value == [] and isinstance(option.default, tuple | list) and option.default:
                # the command line cannot empty a default list (stream's tables: none would
                # leave the relay nothing to read), nor can the file
                raise UsageError(
                    f"{where} is an empty list; name at least one, or leave {key} out for "
                    "the default"
                )
            if not isinstance(value, list) or not all(_fits(option, item) for item in value):
                raise UsageError(
                    f'{where} is {_kind_of(value)}; write a list of strings: {key} = ["...", "..."]'
                )
        elif isinstance(value, list) and len(value) == 1:
            value = value[0]  # a list of one is one value: table = ["x"] serves every command
        if isinstance(value, list) and not option.multiple:
            raise UsageError(
                f"{where} is a list, but {command} takes one value; give {command} its own in "
                f"[{command.replace(' ', '.')}]"
            )
        if not option.multiple and not _fits(option, value):
            raise UsageError(f"{where} is {_kind_of(value)}; write {_expected(option)}")
        try:
            option.type_cast_value(ctx, value)
        except click.BadParameter as exc:
            raise UsageError(f"{where}: {exc.message}") from None
        return value


_SAFER = (
    f"give Kafka's in {SASL_PASSWORD_ENV} or as sasl.password in a properties file "
    "(--kafka-config-file), PostgreSQL's in PGPASSWORD or a .pgpass file"
)


def _secret_in(key: str, value: Any) -> str | None:
    """What secret the value of ``key`` holds, as an error names it (never the value): a
    password in the dsn, a --kafka-config setting such as sasl.password; None if none."""
    if key == "dsn" and isinstance(value, str):
        # one libpq cannot parse is refused at start-up, without being shown
        return "a password" if hide_dsn_password(value) not in (None, HIDDEN) else None
    if key == "kafka-config" and isinstance(value, str | list):
        for item in [value] if isinstance(value, str) else value:
            hidden = hide_secret_setting(item) if isinstance(item, str) else None
            if hidden is not None:
                return f"a secret ({hidden.rsplit('=', 1)[0]})"
    return None


def _fits(option: click.Option, value: Any) -> bool:
    if option.is_bool_flag:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if isinstance(option.type, click.types.IntParamType):
        return isinstance(value, int)
    if isinstance(option.type, click.types.FloatParamType):
        return isinstance(value, int | float)
    return isinstance(value, str)


def _expected(option: click.Option) -> str:
    if option.is_bool_flag:
        return "true or false"
    if isinstance(option.type, click.types.IntParamType):
        return "a whole number"
    if isinstance(option.type, click.types.FloatParamType):
        return "a number"
    return "a string"


def _kind_of(value: Any) -> str:
    if isinstance(value, bool):
        return f"{str(value).lower()}, a boolean"
    if isinstance(value, int | float):
        return f"{value}, a number"
    if isinstance(value, str):
        return "a string"  # never shown: it may be a secret
    if isinstance(value, list):
        return "a list" if all(isinstance(v, str) for v in value) else "a list of other things"
    return f"a {type(value).__name__}"


def command_at(root: click.Group, path: tuple[str, ...]) -> click.Command:
    """The command at ``path`` under ``root`` (a path of names it has)."""
    command: click.Command = root
    for name in path:
        command = cast(click.Group, command).commands[name]
    return command


def root_of(ctx: click.Context) -> click.Group:
    """The ``cdc-relay`` group, whose commands the file serves."""
    return cast(click.Group, ctx.find_root().command)


def _examples(node: click.Command, where: tuple[str, ...]) -> str:
    names = [".".join((*where, *path)) for path, _ in commands_below(node)]
    return ", ".join(f"[{name}]" for name in names[:4]) + (", ..." if len(names) > 4 else "")


def command_path(ctx: click.Context) -> tuple[str, ...]:
    """The names from the root command to ``ctx``'s (``("dead-letters", "list")``)."""
    names = []
    while ctx.parent is not None:
        names.append(str(ctx.command.name))
        ctx = ctx.parent
    return tuple(reversed(names))


def read_config(ctx: click.Context, param: click.Parameter, value: Path | None) -> Path | None:
    """``--config``'s callback (eager: before every other option): the file's settings of the
    command become its default_map."""
    if value is None:
        return None
    root = root_of(ctx)
    found = ConfigFile.read(value, root)
    ctx.meta[_META] = found
    ctx.default_map = found.default_map(root, command_path(ctx), ctx)
    return value


def loaded(ctx: click.Context) -> ConfigFile | None:
    """The configuration file the command was given, if any."""
    return cast(ConfigFile | None, ctx.meta.get(_META))


def config_option() -> click.Option:
    """``--config FILE``, which every command takes (cli.py adds it to each)."""
    return click.Option(
        ["--" + CONFIG],
        type=click.Path(dir_okay=False, path_type=Path),
        envvar=CONFIG_ENV,
        show_envvar=True,
        is_eager=True,
        expose_value=False,
        callback=read_config,
        metavar="FILE",
        help="A TOML file of settings: keys are the long option names, those several commands "
        "share at the top level, a table per command ([stream], [dead-letters.list]) for the "
        "rest. A flag and an environment variable win over it; cdc-relay config show prints "
        "what a command gets and from where.",
    )
