"""Options are refused while they are parsed, before a connection is tried: one line, no
traceback."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import click
import pytest
from click.testing import CliRunner

from cdc_relay.commands import options, process_title
from cdc_relay.commands import stream as stream_command
from cdc_relay.commands.cli import cli
from cdc_relay.commands.options import Seconds
from cdc_relay.errors import UsageError

# Enough for each command to get past its required options if a bad value slipped through.
REQUIRED = ["--dsn", "host=db.invalid", "--kafka-bootstrap", "kafka.invalid:9092"]


def required(command: click.Command) -> list[str]:
    """The required options and arguments of ``command``, with values that pass."""
    values = dict(zip(REQUIRED[::2], REQUIRED[1::2], strict=True)) | {"--older-than": "1d"}
    arguments = {"event_id": "00000000-0000-0000-0000-000000000000", "name": "outbox"}
    return [
        arg
        for p in command.params
        if p.required
        for arg in (
            (arguments[str(p.name)],)
            if isinstance(p, click.Argument)
            else (p.opts[0], values[p.opts[0]])
        )
    ]


def commands(
    group: click.Group = cli, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], click.Command]]:
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield from commands(command, (*path, name))
        else:
            yield (*path, name), command


def seconds_options() -> list[tuple[tuple[str, ...], str]]:
    return [
        (path, param.opts[0])
        for path, command in commands()
        for param in command.params
        if isinstance(param.type, click.FloatRange)
    ]


def test_every_float_option_is_seconds() -> None:
    options = seconds_options()
    assert {name for _, name in options} >= {
        "--status-interval",
        "--shutdown-timeout",
        "--kafka-timeout",
        "--progress-interval",
        "--poll-interval",
        "--backoff-base",
        "--backoff-max",
    }
    for path, name in options:
        command = dict(commands())[path]
        (param,) = (p for p in command.params if p.opts[0] == name)
        assert isinstance(param.type, Seconds), (path, name)


@pytest.mark.parametrize(("path", "option"), seconds_options())
@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-inf", "1e999", "ten"])
def test_seconds_refuse_what_is_not_a_finite_number_in_range(
    path: tuple[str, ...], option: str, value: str
) -> None:
    # the option first: click checks options in the order they were given
    result = CliRunner().invoke(cli, [*path, option, value, *required(dict(commands())[path])])
    assert result.exit_code == 2, result.output
    assert f"{value!r} is not a number of seconds from" in result.output
    assert "Traceback" not in result.output


def test_seconds_keep_their_range() -> None:
    seconds = Seconds(0.1, 3600)
    assert seconds.convert("0.1", None, None) == 0.1
    assert seconds.convert(3600.0, None, None) == 3600
    for value in ("0.05", "3600.5", "nan"):
        with pytest.raises(click.BadParameter, match=r"from 0\.1 to 3600"):
            seconds.convert(value, None, None)


@pytest.mark.parametrize("text", ["nand", "infd", "-infs", "1e12d", "36526d", "5219w", "nan"])
def test_prune_ages_must_be_finite_and_at_most_100_years(text: str) -> None:
    with pytest.raises(click.BadParameter, match="is not an age from 0s to 100 years"):
        options.age(click.Context(click.Command("prune")), click.Option(["--older-than"]), text)
    result = CliRunner().invoke(cli, ["prune", "--older-than", text, "--dsn", "host=db.invalid"])
    assert result.exit_code == 2
    assert "is not an age" in result.output


def test_prune_ages_up_to_100_years() -> None:
    age = options.age(
        click.Context(click.Command("prune")), click.Option(["--older-than"]), "36525d"
    )
    assert age == timedelta(days=36525)


@pytest.mark.parametrize("template", ["outbox.{}", "{aggregate_type!r}", "{aggregate_type:d}"])
@pytest.mark.parametrize("command", ["stream", "poll", "setup-slot"])
def test_a_bad_topic_template_is_refused_while_parsing(command: str, template: str) -> None:
    result = CliRunner().invoke(cli, [command, "--topic-template", template, *REQUIRED])
    assert isinstance(result.exception, UsageError)
    assert "may use {aggregate_type} and {event_type}" in str(result.exception)


class FakeTitle:
    """setproctitle's functions, on a title of our own."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, works: bool = True) -> None:
        self.titles: list[str] = []
        self.works = works
        for name in ("setproctitle", "getproctitle", "setthreadtitle", "getthreadtitle"):
            monkeypatch.setattr(process_title.setproctitle, name, getattr(self, name))

    def setproctitle(self, title: str) -> None:
        self.titles.append(title)

    def getproctitle(self) -> str:
        return self.titles[-1] if self.works else "python"

    def setthreadtitle(self, title: str) -> None:
        assert title == "cdc-relay"

    def getthreadtitle(self) -> str:
        return "cdc-relay"


