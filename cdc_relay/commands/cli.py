"""The ``cdc-relay`` command: parse options, build objects, run. No logic of its own."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import re
import signal
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar, cast

import click
import setproctitle

from cdc_relay import __version__, logs, schema
from cdc_relay.commands import startup
from cdc_relay.config import (
    DEFAULT_PUBLICATION,
    DEFAULT_SLOT,
    DEFAULT_TABLE,
    SAFER_PLACES,
    RelaySettings,
    checked_dsn,
    env,
    hide_passwords,
    kafka_settings,
)
from cdc_relay.errors import PreflightError, RelayError, UsageError
from cdc_relay.events import OutboxLayout
from cdc_relay.kafka import cloudevents
from cdc_relay.kafka.deadletter import dead_letters, retry_dead_letters
from cdc_relay.kafka.exactly_once import (
    DEFAULT_CHECKPOINT_TOPIC,
    ExactlyOnce,
    checkpoint_status,
    ensure_topic,
)
from cdc_relay.kafka.exactly_once import transactional_id as eos_id
from cdc_relay.kafka.routing import DEFAULT_TOPIC_TEMPLATE, check_template
from cdc_relay.kafka.sink import producer_config
from cdc_relay.lsn import format_lsn
from cdc_relay.metrics import Health, serve
from cdc_relay.ops.handover import handover, republish
from cdc_relay.ops.prune import prune_confirmed, prune_processed
from cdc_relay.ops.trace import TraceSettings, summary, trace
from cdc_relay.postgres import failover
from cdc_relay.postgres.connection import connect
from cdc_relay.postgres.messages import DEFAULT_WRITER, Messages, writers_problem
from cdc_relay.postgres.shards import MAX_SHARDS, Shard, every_shard
from cdc_relay.postgres.slot import SlotSpec, drop, reshard, setup, status
from cdc_relay.relay.poller import PollRelay, PollSettings
from cdc_relay.relay.stream import StreamRelay
from cdc_relay.relay.stream_settings import StreamSettings

F = TypeVar("F", bound=Callable[..., Any])
log = logging.getLogger(__name__)


def _option(name: str, *more: str, **kwargs: Any) -> Callable[[F], F]:
    """A click option that also reads CDC_RELAY_<NAME> and shows it in --help."""
    return click.option(name, *more, envvar=env(name), show_envvar=True, **kwargs)


def _dsn(ctx: click.Context, param: click.Parameter, value: str) -> str:
    return checked_dsn(value)


def _topic_template(ctx: click.Context, param: click.Parameter, value: str) -> str:
    return check_template(value)


def _cloudevents_source(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
    return None if value is None else cloudevents.check_source(value)


def _since(
    ctx: click.Context, param: click.Parameter, value: str | None
) -> datetime | timedelta | None:
    """An age as ``_age`` reads it (--older-than's), or an ISO 8601 moment with its zone."""
    if value is None:
        return None
    try:
        return _age(ctx, param, value)
    except click.BadParameter:
        pass
    try:
        moment = datetime.fromisoformat(value.strip())
    except ValueError:
        moment = None
    if moment is None or moment.tzinfo is None:
        raise click.BadParameter(
            f"{value!r} is neither an ISO 8601 moment with its zone (2026-01-05T09:00:00Z, "
            "2026-01-05 10:00+01:00) nor an age (90s, 30m, 12h, 7d, 2w)"
        )
    return moment


class Seconds(click.FloatRange):
    """A duration in seconds within a range. NaN is refused too, which a plain FloatRange
    lets through (every comparison with NaN is false), and so is infinity."""

    name = "seconds"

    def __init__(self, low: float, high: float) -> None:
        super().__init__(low, high)
        self.low, self.high = low, high

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, float):
            seconds = value
        else:
            try:
                seconds = float(value)
            except (TypeError, ValueError):
                seconds = math.nan
        if not math.isfinite(seconds) or not self.low <= seconds <= self.high:
            self.fail(
                f"{value!r} is not a number of seconds from {self.low:g} to {self.high:g}",
                param,
                ctx,
            )
        return seconds


_DSN = _option(
    "--dsn",
    required=True,
    callback=_dsn,
    help="libpq connection string or URI of the database with the outbox. Give "
    "the password through PGPASSWORD or a .pgpass file, not here.",
)


def _one_table(ctx: click.Context, param: click.Parameter, value: str) -> str:
    # Space outside double quotes: several tables, as CDC_RELAY_TABLE holds for stream.
    if re.search(r"\s", re.sub(r'"(?:[^"]|"")*"', "", value)):
        raise click.BadParameter(
            f"{value!r} names several tables; this command takes one (setup-slot and stream "
            "take several, e.g. from CDC_RELAY_TABLE): give it --table"
        )
    return value


_TABLE = _option(
    "--table",
    default=DEFAULT_TABLE,
    show_default=True,
    callback=_one_table,
    help="The outbox table, optionally schema-qualified.",
)
_TABLES = _option(
    "--table",
    "tables",
    multiple=True,
    default=(DEFAULT_TABLE,),
    show_default=True,
    help="An outbox table, optionally schema-qualified; repeatable: every table in one "
    "publication and slot (CDC_RELAY_TABLE: names separated by spaces).",
)


_COLUMNS = _option(
    "--column",
    "columns",
    multiple=True,
    metavar="FIELD=COLUMN",
    help="Map an event field (id, aggregate_type, aggregate_id, event_type, payload) to a "
    "column of your outbox table; repeatable.",
)
_SHARDS = _option(
    "--shards",
    type=click.IntRange(1, MAX_SHARDS),
    help="Work on N shards: slots and publications named SLOT_KofN and PUBLICATION_KofN, each "
    "publication filtered on a hash of the aggregate id (PostgreSQL 15 or newer).",
)


def _messages(help: str) -> Callable[[F], F]:
    """--messages, whose meaning each command says: stream relays messages, setup-slot and
    status check who may write them."""
    return _option("--messages", is_flag=True, help=help)


