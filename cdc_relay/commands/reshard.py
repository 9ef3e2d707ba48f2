"""``cdc-relay reshard``: go from N shards to M at one cut in the WAL."""

from __future__ import annotations

import click

from cdc_relay.commands.options import COLUMNS, database_options, env_option
from cdc_relay.errors import UsageError
from cdc_relay.events import OutboxLayout
from cdc_relay.postgres.reshard import reshard
from cdc_relay.postgres.shards import MAX_SHARDS
from cdc_relay.postgres.slot import SlotSpec


@click.command("reshard")
@database_options
@env_option(
    "--from",
    "before",
    type=click.IntRange(1, MAX_SHARDS),
    required=True,
    help="The shard count the relays stream now; 1 for the slot without shards.",
)
@env_option(
    "--to",
    "after",
    type=click.IntRange(1, MAX_SHARDS),
    required=True,
    help="The shard count to go to.",
)
@COLUMNS
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
