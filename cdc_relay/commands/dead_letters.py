"""``cdc-relay dead-letters``: list the rows the poller gave up on (a table or JSON), or queue
them again."""

from __future__ import annotations

import json
import uuid

import click

from cdc_relay.commands.options import env_option, outbox_options
from cdc_relay.errors import RelayError, UsageError
from cdc_relay.kafka.deadletter import dead_letters, retry_dead_letters


@click.group("dead-letters")
def dead_letters_group() -> None:
    """Rows the poller gave up on: list them, or give them another try."""


@dead_letters_group.command("list")
@outbox_options
@env_option("--json", "as_json", is_flag=True, help="A JSON array instead of a table.")
@env_option("--limit", type=click.IntRange(1), default=100, show_default=True, help="Oldest first.")
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
            row["event_type"] or "-",  # NULL where the table allows it (its last error says)
            row["last_error"] or "",
        )
        for row in rows
    ]
    widths = [max(len(cells[i]) for cells in [header, *lines]) for i in range(len(header) - 1)]
    for cells in [header, *lines]:
        click.echo("  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=False)) + cells[-1])


@dead_letters_group.command("retry")
@outbox_options
@env_option("--id", "ids", multiple=True, metavar="UUID", help="A dead letter; repeatable.")
@env_option("--all", "retry_all", is_flag=True, help="Every dead letter.")
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
