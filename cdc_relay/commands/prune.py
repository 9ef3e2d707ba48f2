"""``cdc-relay prune``: delete the outbox's old rows whose events are on Kafka, and say how
many."""

from __future__ import annotations

from datetime import timedelta

import click

from cdc_relay.commands.options import Seconds, age, env_option, outbox_options
from cdc_relay.config import DEFAULT_PUBLICATION
from cdc_relay.lsn import format_lsn
from cdc_relay.ops.prune import prune_confirmed, prune_processed


def _slot(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    # "" names no slot: a file shared with the stream may give slot = "" in [prune] for an
    # outbox the poller relays (a table cannot take a key of the top level away)
    return value or None


@click.command("prune")
@outbox_options
@env_option(
    "--older-than",
    required=True,
    metavar="AGE",
    callback=age,
    help="Delete rows processed (with --slot: created) longer ago than this: 90s, 30m, 12h, "
    "7d, 2w (at most 100 years).",
)
@env_option(
    "--slot",
    metavar="SLOT",
    deprecated_envvar="CDC_RELAY_PRUNE_SLOT",
    callback=_slot,
    help="For an outbox cdc-relay stream relays: the slot it reads. Rows go once the slot has "
    "confirmed their transaction, whatever their processed_at. CDC_RELAY_SLOT and a slot in "
    "the config file count too: where they are the stream's but the outbox is polled, give "
    'slot = "" in [prune] (processed rows).',
)
@env_option(
    "--publication",
    default=DEFAULT_PUBLICATION,
    show_default=True,
    help="With --slot (pgoutput): the publication cdc-relay stream reads, which must cover "
    "the table.",
)
@env_option(
    "--batch-size",
    type=click.IntRange(1),
    default=10_000,
    show_default=True,
    deprecated_envvar="CDC_RELAY_PRUNE_BATCH_SIZE",
    help="Rows deleted per transaction.",
)
@env_option(
    "--wait",
    type=Seconds(0, 3600),
    default=30.0,
    show_default=True,
    deprecated_envvar="CDC_RELAY_PRUNE_WAIT",
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
    (docs/operations.md, "Pruning a stream outbox"); rows of transactions the slot has not
    confirmed, or still open, are never deleted.
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
