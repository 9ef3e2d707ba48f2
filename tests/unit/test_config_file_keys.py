"""The configuration file (--config, CDC_RELAY_CONFIG) and the one naming rule of the
environment variables: precedence at every rung, the keys a command takes and those it leaves
to others, the errors that name the key and the file, and config show."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest
from click.core import ParameterSource
from click.testing import CliRunner

from cdc_relay.commands.cli import cli
from cdc_relay.commands.config_file import long_name
from cdc_relay.config import env
from cdc_relay.errors import UsageError

# The variables of prune before the one naming rule, read after the new ones with a warning.
DEPRECATED = {
    ("prune", "slot"): "CDC_RELAY_PRUNE_SLOT",
    ("prune", "batch-size"): "CDC_RELAY_PRUNE_BATCH_SIZE",
    ("prune", "wait"): "CDC_RELAY_PRUNE_WAIT",
}


def all_commands(
    group: click.Group = cli, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], click.Command]]:
    yield path, group
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield from all_commands(command, (*path, name))
        else:
            yield (*path, name), command


@pytest.fixture(autouse=True)
def _no_settings_of_ours(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests set the variables they mean; none leaks in from the environment."""
    for name in list(os.environ):
        if name.startswith("CDC_RELAY_"):
            monkeypatch.delenv(name)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cdc-relay.toml"
    path.write_text(text)
    return path


def parse(*args: str) -> click.Context:
    """The context the command of ``args`` would run with (its options parsed, nothing run)."""
    parent = click.Context(cli, info_name="cdc-relay")
    command: click.Command = cli
    words = list(args)
    while isinstance(command, click.Group):
        name = words.pop(0)
        command = command.commands[name]
        if isinstance(command, click.Group):
            parent = click.Context(command, info_name=name, parent=parent)
    return command.make_context(name, words, parent=parent)


def source(ctx: click.Context, name: str) -> ParameterSource | None:
    return ctx.get_parameter_source(name)


# -- the naming rule -------------------------------------------------------------------------


def test_every_option_of_every_command_has_the_variable_of_its_long_name() -> None:
    seen = 0
    for path, command in all_commands():
        for param in command.params:
            name = long_name(param)
            if name is None or name == "version":  # arguments; --version is no setting
                continue
            assert isinstance(param, click.Option)
            expected = env("--" + name)
            old = DEPRECATED.get((" ".join(path), name))
            assert param.envvar == (expected if old is None else [expected, old]), (path, name)
            assert param.show_envvar, (path, name)
            seen += 1
    assert seen > 150  # every command's, --config included


def test_options_of_one_name_share_their_kind() -> None:
    """A variable (and a key of the file's top level) serves every command with the option:
    each takes the same kind of value. --table is one table or several (a list of one serves
    all); nothing else differs."""
    kinds: dict[str, set[tuple[bool, str]]] = {}
    for _, command in all_commands():
        for param in command.params:
            name = long_name(param)
            if isinstance(param, click.Option) and name is not None:
                kind = "flag" if param.is_bool_flag else type(param.type).__name__
                kinds.setdefault(name, set()).add((param.multiple, kind))
    differing = {name for name, found in kinds.items() if len(found) > 1}
    assert differing == {"table"}


