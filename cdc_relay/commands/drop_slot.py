"""``cdc-relay drop-slot``: remove the slot and the publication (of every shard), once asked."""

from __future__ import annotations

import click

from cdc_relay.commands.options import SHARDS, database_options, env_option, slot_specs
from cdc_relay.postgres.slot import drop


@click.command("drop-slot")
@database_options
@SHARDS
@env_option("--yes", is_flag=True, help="Do not ask for confirmation.")
def drop_slot(
    dsn: str, slot: str, publication: str, table: str, shards: int | None, yes: bool
) -> None:
    """Remove the replication slot and the publication (of every shard, with --shards).

    Events committed since the slot's last confirmed position will not be relayed.
    """
    specs = slot_specs(slot, publication, table, shards)
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