_MESSAGE_WRITERS = _option(
    "--message-writer",
    "message_writers",
    multiple=True,
    default=(DEFAULT_WRITER,),
    show_default=True,
    metavar="ROLE",
    help="With --messages: a role that may write events as logical decoding messages (it and "
    "its members); repeatable (CDC_RELAY_MESSAGE_WRITER: names separated by spaces). "
    "Superusers always may; no other role may be able to run pg_logical_emit_message.",
)


_CHECKPOINT_TOPIC = _option(
    "--checkpoint-topic",
    default=DEFAULT_CHECKPOINT_TOPIC,
    show_default=True,
    help="The compacted topic of stream --exactly-once's checkpoints (stream and setup-slot "
    "--exactly-once create it if missing).",
)


def _shard(ctx: click.Context, param: click.Parameter, value: str | None) -> Shard | None:
    return None if value is None else Shard.parse(value)


def _specs(
    slot: str, publication: str, table: str, count: int | None, **more: Any
) -> list[SlotSpec]:
    """The slot and publication of each shard, or the one pair when ``count`` is None."""
    spec = SlotSpec(slot=slot, publication=publication, table=table, **more)
    return [spec] if count is None else [spec.sharded(shard) for shard in every_shard(count)]


def _database_options(table: Callable[[Any], Any]) -> Callable[[F], F]:
    def decorate(func: F) -> F:
        options: list[Callable[[Any], Any]] = [
            _DSN,
            _option("--slot", default=DEFAULT_SLOT, show_default=True, help="Replication slot."),
            _option(
                "--publication",
                default=DEFAULT_PUBLICATION,
                show_default=True,
                help="Publication on the outbox table.",
            ),
            table,
        ]
        for option in reversed(options):
            func = option(func)
        return func

    return decorate


database_options = _database_options(_TABLE)
"""DSN, slot, publication and one outbox table."""
several_tables_options = _database_options(_TABLES)
"""The same with --table repeatable (setup-slot, stream)."""


def outbox_options(func: F) -> F:
    """The database and the outbox table, for the commands that need no slot."""
    return _DSN(_TABLE(func))