def test_the_variables_that_lacked_one_before(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CDC_RELAY_DSN", "dbname=shop")
    monkeypatch.setenv("CDC_RELAY_DRY_RUN", "true")
    monkeypatch.setenv("CDC_RELAY_FAILOVER", "true")
    ctx = parse("setup-slot")
    assert (ctx.params["dry_run"], ctx.params["failover_slot"]) == (True, True)
    monkeypatch.setenv("CDC_RELAY_FROM", "2")
    monkeypatch.setenv("CDC_RELAY_TO", "4")
    ctx = parse("reshard")
    assert (ctx.params["before"], ctx.params["after"]) == (2, 4)
    monkeypatch.setenv("CDC_RELAY_MAX_UNCONFIRMED", "7")
    monkeypatch.setenv("CDC_RELAY_JSON", "1")
    ctx = parse("status")
    assert (ctx.params["max_unconfirmed"], ctx.params["as_json"]) == (7, True)
    monkeypatch.setenv("CDC_RELAY_LIMIT", "3")
    assert parse("dead-letters", "list").params["limit"] == 3
    monkeypatch.setenv("CDC_RELAY_YES", "true")
    assert parse("drop-slot").params["yes"] is True


def test_prunes_old_variables_still_work_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CDC_RELAY_DSN", "dbname=shop")
    monkeypatch.setenv("CDC_RELAY_PRUNE_SLOT", "old")
    monkeypatch.setenv("CDC_RELAY_PRUNE_WAIT", "3")
    ctx = parse("prune", "--older-than", "1d")
    assert (ctx.params["slot"], ctx.params["wait"]) == ("old", 3)
    err = capsys.readouterr().err
    assert "CDC_RELAY_PRUNE_SLOT is deprecated; set CDC_RELAY_SLOT instead" in err
    assert "CDC_RELAY_PRUNE_WAIT is deprecated; set CDC_RELAY_WAIT instead" in err
    # the new name wins, and says nothing
    monkeypatch.setenv("CDC_RELAY_SLOT", "new")
    ctx = parse("prune", "--older-than", "1d")
    assert ctx.params["slot"] == "new"
    assert "CDC_RELAY_PRUNE_SLOT" not in capsys.readouterr().err


def test_prune_by_processed_rows_in_a_file_shared_with_the_stream(tmp_path: Path) -> None:
    """slot at the top level is the stream's; prune takes it too (the one naming rule), and
    slot = "" in [prune] names none: a polled outbox's rows go by processed_at."""
    path = write(tmp_path, 'dsn = "dbname=shop"\nslot = "relay"\n')
    assert parse("prune", "--config", str(path), "--older-than", "1d").params["slot"] == "relay"
    path = write(tmp_path, 'dsn = "dbname=shop"\nslot = "relay"\n[prune]\nslot = ""\n')
    assert parse("prune", "--config", str(path), "--older-than", "1d").params["slot"] is None
    assert parse("status", "--config", str(path)).params["slot"] == "relay"


# -- precedence: flag > environment > file > default -----------------------------------------


def test_every_rung_of_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(
        tmp_path,
        'dsn = "dbname=file"\nkafka-bootstrap = "file:9092"\n'
        "[poll]\nworkers = 3\nbatch-size = 30\npoll-interval = 7\n",
    )
    monkeypatch.setenv("CDC_RELAY_WORKERS", "2")
    monkeypatch.setenv("CDC_RELAY_BATCH_SIZE", "20")
    ctx = parse("poll", "--config", str(path), "--workers", "1")
    assert ctx.params["workers"] == 1  # the flag over the variable and the file
    assert source(ctx, "workers") is ParameterSource.COMMANDLINE
    assert ctx.params["batch_size"] == 20  # the variable over the file
    assert source(ctx, "batch_size") is ParameterSource.ENVIRONMENT
    assert ctx.params["poll_interval"] == 7.0  # the file over the default
    assert source(ctx, "poll_interval") is ParameterSource.DEFAULT_MAP
    assert ctx.params["max_attempts"] == 10  # the default
    assert source(ctx, "max_attempts") is ParameterSource.DEFAULT


def test_the_file_from_its_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, 'dsn = "dbname=file"\n[status]\nmax-dead-letters = 4\n')
    monkeypatch.setenv("CDC_RELAY_CONFIG", str(path))
    ctx = parse("status")
    assert ctx.params["dsn"] == "dbname=file"
    assert ctx.params["max_dead_letters"] == 4


