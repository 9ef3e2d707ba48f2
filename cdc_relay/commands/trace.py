"""``cdc-relay trace``: where one event is (its row, the slot, the poller, Kafka), printed as
lines or one JSON object."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from cdc_relay.commands.kafka_options import kafka_options
from cdc_relay.commands.options import Seconds, database_options, env_option
from cdc_relay.config import kafka_settings
from cdc_relay.ops.trace import TraceSettings, summary, trace


@click.command("trace")
@click.argument("event_id")
@database_options
@kafka_options(wire=False)
@env_option(
    "--message-prefix",
    default="outbox",
    show_default=True,
    help="Prefix of pg_logical_emit_message() messages that carry events.",
)
@env_option(
    "--max-changes",
    type=click.IntRange(1),
    default=100_000,
    show_default=True,
    help="Changes the slot has not confirmed to read at most, looking for the event.",
)
@env_option(
    "--max-wal-bytes",
    type=click.IntRange(1),
    default=1_000_000_000,
    show_default=True,
    metavar="BYTES",
    help="WAL to decode at most from the slot's restart position, looking for the event "
    "(decoding reads other tables' changes too, on the server).",
)
@env_option(
    "--max-messages",
    type=click.IntRange(1),
    default=10_000,
    show_default=True,
    help="Messages to scan at most per partition, from the event's time on.",
)
@env_option(
    "--clock-skew",
    type=Seconds(0, 86400),
    default=60.0,
    show_default=True,
    help="Seconds to look back on Kafka before the event's time (clocks differ).",
)
@env_option("--json", "as_json", is_flag=True, help="One JSON object instead of lines.")
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
