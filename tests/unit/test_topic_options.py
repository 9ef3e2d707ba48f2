"""--create-topics and the --topic-* options: parsed into one TopicSpec for stream, poll and
setup-slot, from flags or CDC_RELAY_* variables; a bad value refused while parsing, in one line."""

from __future__ import annotations

from typing import Any

import pytest
from click.testing import CliRunner

from cdc_relay.commands import poll as poll_command
from cdc_relay.commands import stream as stream_command
from cdc_relay.commands.cli import cli
from cdc_relay.errors import UsageError
from cdc_relay.kafka.routing import could_make
from cdc_relay.kafka.topics import TopicSpec

REQUIRED = ["--dsn", "host=db.invalid", "--kafka-bootstrap", "kafka.invalid:9092"]
RELAYS = {"stream": (stream_command, "StreamRelay"), "poll": (poll_command, "PollRelay")}


def settings_of(monkeypatch: pytest.MonkeyPatch, command: str, args: list[str]) -> Any:
    """The settings ``command`` would run its relay with."""
    module, relay = RELAYS[command]
    seen: dict[str, Any] = {}
    monkeypatch.setattr(module, relay, lambda settings, health: seen.setdefault("s", settings))
    monkeypatch.setattr(module, "run_relay", lambda relay: None)
    result = CliRunner().invoke(cli, [command, *args, *REQUIRED])
    assert result.exit_code == 0, result.output
    return seen["s"]


