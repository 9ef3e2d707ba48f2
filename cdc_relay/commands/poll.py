"""``cdc-relay poll``: relay the outbox to Kafka by polling it until stopped."""

from __future__ import annotations

import click

from cdc_relay.commands.kafka_options import RelayOptions, relay_options
from cdc_relay.commands.options import Seconds, env_option, outbox_options, trace_column_option
from cdc_relay.commands.relays import run_relay
from cdc_relay.events import check_trace_column
from cdc_relay.relay.poller import PollRelay
from cdc_relay.relay.worker import PollSettings


@click.command("poll")
@outbox_options
@relay_options
@env_option(
    "--workers",
    type=click.IntRange(1, 64),
    default=1,
    show_default=True,
    help="Claiming threads, each with its own connection and producer. One transaction at a "
    "time holds an aggregate, so any number of workers and processes keep its order.",
)
@env_option(
    "--batch-size",
    type=click.IntRange(1, 100_000),
    default=500,
    show_default=True,
    help="Rows claimed, published and marked per transaction; each claim locks up to as "
    "many aggregates (PostgreSQL advisory locks).",
)
@env_option(
    "--poll-interval",
    type=Seconds(0.05, 3600),
    default=5.0,
    show_default=True,
    help="Seconds between claims when no notification comes (the trigger of cdc-relay "
    "schema poller wakes the poller at once).",
)
@env_option(
    "--max-attempts",
    type=click.IntRange(1, 1_000_000),
    default=10,
    show_default=True,
    help="Failed publishes after which a row becomes a dead letter (the last one its own: a "
    "row Kafka refused among others goes again alone first).",
)
@env_option(
    "--backoff-base",
    type=Seconds(0.001, 86400),
    default=1.0,
    show_default=True,
    help="Seconds before a failed row is tried again; doubles with every attempt, jittered.",
)
@env_option(
    "--backoff-max",
    type=Seconds(0.001, 86400),
    default=300.0,
    show_default=True,
    help="The longest wait between two tries of a row.",
)
@trace_column_option()
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
    trace_column: str | None,
) -> None:
    """Publish the outbox by polling it: no replication slot needed.

    Claims batches, one aggregate per transaction at a time (so any number of pollers keep
    each aggregate's order), publishes them through the same router and producer as stream,
    marks them processed. Stops cleanly on SIGTERM or Ctrl-C: finishes or releases the
    current batches, exits 0.
    """
    check_trace_column(trace_column, ())
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
        trace_column=trace_column,
    )
    run_relay(PollRelay(settings, health))