def test_a_password_in_the_dsn_is_hidden_from_the_process_title(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    title = FakeTitle(monkeypatch)
    argv = ["python", "-m", "cdc_relay", "stream", "--dsn", "host=db password=hunter2"]
    process_title.hide_passwords_from_the_process_list(argv)
    assert title.titles == ["python -m cdc_relay stream --dsn password=*** host=db"]
    (warning,) = capsys.readouterr().err.splitlines()
    assert warning.startswith("cdc-relay: warning: a password in --dsn")
    assert "until start-up hid it" in warning
    assert "PGPASSWORD, a .pgpass file, or CDC_RELAY_DSN" in warning

    process_title.hide_passwords_from_the_process_list(["cdc-relay", "stream", "--dsn", "host=db"])
    assert len(title.titles) == 1  # no password: the title is left alone
    assert capsys.readouterr().err == ""


def test_the_warning_does_not_claim_a_title_it_could_not_set(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    FakeTitle(monkeypatch, works=False)
    argv = ["cdc-relay", "poll", "--kafka-config", "sasl.password=hunter2"]
    process_title.hide_passwords_from_the_process_list(argv)
    (warning,) = capsys.readouterr().err.splitlines()
    assert "--kafka-config could be read in the process list all along" in warning
    assert "CDC_RELAY_KAFKA_SASL_PASSWORD" in warning


@pytest.mark.parametrize("command", ["status", "prune", "poll", "trace"])
def test_a_command_of_one_table_refuses_several(
    command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CDC_RELAY_TABLE", "tenant_a.outbox_events tenant_b.outbox_events")
    path = tuple(command.split())
    result = CliRunner().invoke(cli, [*path, *required(dict(commands())[path])])
    assert result.exit_code == 2, result.output
    assert "names several tables; this command takes one" in result.output


def test_a_quoted_table_name_may_hold_a_space() -> None:
    assert options._one_table(None, None, '"my schema"."outbox events"') == (  # type: ignore[arg-type]
        '"my schema"."outbox events"'
    )


def test_stream_and_setup_slot_take_several_tables_from_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CDC_RELAY_TABLE", "tenant_a.outbox_events tenant_b.outbox_events")
    seen = {}

    def fake(settings: object, *args: object) -> None:
        seen["tables"] = settings.tables  # type: ignore[attr-defined]

    monkeypatch.setattr(stream_command, "StreamRelay", lambda settings, health: fake(settings))
    monkeypatch.setattr(stream_command, "run_relay", lambda relay: None)
    result = CliRunner().invoke(cli, ["stream", *REQUIRED])
    assert result.exit_code == 0, result.output
    assert seen["tables"] == ("tenant_a.outbox_events", "tenant_b.outbox_events")


def test_republish_since_refuses_several_tables() -> None:
    result = CliRunner().invoke(
        cli,
        [
            "setup-slot",
            "--table",
            "tenant_a.outbox_events",
            "--table",
            "tenant_b.outbox_events",
            "--republish-since",
            "1h",
            *REQUIRED,
        ],
    )
    assert result.exit_code != 0
    assert isinstance(result.exception, UsageError), result.output
    assert "--republish-since publishes the rows of one outbox table" in str(result.exception)
