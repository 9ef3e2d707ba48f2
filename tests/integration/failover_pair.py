"""A PostgreSQL primary and a physical standby set up for failover slots (17+): the standby
copies the primary's failover slots (sync_replication_slots), with the physical slot and the
settings that needs. For test_failover.py and test_failover_ready.py."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from cdc_relay.devstack.postgres import LocalPostgres

OUTBOX_SQL = Path(__file__).parents[2] / "sql" / "outbox.sql"
STANDBY = "standby1"  # the standby's physical slot and application_name
DATABASE = "outbox"


@dataclass
class Pair:
    primary: LocalPostgres
    standby: LocalPostgres

    @property
    def dsn(self) -> str:
        """Both hosts; libpq picks the one that accepts writes."""
        return (
            f"host=127.0.0.1,127.0.0.1 port={self.primary.port},{self.standby.port} "
            f"user=postgres dbname={DATABASE} target_session_attrs=read-write"
        )


def start_pair(base: Path, bindir: Path, primary_settings: dict[str, str]) -> Pair:
    """A primary, a database with the outbox, a standby; then ``primary_settings`` on the
    primary (a synchronous standby that does not exist yet would hold every commit)."""
    # commit timestamps tell which events the new primary committed
    primary = LocalPostgres(
        base / "primary", bindir=bindir, settings={"track_commit_timestamp": "on"}
    ).start()
    with psycopg.connect(primary.dsn, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {DATABASE}")
        conn.execute("SELECT pg_create_physical_replication_slot(%s)", [STANDBY])
    with psycopg.connect(primary.dsn_for(DATABASE), autocommit=True) as conn:
        conn.execute(OUTBOX_SQL.read_bytes())
    standby = LocalPostgres(
        base / "standby",
        standby_of=primary,
        settings={
            "primary_slot_name": STANDBY,
            "hot_standby_feedback": "on",
            "sync_replication_slots": "on",
            "track_commit_timestamp": "on",
            # slot synchronisation needs a database in primary_conninfo
            "primary_conninfo": make_conninfo(primary.dsn_for(DATABASE), application_name=STANDBY),
        },
    )
    standby.start()
    with psycopg.connect(primary.dsn, autocommit=True) as conn:
        for name, value in primary_settings.items():
            conn.execute(sql.SQL("ALTER SYSTEM SET {} = {}").format(sql.SQL(name), value))
        conn.execute("SELECT pg_reload_conf()")
    return Pair(primary, standby)


SYNCHRONOUS = {
    # COMMIT returns once the standby has flushed the commit: what the application was
    # told committed survives the primary's death (asynchronous replication would lose
    # the last commits, in PostgreSQL, before any relay sees them).
    "synchronous_standby_names": STANDBY,
    # the relay gets no change the standby has not received: the copy of the slot is
    # never behind what Kafka holds
    "synchronized_standby_slots": STANDBY,
}
"""The primary's settings for a synchronous standby that guards the relay's slot."""
