"""``cdc-relay stream``: relay the slot (or one shard's) to Kafka until stopped."""

from __future__ import annotations

import click

from cdc_relay.commands.kafka_options import CHECKPOINT_TOPIC, RelayOptions, relay_options
from cdc_relay.commands.options import (
    COLUMNS,
    MESSAGE_WRITERS,
    Seconds,
    env_option,
    messages_option,
    several_tables_options,
    trace_column_option,
)
from cdc_relay.commands.relays import run_relay
from cdc_relay.errors import UsageError
from cdc_relay.events import OutboxLayout
from cdc_relay.kafka.exactly_once import ExactlyOnce
from cdc_relay.kafka.exactly_once import transactional_id as eos_id
from cdc_relay.postgres.messages import Messages
from cdc_relay.postgres.shards import Shard
from cdc_relay.relay.stream import StreamRelay
from cdc_relay.relay.stream_settings import StreamSettings


def _shard(ctx: click.Context, param: click.Parameter, value: str | None) -> Shard | None:
    return None if value is None else Shard.parse(value)


@click.command("stream")
@several_tables_options
@relay_options
@env_option(
    "--status-interval",
    type=Seconds(0.1, 3600),
    default=10.0,
    show_default=True,
    help="Seconds between standby status updates; keep well under wal_sender_timeout.",
)
@COLUMNS
@env_option(
    "--shard",
    callback=_shard,
    metavar="K/N",
    help="Stream shard K of N (0 <= K < N): slot SLOT_KofN and publication PUBLICATION_KofN, "
    "made by setup-slot --shards N; the events of every aggregate go through one shard.",
)
@env_option(
    "--header-column",
    "header_columns",
    multiple=True,
    metavar="COLUMN",
    help="Send this column of the outbox table as a header of the same name; repeatable "
    "(not id, event_type or aggregate_type, which every message carries).",
)
@trace_column_option()
@env_option(
    "--message-prefix",
    default="outbox",
    show_default=True,
    help="Prefix of pg_logical_emit_message() messages that carry events.",
)
@messages_option(
    "Relay logical decoding messages of --message-prefix as events; refuses to start while "
    "others than the writers (--message-writer) may emit them. Without it such a message "
    "stops the relay before it."
)
@MESSAGE_WRITERS
@env_option(
    "--ignore-messages",
    is_flag=True,
    help="Without --messages: pass logical decoding messages of --message-prefix over (each "
    "logged, and counted) instead of stopping at the first.",
)
@env_option(
    "--dead-letter-topic",
    help="Keep events Kafka refuses for good (too large, not authorised, invalid for their "
    "topic) in table cdc_relay_dead_letters (cdc-relay schema outbox) and send them here, "
    "with the "
    "error in headers, and go on; without it the relay stops at such an event.",
)
@env_option(
    "--ignore-other-tables",
    is_flag=True,
    help="Skip rows of tables other than the outbox that the publication publishes (each "
    "logged) instead of stopping at the first.",
)
@env_option(
    "--exactly-once",
    is_flag=True,
    help="Publish in Kafka transactions, each with a checkpoint of how far it reaches, so that "
    "read_committed consumers see every event once, even after a crash or a takeover.",
)
@env_option(
    "--transactional-id",
    metavar="ID",
    help="The Kafka transactional id of --exactly-once; a relay starting with it fences the "
    "one before.  [default: cdc-relay-SLOT]",
)
@CHECKPOINT_TOPIC
@env_option(
    "--transaction-interval",
    type=Seconds(0.001, 60),
    default=0.1,
    show_default=True,
    help="Seconds a Kafka transaction of --exactly-once stays open at most; a quarter of it "
    "once the relay has read all the server sent; while it drains a backlog, up to 0.5 s "
    "(a tenth of transaction.timeout.ms if less, this if longer) and 50,000 events.",
)
@env_option(
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
    trace_column: str | None,
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
        **relay.settings(dsn, tables[0], header_columns, dead_letter_topic).shared(),
        slot=slot,
        publication=shard.name(publication) if shard else publication,
        tables=tables,
        status_interval=status_interval,
        layout=OutboxLayout.from_options(columns, header_columns, trace_column),
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
