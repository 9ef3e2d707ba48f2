"""``cdc-relay setup-slot``: check the database, create the publication and the slot (of every
shard), or make a lost slot anew, or take over from a poller; it prints what it did."""

from __future__ import annotations

from datetime import datetime, timedelta

import click
from click.core import ParameterSource

from cdc_relay import logs
from cdc_relay.commands.kafka_options import CHECKPOINT_TOPIC, WireOptions, wire_options
from cdc_relay.commands.options import (
    COLUMNS,
    MESSAGE_WRITERS,
    SHARDS,
    Seconds,
    env_option,
    messages_option,
    several_tables_options,
    since,
    slot_specs,
    trace_column_option,
)
from cdc_relay.errors import PreflightError, UsageError
from cdc_relay.events import OutboxLayout, check_trace_column
from cdc_relay.kafka.checkpoints import ensure_topic
from cdc_relay.kafka.topics import ensure
from cdc_relay.ops.handover import handover, republish
from cdc_relay.postgres import failover
from cdc_relay.postgres.failover_ready import wait_ready
from cdc_relay.postgres.messages import writers_problem
from cdc_relay.postgres.slot import setup
from cdc_relay.relay.worker import PollSettings

COMMANDLINE = ParameterSource.COMMANDLINE


@click.command("setup-slot")
@several_tables_options
@env_option(
    "--plugin",
    type=click.Choice(["pgoutput", "wal2json"]),
    default="pgoutput",
    show_default=True,
    help="Logical decoding plugin of the slot.",
)
@SHARDS
@COLUMNS
@env_option("--dry-run", is_flag=True, help="Check the database and print the SQL; change nothing.")
@env_option(
    "--from-poller",
    is_flag=True,
    help="Take over from cdc-relay poll (stopped first): create the slot with an exported "
    "snapshot and publish the rows still unprocessed in it; stream takes the rest.",
)
@env_option(
    "--republish-since",
    metavar="TIME",
    callback=since,
    help="Make a lost slot anew (gone after a promotion, or dropped once invalidated): create "
    "it with an exported snapshot and first publish, with the Kafka options, every row created "
    "since TIME (ISO 8601 with a zone, or an age: 30m, 2h, 7d) committed in it; stream takes "
    "the rest.",
)
@env_option(
    "--accept-gap",
    is_flag=True,
    help="Make a slot that existed and is gone anew at the WAL's position now, skipping what "
    "it had not confirmed (said with the span), or record a publication changed since its relay "
    "verified it as it is; --republish-since loses nothing instead.",
)
@env_option(
    "--header-column",
    "header_columns",
    multiple=True,
    metavar="COLUMN",
    help="With --republish-since: send this column as a header, as stream does; repeatable. "
    "Stream's, from its variable or the config file, serves only then; the flag without "
    "--republish-since is refused.",
)
@trace_column_option(
    "With --republish-since or --from-poller (ignored otherwise, so that one setting serves "
    "the relay and its set-up), as stream and poll do. "
)
@env_option(
    "--create-table",
    is_flag=True,
    help="Create the outbox table (cdc-relay schema show outbox) when it is missing; the "
    "role of --dsn then owns it. --table must then name an outbox_events table.",
)
@env_option(
    "--failover",
    "failover_slot",
    is_flag=True,
    help="Create a failover slot (PostgreSQL 17+), which standbys keep a copy of, and check "
    "the settings that needs on every host of --dsn.",
)
@env_option(
    "--wait-failover-ready",
    type=Seconds(0, 3600),
    metavar="SECONDS",
    help="With --failover: wait up to SECONDS for a standby among the hosts of --dsn to hold "
    "a usable copy of the slot (synchronised, persistent), and exit 1 if none does by then.",
)
@env_option(
    "--exactly-once",
    is_flag=True,
    help="For stream --exactly-once: create the checkpoint topic (compacted) if it does not "
    "exist; needs --kafka-bootstrap.",
)
@CHECKPOINT_TOPIC
@env_option(
    "--dead-letter-topic",
    help="With --create-topics: create stream --dead-letter-topic's topic if it does not "
    "exist, as the --topic-* options say.",
)
@messages_option(
    "For stream --messages: check that only the writers (--message-writer) may emit logical "
    "decoding messages, as stream does at start."
)
@MESSAGE_WRITERS
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
    trace_column: str | None,
    create_table: bool,
    failover_slot: bool,
    wait_failover_ready: float | None,
    exactly_once: bool,
    checkpoint_topic: str,
    dead_letter_topic: str | None,
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
    more than once, one publication holds every table. With --create-topics, the
    dead-letter topic too, and the topics of the events --republish-since or --from-poller
    publish.
    """
    check_trace_column(trace_column, header_columns)
    if exactly_once and not wire.kafka_bootstrap:
        raise UsageError("--exactly-once creates the checkpoint topic: give --kafka-bootstrap")
    if wait_failover_ready is not None and (not failover_slot or dry_run):
        raise UsageError(
            "--wait-failover-ready waits for a standby's copy of a failover slot: give it with "
            "--failover (and not --dry-run)"
        )
    creation = wire.topic_creation(dead_letter_topic)
    if creation is not None and not wire.kafka_bootstrap:
        raise UsageError("--create-topics creates topics in Kafka: give --kafka-bootstrap")
    if messages and (problem := writers_problem(dsn, message_writers)):
        raise PreflightError(problem)
    aggregate_column = OutboxLayout.from_options(columns, ()).aggregate_id
    table, *more_tables = tables
    specs = slot_specs(
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
        return PollSettings(
            **wire.settings(dsn, table, header_columns, dead_letter_topic).shared(),
            table=table,
            trace_column=trace_column,
        )

    if exactly_once and wire.kafka_bootstrap:
        # First, whatever the slot's way of being made: the topic does not depend on it.
        if dry_run:
            click.echo(f"-- the checkpoint topic {checkpoint_topic}, if it does not exist")
        elif ensure_topic(wire.producer(), checkpoint_topic, wire.kafka_timeout, creation):
            click.echo(f"created checkpoint topic {checkpoint_topic} (cleanup.policy=compact)")
        else:
            click.echo(f"exists: checkpoint topic {checkpoint_topic}")
    if creation is not None and dead_letter_topic:
        if dry_run:
            click.echo(
                f"-- the dead-letter topic {dead_letter_topic}, if it does not exist "
                f"({creation.describe(dead_letter_topic)})"
            )
        elif ensure(wire.producer(), dead_letter_topic, creation, wire.kafka_timeout):
            click.echo(
                f"created dead-letter topic {dead_letter_topic} "
                f"({creation.describe(dead_letter_topic)})"
            )
        else:
            click.echo(f"exists: dead-letter topic {dead_letter_topic}")
    if header_columns and republish_since is None:
        # Given in the environment or the config file, it is the one stream reads, shared with
        # this command (one ConfigMap for both): it serves a republish, and nothing else here.
        if click.get_current_context().get_parameter_source("header_columns") is COMMANDLINE:
            raise UsageError(
                "--header-column is for --republish-since, which publishes what stream would: "
                "give it there, or leave it out"
            )
    if accept_gap and (republish_since is not None or from_poller):
        raise UsageError(
            "--accept-gap skips what a lost slot had not relayed, --republish-since and "
            "--from-poller publish it: give one of them"
        )
    if republish_since is not None and more_tables:
        raise UsageError(
            "--republish-since publishes the rows of one outbox table again: not available for "
            "several yet; give --table once (a slot of several tables: see docs/outbox.md, "
            '"Several outbox tables on one slot")'
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
        layout = OutboxLayout.from_options(columns, header_columns, trace_column)
        settings = publishing()
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
        if wait_failover_ready is None:
            click.echo(
                "failover: a standby's copy is usable once synchronised and persistent; "
                "cdc-relay status shows it, and status --require-failover-ready exits 0 from "
                "then on (3 until then)"
            )
        else:
            for each in specs:
                found = wait_ready(dsn, each.slot, wait_failover_ready)
                if not found.ready:
                    raise PreflightError(
                        f"after {wait_failover_ready:g} s, {found.reason} "
                        "(cdc-relay status --require-failover-ready tells when one does)"
                    )
                usable = ", ".join(copy.standby for copy in found.copies if copy.usable)
                click.echo(f"failover: ready: {usable} holds a usable copy of slot {each.slot}")
