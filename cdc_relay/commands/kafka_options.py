"""Kafka's options and a relay's: where and how events are published (``WireOptions``), and
what a relay adds (``RelayOptions``: stopping, metrics, logs), each declared once and handed to
a command as one value; the commands that only read Kafka take its connection alone."""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import click

from cdc_relay import logs
from cdc_relay.commands.options import F, Seconds, env_option
from cdc_relay.config import kafka_settings
from cdc_relay.errors import UsageError
from cdc_relay.kafka import cloudevents
from cdc_relay.kafka.exactly_once import DEFAULT_CHECKPOINT_TOPIC
from cdc_relay.kafka.routing import (
    DEFAULT_TOPIC_TEMPLATE,
    aggregate_topic,
    check_template,
    could_make,
)
from cdc_relay.kafka.sink import producer_config
from cdc_relay.kafka.topics import BROKER_DEFAULT, TopicSpec
from cdc_relay.metrics import STALL_TIMEOUT, Health, serve
from cdc_relay.relay.settings import RelaySettings


def _topic_template(ctx: click.Context, param: click.Parameter, value: str) -> str:
    return check_template(value)


MAX_PARTITIONS = 100_000  # of one topic, --topic-partitions and --topic-partitions-for
_TOPIC_NAME = re.compile(r"[A-Za-z0-9._-]{1,249}")
_CONFIG_KEY = re.compile(r"[a-z0-9]+([._-][a-z0-9]+)*")


def _replication_factor(ctx: click.Context, param: click.Parameter, value: int | None) -> Any:
    if value is not None and value < 1 and value != BROKER_DEFAULT:
        raise click.BadParameter(
            f"{value} is no replication factor: give 1 or more, or -1 for the broker's "
            "default.replication.factor"
        )
    return value


def _topic_config(
    ctx: click.Context, param: click.Parameter, values: tuple[str, ...]
) -> dict[str, str]:
    config: dict[str, str] = {}
    for pair in values:
        key, equals, value = pair.partition("=")
        key, value = key.strip(), value.strip()
        if not equals or not _CONFIG_KEY.fullmatch(key) or not value:
            raise click.BadParameter(
                f"{pair!r} is not KEY=VALUE with a topic setting as KEY (e.g. retention.ms="
                "604800000, min.insync.replicas=2)"
            )
        if key in config and config[key] != value:
            raise click.BadParameter(f"{key} is given twice, as {config[key]} and {value}")
        config[key] = value
    return config


def _partitions_for(
    ctx: click.Context, param: click.Parameter, values: tuple[str, ...]
) -> dict[str, int]:
    counts: dict[str, int] = {}
    for pair in values:
        topic, equals, count = pair.rpartition("=")
        topic = topic.strip()
        try:
            partitions = int(count.strip()) if equals else 0
        except ValueError:
            partitions = 0
        if (
            not _TOPIC_NAME.fullmatch(topic)
            or topic in (".", "..")
            or not (1 <= partitions <= MAX_PARTITIONS)
        ):
            raise click.BadParameter(
                f"{pair!r} is not TOPIC=N with a Kafka topic name (letters, digits, '.', '_', "
                f"'-') and N a partition count from 1 to {MAX_PARTITIONS}"
            )
        if counts.get(topic, partitions) != partitions:
            raise click.BadParameter(f"topic {topic} is given two partition counts")
        counts[topic] = partitions
    return counts