@pytest.mark.parametrize("command", ["stream", "poll"])
def test_the_options_make_one_spec(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    args = [
        "--create-topics",
        "--topic-partitions=12",
        "--topic-replication-factor=3",
        "--topic-config",
        "retention.ms=604800000",
        "--topic-config",
        "min.insync.replicas = 2",
        "--topic-partitions-for",
        "outbox.event.Order=24",
    ]
    spec = settings_of(monkeypatch, command, args).topic_creation
    assert spec == TopicSpec(
        12, 3, {"retention.ms": "604800000", "min.insync.replicas": "2"}, {"outbox.event.Order": 24}
    )
    assert spec.partitions_of("outbox.event.Order") == 24
    assert spec.partitions_of("outbox.event.Customer") == 12


@pytest.mark.parametrize("command", ["stream", "poll"])
def test_every_option_is_a_variable_too(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CDC_RELAY_CREATE_TOPICS", "true")
    monkeypatch.setenv("CDC_RELAY_TOPIC_PARTITIONS", "6")
    monkeypatch.setenv("CDC_RELAY_TOPIC_REPLICATION_FACTOR", "-1")
    monkeypatch.setenv("CDC_RELAY_TOPIC_CONFIG", "retention.ms=1000 cleanup.policy=compact")
    monkeypatch.setenv("CDC_RELAY_TOPIC_PARTITIONS_FOR", "outbox.event.a.b=1 outbox.event.c-d=2")
    spec = settings_of(monkeypatch, command, []).topic_creation
    assert spec == TopicSpec(
        6,
        -1,
        {"retention.ms": "1000", "cleanup.policy": "compact"},
        {"outbox.event.a.b": 1, "outbox.event.c-d": 2},
    )


@pytest.mark.parametrize("command", ["stream", "poll"])
def test_without_create_topics_nothing_is_created(
    command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert settings_of(monkeypatch, command, []).topic_creation is None
    spec = settings_of(monkeypatch, command, ["--create-topics"]).topic_creation
    assert spec == TopicSpec()  # the broker's partitions and replication factor
    assert spec.describe("t") == "the broker's partition count, the broker's replication factor"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--topic-partitions", "0"], "0 is not in the range 1<=x<=100000"),
        (["--topic-partitions", "-1"], "not in the range"),
        (["--topic-partitions", "many"], "'many' is not a valid integer"),
        (["--topic-replication-factor", "0"], "0 is no replication factor: give 1 or more, or -1"),
        (["--topic-replication-factor", "-2"], "not in the range -1<=x<=32767"),
        (["--topic-config", "retention.ms"], "'retention.ms' is not KEY=VALUE"),
        (["--topic-config", "=1"], "'=1' is not KEY=VALUE"),
        (["--topic-config", "retention.ms="], "'retention.ms=' is not KEY=VALUE"),
        (["--topic-config", "Retention Ms=1"], "is not KEY=VALUE"),
        (["--topic-config", "a=1", "--topic-config", "a=2"], "a is given twice, as 1 and 2"),
        (["--topic-partitions-for", "t=0"], "'t=0' is not TOPIC=N"),
        (["--topic-partitions-for", "t"], "'t' is not TOPIC=N"),
        (["--topic-partitions-for", "a topic=3"], "'a topic=3' is not TOPIC=N"),
        (["--topic-partitions-for", "t=x"], "'t=x' is not TOPIC=N"),
        # the bound of --topic-partitions: past it Kafka refuses, at the topic's first event
        (["--topic-partitions-for", "t=100001"], "'t=100001' is not TOPIC=N"),
        (
            ["--topic-partitions-for", "t=1", "--topic-partitions-for", "t=2"],
            "topic t is given two partition counts",
        ),
    ],
)
@pytest.mark.parametrize("command", ["stream", "poll", "setup-slot"])
def test_a_bad_value_is_refused_while_parsing(command: str, args: list[str], says: str) -> None:
    result = CliRunner().invoke(cli, [command, "--create-topics", *args, *REQUIRED])
    assert result.exit_code == 2, result.output
    assert says in " ".join(result.output.split()), result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("command", ["stream", "poll", "setup-slot"])
@pytest.mark.parametrize(
    "args",
    [
        ["--topic-partitions", "3"],
        ["--topic-replication-factor", "3"],
        ["--topic-config", "retention.ms=1"],
        ["--topic-partitions-for", "t=3"],
    ],
)
def test_a_topic_option_without_create_topics_is_refused(command: str, args: list[str]) -> None:
    result = CliRunner().invoke(cli, [command, *args, *REQUIRED])
    assert isinstance(result.exception, UsageError), result.output
    message = str(result.exception)
    assert f"{args[0]} say how --create-topics makes a topic: give --create-topics" in message
    assert "\n" not in message


@pytest.mark.parametrize("command", ["stream", "poll", "setup-slot"])
def test_partitions_for_a_topic_the_template_never_names_is_refused(command: str) -> None:
    """An aggregate type where its topic's name belongs matched no topic, and every topic got
    --topic-partitions without a word."""
    args = ["--create-topics", "--topic-partitions-for", "Order=24"]
    result = CliRunner().invoke(cli, [command, *args, *REQUIRED])
    assert isinstance(result.exception, UsageError), result.output
    assert str(result.exception) == (
        "--topic-partitions-for Order=24: --topic-template 'outbox.event.{aggregate_type}' "
        "names no topic Order, so it would do nothing; give the topic's name (for the aggregate "
        "type Order: outbox.event.Order=24)"
    )


@pytest.mark.parametrize(
    ("template", "meant"),
    [
        ("{schema}.{table}.{aggregate_type}", "{schema}.{table}.Order=3)"),
        ("{{x}}-{aggregate_type}", "{x}-Order=3)"),
        ("{schema}.{table}", None),
    ],
)
def test_the_refusal_shows_the_topic_of_the_aggregate_type_if_the_template_has_one(
    template: str, meant: str | None
) -> None:
    args = ["--create-topics", "--topic-template", template, "--topic-partitions-for", "Order=3"]
    result = CliRunner().invoke(cli, ["stream", *args, *REQUIRED])
    assert isinstance(result.exception, UsageError), result.output
    message = str(result.exception)
    assert message.startswith(f"--topic-partitions-for Order=3: --topic-template {template!r}")
    if meant is None:
        assert message.endswith("so it would do nothing; give the topic's name")
    else:
        assert message.endswith(f"(for the aggregate type Order: {meant}")


@pytest.mark.parametrize(
    ("template", "topic", "named"),
    [
        ("outbox.event.{aggregate_type}", "outbox.event.Order", True),
        ("outbox.event.{aggregate_type}", "outbox.event.", False),  # a field is never empty
        ("outbox.event.{aggregate_type}", "Order", False),
        ("outbox.event.{aggregate_type}", "outbox_event_Order", False),  # the dots as they are
        ("{schema}.{table}.{event_type}", "public.outbox.created", True),
        ("{schema}.{table}.{event_type}", "public.outbox", False),
        ("events", "events", True),
        ("events", "events2", False),
        ("a{{b}}.{aggregate_type}", "a{b}.x", True),
    ],
)
def test_which_topics_a_template_names(template: str, topic: str, named: bool) -> None:
    assert could_make(template, topic) is named


def test_the_dead_letter_topic_takes_its_own_partition_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    args = ["--create-topics", "--dead-letter-topic", "dl", "--topic-partitions-for", "dl=1"]
    spec = settings_of(monkeypatch, "stream", args).topic_creation
    assert spec.partitions_of("dl") == 1
    other = ["--create-topics", "--dead-letter-topic", "dl", "--topic-partitions-for", "dlq=1"]
    result = CliRunner().invoke(cli, ["stream", *other, *REQUIRED])
    assert isinstance(result.exception, UsageError), result.output
    assert "'outbox.event.{aggregate_type}' and --dead-letter-topic name no topic dlq" in str(
        result.exception
    )


def test_setup_slot_creates_topics_only_with_a_broker() -> None:
    result = CliRunner().invoke(
        cli, ["setup-slot", "--create-topics", "--dead-letter-topic", "dl", "--dsn", "host=x"]
    )
    assert isinstance(result.exception, UsageError), result.output
    assert "--create-topics creates topics in Kafka: give --kafka-bootstrap" in str(
        result.exception
    )


@pytest.mark.parametrize("command", ["status", "trace"])
def test_commands_that_publish_nothing_take_no_topic_options(command: str) -> None:
    result = CliRunner().invoke(cli, [command, "--help"])
    assert result.exit_code == 0
    assert "--create-topics" not in result.output
    assert "--topic-partitions" not in result.output