def test_flags_are_booleans_and_an_environment_false_wins_over_a_file_true(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(
        tmp_path,
        'dsn = "dbname=shop"\nkafka-bootstrap = "k:9092"\n'
        "[stream]\nstandby = true\nexactly-once = true\n",
    )
    monkeypatch.setenv("CDC_RELAY_EXACTLY_ONCE", "false")
    ctx = parse("stream", "--config", str(path))
    assert ctx.params["standby"] is True
    assert ctx.params["exactly_once"] is False


def test_repeatable_options_are_lists(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(
        tmp_path,
        'dsn = "dbname=shop"\nkafka-bootstrap = "k:9092"\n'
        'header-column = "traceparent"\n'
        '[stream]\ntable = ["public.a", "public.b"]\n'
        'kafka-config = ["compression.type=zstd", "linger.ms=5"]\n',
    )
    ctx = parse("stream", "--config", str(path))
    assert ctx.params["tables"] == ("public.a", "public.b")
    assert ctx.params["header_columns"] == ("traceparent",)  # a string is a list of one
    monkeypatch.setenv("CDC_RELAY_TABLE", "public.c")
    assert parse("stream", "--config", str(path)).params["tables"] == ("public.c",)
    # a flag given twice replaces the file's list, as it replaces the variable's
    ctx = parse("stream", "--config", str(path), "--table", "x", "--table", "y")
    assert ctx.params["tables"] == ("x", "y")


def test_a_table_wins_over_the_top_level_and_one_file_serves_every_command(
    tmp_path: Path,
) -> None:
    path = write(
        tmp_path,
        'dsn = "dbname=shop"\nkafka-bootstrap = "k:9092"\ntable = ["public.outbox_events"]\n'
        # taken by stream and setup-slot, not by prune or status: they leave it alone
        'header-column = ["traceparent"]\nstatus-interval = 5\nbatch-size = 100\n'
        "[stream]\nstatus-interval = 2\n[prune]\nbatch-size = 5000\n"
        "[dead-letters.list]\nlimit = 5\njson = true\n",
    )
    assert parse("stream", "--config", str(path)).params["status_interval"] == 2.0
    assert parse("prune", "--config", str(path), "--older-than", "1d").params["batch_size"] == 5000
    assert parse("poll", "--config", str(path)).params["batch_size"] == 100
    ctx = parse("setup-slot", "--config", str(path), "--dry-run")
    assert ctx.params["header_columns"] == ("traceparent",)
    assert ctx.params["tables"] == ("public.outbox_events",)
    assert parse("status", "--config", str(path)).params["table"] == "public.outbox_events"
    ctx = parse("dead-letters", "list", "--config", str(path))
    assert (ctx.params["limit"], ctx.params["as_json"]) == (5, True)


# -- errors: one line, naming the key and the file ---------------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            'kafka-bootstrapp = "k:9092"',
            "kafka-bootstrapp (top level): no command has an option --kafka-bootstrapp",
        ),
        (
            "[setup-slot]\nstatus-interval = 5",
            "[setup-slot] status-interval: setup-slot has no option --status-interval",
        ),
        ("[strem]\nstandby = true", "[strem] is no command of cdc-relay"),
        ("[dead-letters.lst]\nlimit = 1", "[dead-letters.lst] is no command of cdc-relay"),
        ("[dead-letters]\nworkers = 1", "[dead-letters] workers: no command of dead-letters"),
        ("stream = 1", "stream is a command: its settings go in the table [stream]"),
        ('kafka-sasl-password = "s3cret"', "passwords have no place in the config file"),
        ('[stream]\nkafka-sasl-password = "s3cret"', "CDC_RELAY_KAFKA_SASL_PASSWORD"),
        ('config = "other.toml"', "a config file cannot name another"),
        ("dsn = ", "is not TOML: "),
    ],
)
def test_keys_no_command_takes_are_errors_whatever_runs(
    tmp_path: Path, text: str, message: str
) -> None:
    path = write(tmp_path, text if text.startswith("dsn") else 'dsn = "dbname=shop"\n' + text)
    for command in (("stream",), ("prune", "--older-than", "1d"), ("dead-letters", "list")):
        with pytest.raises(UsageError) as caught:
            parse(*command, "--config", str(path))
        assert str(path) in str(caught.value)
        assert message in str(caught.value)
        assert "\n" not in str(caught.value)
        assert "s3cret" not in str(caught.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[poll]\nworkers = "4"', "[poll] workers is a string; write a whole number"),
        ("[poll]\nworkers = 4.5", "[poll] workers is 4.5, a number; write a whole number"),
        ('[stream]\nstatus-interval = "10"', "status-interval is a string; write a number"),
        ('[stream]\nstandby = "true"', "[stream] standby is a string; write true or false"),
        ("[stream]\nstandby = 1", "standby is 1, a number; write true or false"),
        ("[poll]\nworkers = 100", "[poll] workers: 100 is not in the range 1<=x<=64"),
        ('[stream]\nlog-format = "xml"', "[stream] log-format: 'xml' is not one of"),
        ("[stream]\ntable = [1, 2]", "[stream] table is a list of other things; write a list"),
        ("[stream]\nheader-column = true", "header-column is true, a boolean; write a list"),
        (
            'table = ["public.a", "public.b"]',
            "table (top level) is a list, but poll takes one value; give poll its own in [poll]",
        ),
        # a table where an option's value goes is no setting: not left out in silence (topics
        # made without the settings asked, a relay without its SASL settings)
        ('[topic-config]\n"retention.ms" = "-1"', "topic-config (top level) is a dict; write"),
        ('[kafka-config]\n"sasl.mechanism" = "PLAIN"', "kafka-config (top level) is a dict"),
        ('trace-column = {name = "trace"}', "trace-column (top level) is a dict; write a string"),
        # an empty list of tables is no outbox: a one-line error, not a traceback at start
        ("[stream]\ntable = []", "[stream] table is an empty list; name at least one"),
    ],
)
def test_a_value_of_another_kind_is_an_error_naming_it(
    tmp_path: Path, text: str, message: str
) -> None:
    path = write(tmp_path, 'dsn = "dbname=shop"\nkafka-bootstrap = "k:9092"\n' + text)
    command = "poll" if "poll" in text or text.startswith("table") else "stream"
    with pytest.raises(UsageError) as caught:
        parse(command, "--config", str(path))
    assert f"{path}: " in str(caught.value)
    assert message in str(caught.value)