def _cloudevents_source(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
    return None if value is None else cloudevents.check_source(value)


CHECKPOINT_TOPIC = env_option(
    "--checkpoint-topic",
    default=DEFAULT_CHECKPOINT_TOPIC,
    show_default=True,
    help="The compacted topic of stream --exactly-once's checkpoints (stream and setup-slot "
    "--exactly-once create it if missing).",
)


def metrics_options(func: F) -> F:
    func = env_option(
        "--metrics-port",
        type=click.IntRange(0, 65535),
        default=0,
        show_default=True,
        help="Serve /metrics, /healthz (200 while the relay's loop turns) and /readyz (200 "
        "while connected to PostgreSQL and Kafka and moving: not once events have waited "
        f"{STALL_TIMEOUT:g} s for Kafka with none acknowledged) on this port; 0 turns them off.",
    )(func)
    return env_option(
        "--metrics-host",
        default="0.0.0.0",  # noqa: S104 - in a container, probes and scrapes come from outside
        show_default=True,
        help="Address to serve metrics and health on.",
    )(func)


def start_metrics(host: str, port: int) -> Health:
    """The health state the relay updates, served over HTTP when ``port`` is set."""
    health = Health()
    if port:
        try:
            serve(host, port, health)
        except OSError as exc:
            raise UsageError(
                f"cannot serve metrics on {host}:{port}: {exc.strerror}; "
                "choose another --metrics-port"
            ) from None
    return health


def log_options(func: F) -> F:
    func = env_option(
        "--log-format",
        type=click.Choice(["text", "json"]),
        default="text",
        show_default=True,
        help="Log lines for people or JSON lines for machines.",
    )(func)
    return env_option(
        "--log-level",
        type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
        default="INFO",
        show_default=True,
        help="Write log lines of this severity and above: INFO includes the start-up and the "
        "progress lines (--progress-interval), WARNING only what needs attention.",
    )(func)


# The options of kafka_options that say what an event looks like on Kafka, beyond its topic,
# and how a missing topic is made: only commands that publish take them.
_WIRE = (
    "--tombstone-on-empty-payload",
    "--cloudevents",
    "--cloudevents-source",
    "--create-topics",
    "--topic-partitions",
    "--topic-partitions-for",
    "--topic-replication-factor",
    "--topic-config",
)


def kafka_options(
    required: bool = True, *, topics: bool = True, wire: bool = True
) -> Callable[[F], F]:
    """Where and how events are published: every command that publishes takes the same; one
    that only reads Kafka takes the connection (and, with ``topics``, the topic template)."""

    def decorate(func: F) -> F:
        options = {
            "--kafka-bootstrap": env_option(
                "--kafka-bootstrap",
                required=required,
                help="Kafka bootstrap servers, host:port[,host:port...].",
            ),
            "--kafka-config": env_option(
                "--kafka-config",
                multiple=True,
                metavar="KEY=VALUE",
                help="A librdkafka setting (repeatable), e.g. security.protocol=SASL_SSL; "
                "key: value and key value work too. Passwords go in "
                "CDC_RELAY_KAFKA_SASL_PASSWORD or the file, not here.",
            ),
            "--kafka-config-file": env_option(
                "--kafka-config-file",
                type=click.Path(exists=True, dir_okay=False, path_type=Path),
                help="A properties file of librdkafka settings (key=value, key: value or "
                "key value, as Java reads them); --kafka-config wins over it.",
            ),
            "--topic-template": env_option(
                "--topic-template",
                default=DEFAULT_TOPIC_TEMPLATE,
                show_default=True,
                callback=_topic_template,
                help="Topic of each event; may use {aggregate_type} and {event_type} (stream "
                "also {schema} and {table}, of the event's outbox table), as they are (no "
                "conversion or format spec), and {{ }} for braces.",
            ),
            "--tombstone-on-empty-payload": env_option(
                "--tombstone-on-empty-payload",
                is_flag=True,
                help="Publish NULL and empty payloads as tombstones (null value); without "
                "it a NULL payload stops the relay.",
            ),
            "--kafka-timeout": env_option(
                "--kafka-timeout",
                type=Seconds(0.1, 3600),
                default=15.0,
                show_default=True,
                help="Seconds to wait for a broker to answer at start-up.",
            ),
            "--cloudevents": env_option(
                "--cloudevents",
                "cloudevents_enabled",
                is_flag=True,
                help="Add the CloudEvents headers of the Kafka binding's binary mode "
                "(ce_specversion, ce_id, ce_source, ce_type, ce_time from created_at, "
                "ce_subject from aggregate_id, content-type); key and value stay as they are.",
            ),
            "--cloudevents-source": env_option(
                "--cloudevents-source",
                metavar="URI-REFERENCE",
                callback=_cloudevents_source,
                help="ce_source of every event, with --cloudevents; default "
                "/cdc-relay/<database>/<schema>.<table> of the outbox table.",
            ),
            "--create-topics": env_option(
                "--create-topics",
                is_flag=True,
                help="Create a topic Kafka does not have before its first event (with the "
                "--topic-* options below; a topic Kafka has is used as it is), for brokers "
                "with automatic topic creation off. Needs CREATE and DESCRIBE_CONFIGS on the "
                "topics; a refused creation stops the relay.",
            ),
            "--topic-partitions": env_option(
                "--topic-partitions",
                type=click.IntRange(1, MAX_PARTITIONS),
                metavar="N",
                help="Partitions of a topic --create-topics makes.  [default: the broker's "
                "num.partitions]",
            ),
            "--topic-partitions-for": env_option(
                "--topic-partitions-for",
                multiple=True,
                metavar="TOPIC=N",
                callback=_partitions_for,
                help="Partitions of one topic --create-topics makes, in place of "
                "--topic-partitions; TOPIC is the topic's name as --topic-template makes it (or "
                "the --dead-letter-topic); repeatable.",
            ),
            "--topic-replication-factor": env_option(
                "--topic-replication-factor",
                type=click.IntRange(-1, 32_767),
                metavar="N",
                callback=_replication_factor,
                help="Replication factor of a topic --create-topics makes; -1: the broker's "
                "default.replication.factor.  [default: -1]",
            ),
            "--topic-config": env_option(
                "--topic-config",
                multiple=True,
                metavar="KEY=VALUE",
                callback=_topic_config,
                help="A setting of a topic --create-topics makes (repeatable), e.g. "
                "min.insync.replicas=2 or retention.ms=604800000.",
            ),
        }
        left_out = (() if topics else ("--topic-template",)) + (() if wire else _WIRE)
        for name, option in reversed(options.items()):
            if name not in left_out:
                func = option(func)
        return func

    return decorate


def run_options(func: F) -> F:
    func = env_option(
        "--shutdown-timeout",
        type=Seconds(0, 3600),
        default=30.0,
        show_default=True,
        help="Seconds to wait for Kafka's acks when stopping.",
    )(func)
    return env_option(
        "--progress-interval",
        type=Seconds(0.5, 86400),
        default=10.0,
        show_default=True,
        help="Seconds between progress lines in the log.",
    )(func)


@dataclass(frozen=True)
class WireOptions:
    """Where and how events are published (``kafka_options``), declared once and handed to
    a command as one value by ``wire_options``."""

    kafka_bootstrap: str | None
    kafka_config: tuple[str, ...]
    kafka_config_file: Path | None
    topic_template: str
    tombstone_on_empty_payload: bool
    kafka_timeout: float
    cloudevents_enabled: bool
    cloudevents_source: str | None
    create_topics: bool
    topic_partitions: int | None
    topic_partitions_for: dict[str, int]
    topic_replication_factor: int | None
    topic_config: dict[str, str]

    def topic_creation(self, dead_letter_topic: str | None = None) -> TopicSpec | None:
        """How a missing topic is made (--create-topics); None without it. The --topic-*
        options without it are refused: they would do nothing; so is a --topic-partitions-for
        whose topic neither --topic-template nor ``dead_letter_topic`` names."""
        if not self.create_topics:
            given = [
                name
                for name, value in (
                    ("--topic-partitions", self.topic_partitions),
                    ("--topic-partitions-for", self.topic_partitions_for),
                    ("--topic-replication-factor", self.topic_replication_factor),
                    ("--topic-config", self.topic_config),
                )
                if value
            ]
            if given:
                raise UsageError(
                    f"{', '.join(given)} say how --create-topics makes a topic: give "
                    "--create-topics (CDC_RELAY_CREATE_TOPICS=true) too, or leave them out"
                )
            return None
        for topic, count in self.topic_partitions_for.items():
            if topic != dead_letter_topic and not could_make(self.topic_template, topic):
                names = " and --dead-letter-topic name" if dead_letter_topic else " names"
                meant = aggregate_topic(self.topic_template, topic)
                raise UsageError(
                    f"--topic-partitions-for {topic}={count}: --topic-template "
                    f"{self.topic_template!r}{names} no topic {topic}, so it would do nothing; "
                    "give the topic's name"
                    + (f" (for the aggregate type {topic}: {meant}={count})" if meant else "")
                )
        return TopicSpec(
            partitions=self.topic_partitions or BROKER_DEFAULT,
            replication_factor=self.topic_replication_factor or BROKER_DEFAULT,
            config=self.topic_config,
            partitions_for=self.topic_partitions_for,
        )

    def producer(self) -> dict[str, str]:
        """The producer's configuration (sink.producer_config)."""
        return producer_config(
            self.kafka_bootstrap or "", kafka_settings(self.kafka_config, self.kafka_config_file)
        )

    def settings(
        self,
        dsn: str,
        table: str,
        header_columns: tuple[str, ...] = (),
        dead_letter_topic: str | None = None,
        **more: float,
    ) -> RelaySettings:
        """The settings every relay shares, for the outbox ``table`` of ``dsn``; ``more``:
        how it stops and reports (RelaySettings' defaults otherwise)."""
        return RelaySettings(
            dsn=dsn,
            kafka_config=self.producer(),
            topic_template=self.topic_template,
            tombstone_on_empty=self.tombstone_on_empty_payload,
            cloudevents=cloudevents.configure(
                self.cloudevents_enabled, self.cloudevents_source, dsn, table, header_columns
            ),
            kafka_timeout=self.kafka_timeout,
            topic_creation=self.topic_creation(dead_letter_topic),
            **more,
        )


@dataclass(frozen=True)
class RelayOptions(WireOptions):
    """The options every relay takes (the wire's, and stopping, metrics, logs), declared once
    by ``relay_options`` and handed to the command as one value."""

    kafka_bootstrap: str  # required by a relay
    shutdown_timeout: float
    progress_interval: float
    metrics_port: int
    metrics_host: str
    log_format: str
    log_level: str

    def start(self) -> Health:
        """Logs configured, metrics served: what a relay needs before it starts."""
        logs.configure(self.log_format, self.log_level)
        return start_metrics(self.metrics_host, self.metrics_port)

    def settings(
        self,
        dsn: str,
        table: str,
        header_columns: tuple[str, ...] = (),
        dead_letter_topic: str | None = None,
        **more: float,
    ) -> RelaySettings:
        return super().settings(
            dsn,
            table,
            header_columns,
            dead_letter_topic,
            shutdown_timeout=self.shutdown_timeout,
            progress_interval=self.progress_interval,
            **more,
        )


def _bundle(cls: type[WireOptions], name: str, func: F) -> F:
    """``func`` taking the options of dataclass ``cls`` as one value, its argument ``name``."""
    names = [f.name for f in dataclasses.fields(cls)]

    @functools.wraps(func)
    def command(**values: Any) -> Any:
        bundle = cls(**{option: values.pop(option) for option in names})
        return func(**{name: bundle}, **values)

    return cast(F, command)


def wire_options(required: bool = True) -> Callable[[F], F]:
    """Declare the options of ``WireOptions`` and pass them to the command as ``wire``."""

    def decorate(func: F) -> F:
        return kafka_options(required)(_bundle(WireOptions, "wire", func))

    return decorate


def relay_options(func: F) -> F:
    """Declare the options of ``RelayOptions`` and pass them to ``func`` as ``relay``."""
    command = _bundle(RelayOptions, "relay", func)
    return kafka_options()(run_options(metrics_options(log_options(command))))