def metrics_options(func: F) -> F:
    func = _option(
        "--metrics-port",
        type=click.IntRange(0, 65535),
        default=0,
        show_default=True,
        help="Serve /metrics, /healthz and /readyz on this port; 0 turns them off.",
    )(func)
    return _option(
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
    func = _option(
        "--log-format",
        type=click.Choice(["text", "json"]),
        default="text",
        show_default=True,
        help="Log lines for people or JSON lines for machines.",
    )(func)
    return _option(
        "--log-level",
        type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
        default="INFO",
        show_default=True,
    )(func)


# The options of kafka_options that say what an event looks like on Kafka, beyond its topic:
# only commands that publish take them.
_WIRE = ("--tombstone-on-empty-payload", "--cloudevents", "--cloudevents-source")


def kafka_options(
    required: bool = True, *, topics: bool = True, wire: bool = True
) -> Callable[[F], F]:
    """Where and how events are published: every command that publishes takes the same; one
    that only reads Kafka takes the connection (and, with ``topics``, the topic template)."""

    def decorate(func: F) -> F:
        options = {
            "--kafka-bootstrap": _option(
                "--kafka-bootstrap",
                required=required,
                help="Kafka bootstrap servers, host:port[,host:port...].",
            ),
            "--kafka-config": _option(
                "--kafka-config",
                multiple=True,
                metavar="KEY=VALUE",
                help="A librdkafka setting (repeatable), e.g. security.protocol=SASL_SSL; "
                "key: value and key value work too. Passwords go in "
                "CDC_RELAY_KAFKA_SASL_PASSWORD or the file, not here.",
            ),
            "--kafka-config-file": _option(
                "--kafka-config-file",
                type=click.Path(exists=True, dir_okay=False, path_type=Path),
                help="A properties file of librdkafka settings (key=value, key: value or "
                "key value, as Java reads them); --kafka-config wins over it.",
            ),
            "--topic-template": _option(
                "--topic-template",
                default=DEFAULT_TOPIC_TEMPLATE,
                show_default=True,
                callback=_topic_template,
                help="Topic of each event; may use {aggregate_type} and {event_type} (stream "
                "also {schema} and {table}, of the event's outbox table), as they are (no "
                "conversion or format spec), and {{ }} for braces.",
            ),
            "--tombstone-on-empty-payload": _option(
                "--tombstone-on-empty-payload",
                is_flag=True,
                help="Publish NULL and empty payloads as tombstones (null value); without "
                "it a NULL payload stops the relay.",
            ),
            "--kafka-timeout": _option(
                "--kafka-timeout",
                type=Seconds(0.1, 3600),
                default=15.0,
                show_default=True,
                help="Seconds to wait for a broker to answer at start-up.",
            ),
            "--cloudevents": _option(
                "--cloudevents",
                "cloudevents_enabled",
                is_flag=True,
                help="Add the CloudEvents headers of the Kafka binding's binary mode "
                "(ce_specversion, ce_id, ce_source, ce_type, ce_time from created_at, "
                "ce_subject from aggregate_id, content-type); key and value stay as they are.",
            ),
            "--cloudevents-source": _option(
                "--cloudevents-source",
                metavar="URI-REFERENCE",
                callback=_cloudevents_source,
                help="ce_source of every event, with --cloudevents; default "
                "/cdc-relay/<database>/<schema>.<table> of the outbox table.",
            ),
        }
        left_out = (() if topics else ("--topic-template",)) + (() if wire else _WIRE)
        for name, option in reversed(options.items()):
            if name not in left_out:
                func = option(func)
        return func

    return decorate


def run_options(func: F) -> F:
    func = _option(
        "--shutdown-timeout",
        type=Seconds(0, 3600),
        default=30.0,
        show_default=True,
        help="Seconds to wait for Kafka's acks when stopping.",
    )(func)
    return _option(
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

    def producer(self) -> dict[str, str]:
        """The producer's configuration (sink.producer_config)."""
        return producer_config(
            self.kafka_bootstrap or "", kafka_settings(self.kafka_config, self.kafka_config_file)
        )

    def settings(
        self, dsn: str, table: str, header_columns: tuple[str, ...] = (), **more: float
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
        self, dsn: str, table: str, header_columns: tuple[str, ...] = (), **more: float
    ) -> RelaySettings:
        return super().settings(
            dsn,
            table,
            header_columns,
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


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="cdc-relay")
@click.pass_context
def cli(ctx: click.Context) -> None:
    """Relay transactional-outbox events from PostgreSQL to Kafka.

    Every option can also be set by its CDC_RELAY_* environment variable.
    """
    if ctx.invoked_subcommand not in _RELAYS:
        startup.restore_stops()  # the other commands stop as any program does


_RELAYS = ("stream", "poll")
"""The commands that defer a stop asked for during start-up until they can act on it."""


def run_relay(relay: StreamRelay | PollRelay) -> None:
    """Run ``relay`` until SIGTERM or Ctrl-C; one that came during start-up stops it before
    it starts."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: relay.request_stop())
    if startup.stop_requested():
        log.info(
            "stopped during start-up; nothing was relayed or confirmed",
            extra={"action": "stop"},
        )
        return
    relay.run()


@cli.command("setup-slot")
@several_tables_options
@_option(
    "--plugin",
    type=click.Choice(["pgoutput", "wal2json"]),
    default="pgoutput",
    show_default=True,
    help="Logical decoding plugin of the slot.",
)
@_SHARDS
@_COLUMNS
@click.option(
    "--dry-run", is_flag=True, help="Check the database and print the SQL; change nothing."
)
@click.option(
    "--from-poller",
    is_flag=True,
    help="Take over from cdc-relay poll (stopped first): create the slot with an exported "
    "snapshot and publish the rows still unprocessed in it; stream takes the rest.",
)
@_option(
    "--republish-since",
    metavar="TIME",
    callback=_since,
    help="Make a lost slot anew (gone after a promotion, or dropped once invalidated): create "
    "it with an exported snapshot and first publish, with the Kafka options, every row created "
    "since TIME (ISO 8601 with a zone, or an age: 30m, 2h, 7d) committed in it; stream takes "
    "the rest.",
)
@click.option(
    "--accept-gap",
    is_flag=True,
    help="Make a slot that existed and is gone anew at the WAL's position now, skipping what "
    "it had not confirmed (said with the span), or record a publication changed since its relay "
    "verified it as it is; --republish-since loses nothing instead.",
)
@_option(
    "--header-column",
    "header_columns",
    multiple=True,
    metavar="COLUMN",
    help="With --republish-since: send this column as a header, as stream does; repeatable.",
)
@_option(
    "--create-table",
    is_flag=True,
    help="Create the outbox table (cdc-relay schema show outbox) when it is missing; the "
    "role of --dsn then owns it. --table must then name an outbox_events table.",
)
@click.option(
    "--failover",
    "failover_slot",
    is_flag=True,
    help="Create a failover slot (PostgreSQL 17+), which standbys keep a copy of, and check "
    "the settings that needs on every host of --dsn.",
)
@_option(
    "--exactly-once",
    is_flag=True,
    help="For stream --exactly-once: create the checkpoint topic (compacted) if it does not "
    "exist; needs --kafka-bootstrap.",
)
@_CHECKPOINT_TOPIC
@_messages(
    "For stream --messages: check that only the writers (--message-writer) may emit logical "
    "decoding messages, as stream does at start."
)
@_MESSAGE_WRITERS
@wire_options(required=False)
def setup_slot(
    dsn: str,
    slot: str,
    publication: str,
    tables: tuple[str, ...],
    plugin: str,
    shards: int | None,
    columns: tuple[str, ...],
    dry_run: bool,
    from_poller: bool,
    republish_since: datetime | timedelta | None,
    accept_gap: bool,
    header_columns: tuple[str, ...],
    create_table: bool,
    failover_slot: bool,
    exactly_once: bool,
    checkpoint_topic: str,
    messages: bool,
    message_writers: tuple[str, ...],
    wire: WireOptions,
) -> None:
    """Check the database and create the publication and the replication slot.

    Safe to run again: what exists already is reported and left as it is. A slot that
    existed and is gone is made anew only with --republish-since TIME (the events it had not
    relayed published first) or --accept-gap (skipped, and said). With
    --from-poller (and the Kafka options) it is the switch from poll to stream. With
    --shards N, one slot and publication per shard. With --create-table, a missing outbox
    table is created first. With --exactly-once, the checkpoint topic too. With --table given
    more than once, one publication holds every table.
    """
    if exactly_once and not wire.kafka_bootstrap:
        raise UsageError("--exactly-once creates the checkpoint topic: give --kafka-bootstrap")
    if messages and (problem := writers_problem(dsn, message_writers)):
        raise PreflightError(problem)
    aggregate_column = OutboxLayout.from_options(columns, ()).aggregate_id
    table, *more_tables = tables
    specs = _specs(
        slot,
        publication,
        table,
        shards,
        more_tables=tuple(more_tables),
        plugin=plugin,
        aggregate_column=aggregate_column,
        failover=failover_slot,
    )
    spec = specs[0]

    def publishing() -> PollSettings:
        """The settings of a job that publishes rows before it makes the slot."""
        logs.configure()
        return PollSettings(**wire.settings(dsn, table, header_columns).shared(), table=table)

    if exactly_once and wire.kafka_bootstrap:
        # First, whatever the slot's way of being made: the topic does not depend on it.
        if dry_run:
            click.echo(f"-- the checkpoint topic {checkpoint_topic}, if it does not exist")
        elif ensure_topic(wire.producer(), checkpoint_topic, wire.kafka_timeout):
            click.echo(f"created checkpoint topic {checkpoint_topic} (cleanup.policy=compact)")
        else:
            click.echo(f"exists: checkpoint topic {checkpoint_topic}")
    if header_columns and republish_since is None:
        raise UsageError(
            "--header-column is for --republish-since, which publishes what stream would: give "
            "it there, or leave it out"
        )
    if accept_gap and (republish_since is not None or from_poller):
        raise UsageError(
            "--accept-gap skips what a lost slot had not relayed, --republish-since and "
            "--from-poller publish it: give one of them"
        )
    if republish_since is not None and more_tables:
        raise UsageError(
            "--republish-since publishes the rows of one outbox table again: not available for "
            "several yet; give --table once (a slot of several tables: see README, Several "
            "outbox tables on one slot)"
        )
    if republish_since is not None:
        if from_poller or failover_slot or shards is not None or dry_run or create_table:
            raise UsageError(
                "--republish-since makes one plain slot for one stream relay: leave out "
                "--from-poller, --failover, --shards, --dry-run and --create-table (set up "
                "failover or shards once it is made)"
            )
        if not wire.kafka_bootstrap:
            raise UsageError("--republish-since publishes rows again: give --kafka-bootstrap")
        settings = publishing()
        layout = OutboxLayout.from_options(columns, header_columns)
        for line in republish(settings, spec, republish_since, layout).lines:
            click.echo(line)
        return
    if from_poller and failover_slot:
        raise UsageError(
            "--from-poller creates the slot through the replication protocol: set it up, then "
            "run setup-slot --failover again, which reports how to make the slot fail over"
        )
    if from_poller and more_tables:
        raise UsageError(
            "--from-poller takes over from a poller, which relays one outbox table: give "
            "--table once"
        )
    if from_poller and shards is not None:
        raise UsageError(
            "--from-poller hands over to one stream relay: set it up without --shards, then "
            "reshard (cdc-relay reshard --from 1 --to N)"
        )
    if from_poller:
        if dry_run or not wire.kafka_bootstrap:
            raise UsageError(
                "--from-poller publishes the rows the poller left: give --kafka-bootstrap "
                "(and not --dry-run)"
            )
        settings = publishing()
        if create_table:
            raise UsageError(
                "--from-poller takes over from a poller, whose outbox table exists: drop "
                "--create-table"
            )
        for line in handover(settings, spec).lines:
            click.echo(line)
        return
    for each in specs:
        report = setup(
            dsn,
            each,
            dry_run=dry_run,
            create_table=create_table,
            gap="accept" if accept_gap else "refuse",
        )
        if dry_run:
            click.echo("-- preflight passed; setup-slot would run:")
            for statement in report.statements or ["-- nothing: everything exists"]:
                click.echo(statement)
        for line in report.existing:
            click.echo(f"exists: {line}")
        for line in report.done:
            click.echo(line)
    if failover_slot and not dry_run:
        # with --shards the settings' lines repeat for every slot: shown once
        findings = list(
            dict.fromkeys(finding for each in specs for finding in failover.check(dsn, each.slot))
        )
        for finding in findings:
            click.echo(str(finding))
        missing = sum(finding.level == "missing" for finding in findings)
        if missing:
            raise PreflightError(
                f"the slot would not survive a failover: {missing} setting"
                f"{'' if missing == 1 else 's'} above missing (each line says what to run)"
            )


@cli.group("schema")
def schema_group() -> None:
    """The SQL the relays expect in the database, as this version of cdc-relay ships it."""


@schema_group.command("show")
@click.argument("name", type=click.Choice(list(schema.SCHEMAS)))
def schema_show(name: str) -> None:
    """Print schema NAME: outbox, poller, consumer or roles (a psql script)."""
    click.echo(schema.text(name), nl=False)


@schema_group.command("apply")
@click.argument("name", type=click.Choice(list(schema.SCHEMAS)))
@_DSN
def schema_apply(name: str, dsn: str) -> None:
    """Apply schema NAME (outbox, poller or consumer) to the database, in one transaction.

    Idempotent: what exists is kept. outbox and poller are for the outbox's database, as
    the role that owns (or is to own) the table; consumer for a consumer's database. roles
    is a psql script: cdc-relay schema show roles | psql ... -f -
    """
    schema.applicable(name)
    with connect(dsn) as conn:
        schema.apply(conn, name)
        where = conn.info.dbname
    click.echo(f"applied schema {name} to database {where}: {schema.SCHEMAS[name]}")


@cli.command("trace")
@click.argument("event_id")
@database_options
@kafka_options(wire=False)
@_option(
    "--message-prefix",
    default="outbox",
    show_default=True,
    help="Prefix of pg_logical_emit_message() messages that carry events.",
)
@click.option(
    "--max-changes",
    type=click.IntRange(1),
    default=100_000,
    show_default=True,
    help="Changes the slot has not confirmed to read at most, looking for the event.",
)
@click.option(
    "--max-wal-bytes",
    type=click.IntRange(1),
    default=1_000_000_000,
    show_default=True,
    metavar="BYTES",
    help="WAL to decode at most from the slot's restart position, looking for the event "
    "(decoding reads other tables' changes too, on the server).",
)
@click.option(
    "--max-messages",
    type=click.IntRange(1),
    default=10_000,
    show_default=True,
    help="Messages to scan at most per partition, from the event's time on.",
)
@click.option(
    "--clock-skew",
    type=Seconds(0, 86400),
    default=60.0,
    show_default=True,
    help="Seconds to look back on Kafka before the event's time (clocks differ).",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object instead of lines.")
def trace_command(
    event_id: str,
    dsn: str,
    slot: str,
    publication: str,
    table: str,
    kafka_bootstrap: str,
    kafka_config: tuple[str, ...],
    kafka_config_file: Path | None,
    topic_template: str,
    kafka_timeout: float,
    message_prefix: str,
    max_changes: int,
    max_wal_bytes: int,
    max_messages: int,
    clock_skew: float,
    as_json: bool,
) -> None:
    """Say where event EVENT_ID is: its row, the slot, the poller, Kafka.

    The row (or that there is none), whether it committed, whether the slot's confirmed
    position has passed its commit (stream) or the poller marked it (poll), and the topic,
    partition and offset where it landed, found without reading whole topics. Exit 0 when it
    is on Kafka, 3 when not (yet), with the reason.
    """
    settings = TraceSettings(
        dsn=dsn,
        slot=slot,
        publication=publication,
        table=table,
        message_prefix=message_prefix,
        kafka={
            **kafka_settings(kafka_config, kafka_config_file),
            "bootstrap.servers": kafka_bootstrap,
        },
        topic_template=topic_template,
        kafka_timeout=kafka_timeout,
        max_changes=max_changes,
        max_wal_bytes=max_wal_bytes,
        max_messages=max_messages,
        clock_skew=clock_skew,
    )
    found = trace(settings, event_id)
    if as_json:
        click.echo(json.dumps(found.as_json()))
    else:
        for name, value in summary(found):
            click.echo(f"{name:<13} {value}")
        click.echo(found.answer)
    if not found.on_kafka:
        sys.exit(3)


@cli.command("drop-slot")
@database_options
@_SHARDS
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def drop_slot(
    dsn: str, slot: str, publication: str, table: str, shards: int | None, yes: bool
) -> None:
    """Remove the replication slot and the publication (of every shard, with --shards).

    Events committed since the slot's last confirmed position will not be relayed.
    """
    specs = _specs(slot, publication, table, shards)
    if not yes:
        names = ", ".join(spec.slot for spec in specs)
        click.confirm(
            f"Drop slot {names} and its publication? Unrelayed events are lost", abort=True
        )
    removed = [name for spec in specs for name in drop(dsn, spec)]
    click.echo("dropped " + ", ".join(removed) if removed else "nothing to drop")
    if any(name.startswith("slot ") for name in removed):
        click.echo(
            "what the slot was stays recorded (table cdc_relay_slots): setup-slot makes it anew "
            "only with --republish-since TIME, or --accept-gap to skip what it had not relayed"
        )


@cli.command("reshard")
@database_options
@click.option(
    "--from",
    "before",
    type=click.IntRange(1, MAX_SHARDS),
    required=True,
    help="The shard count the relays stream now; 1 for the slot without shards.",
)
@click.option(
    "--to",
    "after",
    type=click.IntRange(1, MAX_SHARDS),
    required=True,
    help="The shard count to go to.",
)
@_COLUMNS
def reshard_command(
    dsn: str,
    slot: str,
    publication: str,
    table: str,
    before: int,
    after: int,
    columns: tuple[str, ...],
) -> None:
    """Go from N shards to M while the application writes, at one cut in the WAL.

    Creates the M new shards' publications and slots, then writes the cut: every old relay
    delivers what was committed before it and stops at it (exit 0), every new relay (stream
    --shard K/M, started before or after) relays what comes after it. Nothing is lost, nothing
    is published twice. Then drop the old shards: drop-slot --shards N (or without --shards
    when N is 1).
    """
    if before == after:
        raise UsageError(f"--from and --to are both {before}: nothing to reshard")
    spec = SlotSpec(
        slot=slot,
        publication=publication,
        table=table,
        aggregate_column=OutboxLayout.from_options(columns, ()).aggregate_id,
    )
    for line in reshard(dsn, spec, before, after):
        click.echo(line)


@cli.command("status")
@database_options
@_SHARDS
@click.option("--json", "as_json", is_flag=True, help="One JSON object instead of a table.")
@click.option(
    "--max-wal-retained",
    type=int,
    metavar="BYTES",
    help="Exit 3 when the slot holds back more WAL than this.",
)
@click.option(
    "--max-unprocessed", type=int, metavar="N", help="Exit 3 above N unprocessed rows (poller)."
)
@click.option(
    "--max-unconfirmed",
    type=int,
    metavar="N",
    help="Exit 3 above N rows the slot has not confirmed (stream), or when it cannot tell.",
)
@click.option(
    "--max-dead-letters", type=int, metavar="N", help="Exit 3 above N dead letters (poller)."
)
@click.option("--require-active", is_flag=True, help="Exit 3 when no relay streams the slot.")
@click.option(
    "--wait",
    type=Seconds(0, 3600),
    default=5.0,
    show_default=True,
    help="Seconds to wait for the slot to confirm the WAL position status starts at, to tell "
    "confirmed rows from unconfirmed ones (stream).",
)
@_option(
    "--exactly-once",
    is_flag=True,
    help="The slot is streamed with --exactly-once: show the checkpoint its committed Kafka "
    "transactions reach (read_committed) beside the slot's position; needs --kafka-bootstrap.",
)
@_option(
    "--transactional-id",
    metavar="ID",
    help="The transactional id of --exactly-once.  [default: cdc-relay-SLOT]",
)
@_CHECKPOINT_TOPIC
@_messages(
    "The slot is streamed with --messages: alert when others than the writers "
    "(--message-writer) may emit logical decoding messages."
)
@_MESSAGE_WRITERS
@kafka_options(required=False, topics=False, wire=False)
def status_command(
    dsn: str,
    slot: str,
    publication: str,
    table: str,
    shards: int | None,
    as_json: bool,
    max_wal_retained: int | None,
    max_unprocessed: int | None,
    max_unconfirmed: int | None,
    max_dead_letters: int | None,
    require_active: bool,
    wait: float,
    exactly_once: bool,
    transactional_id: str | None,
    checkpoint_topic: str,
    messages: bool,
    message_writers: tuple[str, ...],
    kafka_bootstrap: str | None,
    kafka_config: tuple[str, ...],
    kafka_config_file: Path | None,
    kafka_timeout: float,
) -> None:
    """Show the slot and the outbox: active, confirmed LSN, WAL retained, pending rows.

    A stream outbox's rows are told apart: confirmed by the slot (on Kafka) or not yet. With
    --shards N, every shard's slot. With --exactly-once, the checkpoint in Kafka too. With
    --messages, who may emit logical decoding messages. With thresholds it is a check for
    scripts and cron: exit 3 when one is crossed.
    """
    kafka = None
    if exactly_once:
        if not kafka_bootstrap:
            raise UsageError("status --exactly-once reads the checkpoint: give --kafka-bootstrap")
        kafka = producer_config(kafka_bootstrap, kafka_settings(kafka_config, kafka_config_file))
    states, alerts = [], []
    for spec in _specs(slot, publication, table, shards):
        state = status(dsn, spec.slot, table, spec.publication, wait, spec.shard)
        if kafka is not None:
            eos = ExactlyOnce(transactional_id or eos_id(spec.slot), checkpoint_topic)
            state["checkpoint"] = checkpoint_status(kafka, eos, kafka_timeout).as_json()
        mine = []
        if not state["exists"]:
            mine.append(f"slot {spec.slot} does not exist")
        if state["slot_problem"]:
            mine.append(state["slot_problem"])
        if state["publication_problem"]:
            mine.append(state["publication_problem"])
        if state["lineage_problem"]:
            mine.append(state["lineage_problem"])
        if require_active and not state["active"]:
            mine.append(f"no relay is streaming slot {spec.slot}")
        if max_unconfirmed is not None and state["confirmed_rows_unknown"]:
            mine.append(f"cannot tell unconfirmed rows: {state['confirmed_rows_unknown']}")
        for key, limit, what in (
            (
                "wal_retained_bytes",
                max_wal_retained,
                "bytes of WAL retained" + ("" if shards is None else f" by {spec.slot}"),
            ),
            ("unprocessed_rows", max_unprocessed, "unprocessed rows"),
            ("unconfirmed_rows", max_unconfirmed, "unconfirmed rows"),
            ("dead_letters", max_dead_letters, "dead letters"),
        ):
            if limit is not None and (state[key] or 0) > limit:
                mine.append(f"{state[key]} {what} (limit {limit})")
        states.append((spec, state))
        alerts += [alert for alert in mine if alert not in alerts]
    if messages and (problem := writers_problem(dsn, message_writers)):
        alerts.append(problem)
    if as_json:
        found = [state for _, state in states]
        click.echo(
            json.dumps({**(found[0] if shards is None else {"shards": found}), "alerts": alerts})
        )
    else:
        for spec, state in states:
            if spec.shard is not None:
                click.echo(f"-- shard {spec.shard}")
            rows = [
                ("slot", spec.slot if state["exists"] else f"{spec.slot} (missing)"),
                ("WAL status", state["wal_status"] or "-"),
                ("active", f"yes (pid {state['active_pid']})" if state["active"] else "no"),
                ("plugin", state["plugin"] or "-"),
                ("confirmed LSN", state["confirmed_flush_lsn"] or "-"),
                *(
                    [("checkpoint", state["checkpoint"]["summary"])]
                    if "checkpoint" in state
                    else []
                ),
                ("WAL retained", _bytes(state["wal_retained_bytes"])),
                ("outbox table", state["table"]),
                ("publication", _publication(state)),
                ("lineage", _lineage(state["lineage"])),
            ]
            if state["slot_relays_table"]:
                unknown = state["confirmed_rows_unknown"]
                confirmed = f"- ({unknown})" if unknown else _count(state["confirmed_rows"])
                rows += [
                    ("confirmed rows", confirmed),
                    ("unconfirmed rows", _count(state["unconfirmed_rows"])),
                ]
            else:
                rows.append(("unprocessed rows", _count(state["unprocessed_rows"])))
            rows.append(("dead letters", _count(state["dead_letters"])))
            for name, value in rows:
                click.echo(f"{name:<17} {value}")
        for alert in alerts:
            click.echo(f"ALERT: {alert}", err=True)
    if alerts:
        sys.exit(3)


def _publication(state: dict[str, Any]) -> str:
    if not state["publication_exists"]:
        return f"{state['publication']} (missing)"
    if state["publication_problem"]:
        return f"{state['publication']} (does not cover the table)"
    return str(state["publication"])


def _lineage(found: dict[str, Any] | None) -> str:
    if found is None:
        return "-"
    return (
        f"made by {found['made']} at {found['created_lsn']}, "
        f"{found['created_at'][:19].replace('T', ' ')}; confirmed up to {found['confirmed_lsn']} "
        "at least"
    )


def _bytes(value: int | None) -> str:
    if value is None:
        return "-"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(value)


def _count(value: int | None) -> str:
    return "-" if value is None else str(value)


@cli.command("stream")
@several_tables_options
@relay_options
@_option(
    "--status-interval",
    type=Seconds(0.1, 3600),
    default=10.0,
    show_default=True,
    help="Seconds between standby status updates; keep well under wal_sender_timeout.",
)
@_COLUMNS
@_option(
    "--shard",
    callback=_shard,
    metavar="K/N",
    help="Stream shard K of N (0 <= K < N): slot SLOT_KofN and publication PUBLICATION_KofN, "
    "made by setup-slot --shards N; the events of every aggregate go through one shard.",
)
@_option(
    "--header-column",
    "header_columns",
    multiple=True,
    metavar="COLUMN",
    help="Send this column of the outbox table as a header of the same name; repeatable "
    "(not id, event_type or aggregate_type, which every message carries).",
)
@_option(
    "--message-prefix",
    default="outbox",
    show_default=True,
    help="Prefix of pg_logical_emit_message() messages that carry events.",
)
@_messages(
    "Relay logical decoding messages of --message-prefix as events; refuses to start while "
    "others than the writers (--message-writer) may emit them. Without it such a message "
    "stops the relay before it."
)
@_MESSAGE_WRITERS
@_option(
    "--ignore-messages",
    is_flag=True,
    help="Without --messages: pass logical decoding messages of --message-prefix over (each "
    "logged, and counted) instead of stopping at the first.",
)
@_option(
    "--dead-letter-topic",
    help="Keep events Kafka refuses for good (too large, not authorised, invalid for their "
    "topic) in table cdc_relay_dead_letters (cdc-relay schema outbox) and send them here, "
    "with the "
    "error in headers, and go on; without it the relay stops at such an event.",
)
@_option(
    "--ignore-other-tables",
    is_flag=True,
    help="Skip rows of tables other than the outbox that the publication publishes (each "
    "logged) instead of stopping at the first.",
)
@_option(
    "--exactly-once",
    is_flag=True,
    help="Publish in Kafka transactions, each with a checkpoint of how far it reaches, so that "
    "read_committed consumers see every event once, even after a crash or a takeover.",
)
@_option(
    "--transactional-id",
    metavar="ID",
    help="The Kafka transactional id of --exactly-once; a relay starting with it fences the "
    "one before.  [default: cdc-relay-SLOT]",
)
@_CHECKPOINT_TOPIC
@_option(
    "--transaction-interval",
    type=Seconds(0.001, 60),
    default=0.1,
    show_default=True,
    help="Seconds a Kafka transaction of --exactly-once stays open at most.",
)
@_option(
    "--standby",
    is_flag=True,
    help="When another relay streams the slot, wait and take over as soon as it stops or "
    "dies, instead of exiting.",
)
def stream(
    relay: RelayOptions,
    dsn: str,
    slot: str,
    publication: str,
    tables: tuple[str, ...],
    status_interval: float,
    columns: tuple[str, ...],
    shard: Shard | None,
    header_columns: tuple[str, ...],
    message_prefix: str,
    messages: bool,
    message_writers: tuple[str, ...],
    ignore_messages: bool,
    dead_letter_topic: str | None,
    ignore_other_tables: bool,
    exactly_once: bool,
    transactional_id: str | None,
    checkpoint_topic: str,
    transaction_interval: float,
    standby: bool,
) -> None:
    """Stream the slot to Kafka; confirm positions only after Kafka acknowledged them.

    Stops cleanly on SIGTERM or Ctrl-C: waits for acks, confirms, exits 0. With --table given
    more than once, relays every table's rows (each table's aggregates in commit order).
    """
    if len(tables) > 1 and relay.cloudevents_enabled and relay.cloudevents_source is None:
        raise UsageError(
            "--cloudevents names one outbox table in its default ce_source; with several "
            "--table give --cloudevents-source"
        )
    health = relay.start()
    slot = shard.name(slot) if shard else slot
    settings = StreamSettings(
        **relay.settings(dsn, tables[0], header_columns).shared(),
        slot=slot,
        publication=shard.name(publication) if shard else publication,
        tables=tables,
        status_interval=status_interval,
        layout=OutboxLayout.from_options(columns, header_columns),
        message_prefix=message_prefix,
        messages=Messages(messages, ignore_messages, message_writers),
        dead_letter_topic=dead_letter_topic,
        standby=standby,
        ignore_other_tables=ignore_other_tables,
        shard=shard,
        exactly_once=ExactlyOnce(
            transactional_id=transactional_id or eos_id(slot),
            checkpoint_topic=checkpoint_topic,
            interval=transaction_interval,
        )
        if exactly_once
        else None,
    )
    run_relay(StreamRelay(settings, health))


@cli.command("poll")
@outbox_options
@relay_options
@_option(
    "--workers",
    type=click.IntRange(1, 64),
    default=1,
    show_default=True,
    help="Claiming threads, each with its own connection and producer. One transaction at a "
    "time holds an aggregate, so any number of workers and processes keep its order.",
)
@_option(
    "--batch-size",
    type=click.IntRange(1, 100_000),
    default=500,
    show_default=True,
    help="Rows claimed, published and marked per transaction; each claim locks up to as "
    "many aggregates (PostgreSQL advisory locks).",
)
@_option(
    "--poll-interval",
    type=Seconds(0.05, 3600),
    default=5.0,
    show_default=True,
    help="Seconds between claims when no notification comes (the trigger of cdc-relay "
    "schema poller wakes the poller at once).",
)
@_option(
    "--max-attempts",
    type=click.IntRange(1, 1_000_000),
    default=10,
    show_default=True,
    help="Failed publishes after which a row becomes a dead letter (the last one its own: a "
    "row Kafka refused among others goes again alone first).",
)
@_option(
    "--backoff-base",
    type=Seconds(0.001, 86400),
    default=1.0,
    show_default=True,
    help="Seconds before a failed row is tried again; doubles with every attempt, jittered.",
)
@_option(
    "--backoff-max",
    type=Seconds(0.001, 86400),
    default=300.0,
    show_default=True,
    help="The longest wait between two tries of a row.",
)
def poll(
    relay: RelayOptions,
    dsn: str,
    table: str,
    workers: int,
    batch_size: int,
    poll_interval: float,
    max_attempts: int,
    backoff_base: float,
    backoff_max: float,
) -> None:
    """Publish the outbox by polling it: no replication slot needed.

    Claims batches, one aggregate per transaction at a time (so any number of pollers keep
    each aggregate's order), publishes them through the same router and producer as stream,
    marks them processed. Stops cleanly on SIGTERM or Ctrl-C: finishes or releases the
    current batches, exits 0.
    """
    health = relay.start()
    settings = PollSettings(
        **relay.settings(dsn, table).shared(),
        table=table,
        workers=workers,
        batch_size=batch_size,
        poll_interval=poll_interval,
        max_attempts=max_attempts,
        backoff_base=backoff_base,
        backoff_max=max(backoff_max, backoff_base),
    )
    run_relay(PollRelay(settings, health))


@cli.group("dead-letters")
def dead_letters_group() -> None:
    """Rows the poller gave up on: list them, or give them another try."""


@dead_letters_group.command("list")
@outbox_options
@click.option("--json", "as_json", is_flag=True, help="A JSON array instead of a table.")
@click.option(
    "--limit", type=click.IntRange(1), default=100, show_default=True, help="Oldest first."
)
def dead_letters_list(dsn: str, table: str, as_json: bool, limit: int) -> None:
    """List dead letters, oldest first, with their last error."""
    rows = dead_letters(dsn, table, limit)
    if as_json:
        click.echo(json.dumps(rows, default=str))
        return
    if not rows:
        click.echo("no dead letters")
        return
    header = ("id", "attempts", "created", "aggregate", "event type", "last error")
    lines = [
        (
            row["id"],
            str(row["attempts"]),
            row["created_at"].strftime("%Y-%m-%d %H:%M:%S"),
            f"{row['aggregate_type']}/{row['aggregate_id']}",
            row["event_type"],
            row["last_error"] or "",
        )
        for row in rows
    ]
    widths = [max(len(cells[i]) for cells in [header, *lines]) for i in range(len(header) - 1)]
    for cells in [header, *lines]:
        click.echo("  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=False)) + cells[-1])


@dead_letters_group.command("retry")
@outbox_options
@click.option("--id", "ids", multiple=True, metavar="UUID", help="A dead letter; repeatable.")
@click.option("--all", "retry_all", is_flag=True, help="Every dead letter.")
def dead_letters_retry(dsn: str, table: str, ids: tuple[str, ...], retry_all: bool) -> None:
    """Give dead letters another try: attempts start again from 0 and a poller takes them.

    Fix what Kafka refused first (e.g. raise the topic's max.message.bytes).
    """
    if retry_all == bool(ids):
        raise UsageError("name the dead letters with --id (repeatable), or pass --all")
    for value in ids:
        try:
            uuid.UUID(value)
        except ValueError:
            raise UsageError(f"--id {value!r} is not a UUID") from None
    queued = retry_dead_letters(dsn, table, ids or None)
    click.echo(f"queued {len(queued)} dead letter{'' if len(queued) == 1 else 's'} again")
    missing = sorted({str(uuid.UUID(v)) for v in ids} - set(queued))
    if missing:
        raise RelayError(
            f"not dead letters, left alone: {', '.join(missing)}; see cdc-relay dead-letters list"
        )


_AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_MAX_AGE = timedelta(days=36525)  # 100 years: past it an age is a typo, and timedelta overflows


def _age(ctx: click.Context, param: click.Parameter, value: str) -> timedelta:
    """An age such as 90s, 30m, 12h, 7d or 2w, from 0 to 100 years."""
    unit = _AGE_UNITS.get(value.strip()[-1:])
    try:
        seconds = float(value.strip()[:-1]) * (unit or math.nan)
    except ValueError:
        seconds = math.nan
    if not 0 <= seconds <= _MAX_AGE.total_seconds():  # NaN included
        raise click.BadParameter(
            f"{value!r} is not an age from 0s to 100 years ({_MAX_AGE.days}d); "
            "write it like 90s, 30m, 12h, 7d or 2w"
        )
    return timedelta(seconds=seconds)


@cli.command("prune")
@outbox_options
@_option(
    "--older-than",
    required=True,
    metavar="AGE",
    callback=_age,
    help="Delete rows processed (with --slot: created) longer ago than this: 90s, 30m, 12h, "
    "7d, 2w (at most 100 years).",
)
@click.option(
    "--slot",
    metavar="SLOT",
    envvar="CDC_RELAY_PRUNE_SLOT",
    show_envvar=True,
    help="For an outbox cdc-relay stream relays: the slot it reads. Rows go once the slot has "
    "confirmed their transaction, whatever their processed_at.",
)
@_option(
    "--publication",
    default=DEFAULT_PUBLICATION,
    show_default=True,
    help="With --slot (pgoutput): the publication cdc-relay stream reads, which must cover "
    "the table.",
)
@click.option(
    "--batch-size",
    type=click.IntRange(1),
    default=10_000,
    show_default=True,
    envvar="CDC_RELAY_PRUNE_BATCH_SIZE",
    show_envvar=True,
    help="Rows deleted per transaction.",
)
@click.option(
    "--wait",
    type=Seconds(0, 3600),
    default=30.0,
    show_default=True,
    envvar="CDC_RELAY_PRUNE_WAIT",
    show_envvar=True,
    help="With --slot: seconds to wait for the slot to confirm the WAL position the prune "
    "starts at; if it does not, nothing is deleted (exit 1).",
)
def prune_command(
    dsn: str,
    table: str,
    older_than: timedelta,
    slot: str | None,
    publication: str,
    batch_size: int,
    wait: float,
) -> None:
    """Delete old rows of the outbox whose events are on Kafka, in batches.

    Without --slot: rows the poller processed, oldest first; unprocessed rows and dead
    letters are never deleted. With --slot: rows whose transaction the slot has confirmed
    (README.md, "Pruning a stream outbox"); rows of transactions the slot has not confirmed,
    or still open, are never deleted.
    """
    if slot is None:
        pruned = prune_processed(dsn, table, older_than, batch_size)
        click.echo(
            f"pruned {pruned.deleted} processed row{'' if pruned.deleted == 1 else 's'} "
            f"(processed before {pruned.cutoff.isoformat(timespec='seconds')})"
        )
        return
    pruned = prune_confirmed(dsn, table, slot, publication, older_than, batch_size, wait)
    click.echo(
        f"pruned {pruned.deleted} confirmed row{'' if pruned.deleted == 1 else 's'} "
        f"(created before {pruned.cutoff.isoformat(timespec='seconds')}; slot {slot} "
        f"confirmed up to {format_lsn(pruned.confirmed or 0)})"
    )


def hide_passwords_from_the_process_list(argv: list[str]) -> None:
    """Rewrite the process title when ``argv`` carries a password, with ``***`` for it, and
    warn: every user of the host reads a command line in ps and /proc/PID/cmdline."""
    hidden, options = hide_passwords(argv)
    if hidden == argv:
        return
    title = " ".join(hidden)
    name = setproctitle.getthreadtitle()
    # setproctitle overwrites the memory of the original argv, which is what the kernel shows
    setproctitle.setproctitle(title)
    setproctitle.setthreadtitle(name)  # keep the short name (pgrep, top) it changed as well
    shown = "until start-up hid it" if setproctitle.getproctitle() == title else "all along"
    for option in options:
        click.echo(
            f"cdc-relay: warning: a password in {option} could be read in the process list "
            f"{shown}; give it through {SAFER_PLACES[option]} instead",
            err=True,
        )


def main() -> None:
    """Console entry point: user-facing errors become one line on stderr, not a traceback."""
    hide_passwords_from_the_process_list(sys.orig_argv)
    try:
        code = cli.main(prog_name="cdc-relay", standalone_mode=False)
    except RelayError as exc:
        click.echo(f"cdc-relay: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)