def test_a_missing_file_is_one_line_through_main(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["status", "--config", str(tmp_path / "nope.toml")])
    assert isinstance(result.exception, UsageError)
    assert "cannot read the config file" in str(result.exception)
    assert "No such file" in str(result.exception)


def test_the_value_of_another_commands_table_is_checked_when_that_command_runs(
    tmp_path: Path,
) -> None:
    """A table's values are its command's: stream does not refuse what only poll takes."""
    path = write(
        tmp_path, 'dsn = "dbname=shop"\nkafka-bootstrap = "k:9092"\n[poll]\nworkers = 99\n'
    )
    assert parse("stream", "--config", str(path)).params["dsn"] == "dbname=shop"
    with pytest.raises(UsageError, match="workers: 99 is not in the range"):
        parse("poll", "--config", str(path))


# -- config show ---------------------------------------------------------------------------------


def show(*args: str, env_vars: dict[str, str] | None = None) -> Any:
    result = CliRunner().invoke(cli, ["config", "show", *args], env=env_vars)
    assert result.exit_code == 0, (result.output, result.exception)
    return result.output


def test_config_show_says_where_each_setting_comes_from_and_hides_passwords(
    tmp_path: Path,
) -> None:
    # the passwords come from the environment: the file holds none (refused there)
    path = write(
        tmp_path,
        'dsn = "host=db dbname=shop"\n'
        'kafka-bootstrap = "k:9092"\n'
        'kafka-config = ["security.protocol=SASL_SSL"]\n'
        "[stream]\nstatus-interval = 5\n",
    )
    output = show(
        "--config",
        str(path),
        "--json",
        env_vars={
            "CDC_RELAY_SLOT": "from_env",
            "CDC_RELAY_KAFKA_CONFIG_FILE": "",
            "CDC_RELAY_DSN": "host=db dbname=shop password='hunter2'",
            "CDC_RELAY_KAFKA_CONFIG": "security.protocol=SASL_SSL sasl.password=s3cret "
            "ssl.key.password=k3y sasl.oauthbearer.config=t0ken",
        },
    )
    shown = json.loads(output)
    for secret in ("hunter2", "s3cret", "k3y", "t0ken"):
        assert secret not in output
    assert shown["command"] == "stream"
    assert shown["config_file"] == str(path)
    settings = shown["settings"]
    assert set(settings["dsn"]["value"].split()) == {"password=***", "host=db", "dbname=shop"}
    assert settings["dsn"]["source"] == "env CDC_RELAY_DSN"
    assert settings["kafka-bootstrap"]["source"] == f"file:{path} top level"
    assert settings["kafka-config"]["value"] == [
        "security.protocol=SASL_SSL",
        "sasl.password=***",
        "ssl.key.password=***",
        "sasl.oauthbearer.config=***",
    ]
    assert settings["slot"] == {"value": "from_env", "source": "env CDC_RELAY_SLOT"}
    assert settings["status-interval"] == {"value": 5.0, "source": f"file:{path} [stream]"}
    assert settings["standby"] == {"value": False, "source": "default"}
    assert "config" not in settings


def test_config_show_hides_passwords_that_come_from_the_environment() -> None:
    output = show(
        "poll",
        env_vars={
            "CDC_RELAY_DSN": "postgresql://relay:hunter2@db/shop",
            "CDC_RELAY_KAFKA_CONFIG": "sasl.password=s3cret",
        },
    )
    assert "hunter2" not in output and "s3cret" not in output
    (dsn,) = (line for line in output.splitlines() if line.startswith("dsn "))
    assert "password=***" in dsn and dsn.endswith("env CDC_RELAY_DSN")
    assert "config file: none" in output.splitlines()[0]


