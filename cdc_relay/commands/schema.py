"""``cdc-relay schema``: show the SQL this version ships, or apply it to a database."""

from __future__ import annotations

import click

from cdc_relay import schema
from cdc_relay.commands.options import DSN
from cdc_relay.postgres.connection import connect


@click.group("schema")
def schema_group() -> None:
    """The SQL the relays expect in the database, as this version of cdc-relay ships it."""


@schema_group.command("show")
@click.argument("name", type=click.Choice(list(schema.SCHEMAS)))
def schema_show(name: str) -> None:
    """Print schema NAME: outbox, poller, consumer or roles (a psql script)."""
    click.echo(schema.text(name), nl=False)


@schema_group.command("apply")
@click.argument("name", type=click.Choice(list(schema.SCHEMAS)))
@DSN
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