def test_config_show_of_a_command_in_a_group_and_a_required_option_unset(tmp_path: Path) -> None:
    path = write(tmp_path, "[dead-letters.list]\nlimit = 5\n")
    output = show("dead-letters", "list", "--config", str(path))
    lines = {line.split()[0]: line for line in output.splitlines()[1:]}
    assert lines["limit"].split()[1:] == ["5", f"file:{path}", "[dead-letters.list]"]
    assert lines["dsn"].endswith("not set (required)")
    assert show("dead-letters.list", "--config", str(path)) == output


def test_config_show_writes_key_value_options_as_they_are_given(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "create-topics = true\n"
        'topic-config = ["retention.ms=604800000", "compression.type=zstd"]\n'
        '[stream]\ntopic-partitions-for = ["outbox.event.payment=3"]\n',
    )
    lines = {line.split()[0]: line for line in show("--config", str(path)).splitlines()[1:]}
    assert lines["topic-config"].split()[1:3] == ["retention.ms=604800000", "compression.type=zstd"]
    assert lines["topic-partitions-for"].split()[1] == "outbox.event.payment=3"
    settings = json.loads(show("setup-slot", "--config", str(path), "--json"))["settings"]
    assert settings["topic-config"]["value"] == ["retention.ms=604800000", "compression.type=zstd"]
    assert settings["topic-partitions-for"] == {"value": [], "source": "default"}
    assert show("setup-slot", "--config", str(path)).count("topic-partitions-for        - ") == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["nope"], "config show: no command nope"),
        (["dead-letters"], "dead-letters is a group; name one of its commands: list, retry"),
    ],
)
def test_config_show_of_no_command(args: list[str], message: str) -> None:
    result = CliRunner().invoke(cli, ["config", "show", *args])
    assert isinstance(result.exception, UsageError)
    assert message in str(result.exception)


def test_config_show_refuses_what_the_command_would(monkeypatch: pytest.MonkeyPatch) -> None:
    result = CliRunner().invoke(cli, ["config", "show", "poll"], env={"CDC_RELAY_WORKERS": "many"})
    assert isinstance(result.exception, UsageError)
    assert "--workers from env CDC_RELAY_WORKERS: 'many' is not a valid integer" in str(
        result.exception
    )


def test_config_show_hides_a_secret_the_environment_split_in_two() -> None:
    # click splits a repeatable option's variable at blanks: "key: value" becomes two items,
    # neither a setting; start-up refuses them, config show must not print the value
    output = show(
        "poll",
        env_vars={"CDC_RELAY_KAFKA_CONFIG": "sasl.password: hunter2 ssl.key.password =k3y"},
    )
    assert "hunter2" not in output and "k3y" not in output
    (line,) = (line for line in output.splitlines() if line.startswith("kafka-config "))
    assert line.split()[1:] == [
        "sasl.password=***",
        "***",
        "***",
        "***",
        "env",
        "CDC_RELAY_KAFKA_CONFIG",
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('dsn = "postgresql://relay:s3cret@db/shop"', "dsn (top level) holds a password"),
        ("[stream]\ndsn = \"host=db password='s 3cret'\"", "[stream] dsn holds a password"),
        ('[poll]\ndsn = "host=db sslpassword=s3cret"', "[poll] dsn holds a password"),
        ('kafka-config = ["sasl.password=s3cret"]', "kafka-config (top level) holds a secret"),
        ('[stream]\nkafka-config = "ssl.key.password: s3cret"', "[stream] kafka-config holds"),
        (
            'kafka-config = ["sasl.oauthbearer.client.secret=s3cret"]',
            "kafka-config (top level) holds a secret (sasl.oauthbearer.client.secret)",
        ),
    ],
)
def test_a_secret_in_a_value_is_refused_like_a_password_key(
    tmp_path: Path, text: str, message: str
) -> None:
    # README: no passwords in the file (a ConfigMap is no Secret, and a file is often readable
    # by others); the rule held for keys only, not for the dsn's or a Kafka setting's value
    path = write(tmp_path, 'kafka-bootstrap = "k:9092"\n' + text)
    for command in (("stream",), ("poll",), ("dead-letters", "list")):
        with pytest.raises(UsageError) as caught:
            parse(*command, "--config", str(path))
        assert str(path) in str(caught.value)
        assert message in str(caught.value)
        assert "s3cret" not in str(caught.value) and "s 3cret" not in str(caught.value)
