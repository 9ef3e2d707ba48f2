"""``cdc-relay prune``: old rows go once their events are on Kafka, and never before."""

from __future__ import annotations

import subprocess
import sys
import uuid

import psycopg
import pytest

pytestmark = pytest.mark.integration


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cdc_relay", *args], capture_output=True, text=True, timeout=120
    )


# -- partitions ---------------------------------------------------------------------------------

PARTITIONED = """
CREATE TABLE outbox_parts (LIKE outbox_events INCLUDING DEFAULTS INCLUDING IDENTITY)
    PARTITION BY RANGE (created_at);
CREATE TABLE outbox_parts_old PARTITION OF outbox_parts
    FOR VALUES FROM ('2000-01-01') TO ('2020-01-01');
CREATE TABLE outbox_parts_new PARTITION OF outbox_parts
    FOR VALUES FROM ('2020-01-01') TO ('2100-01-01');
"""

INSERT_PART = (
    "INSERT INTO outbox_parts (id, aggregate_type, aggregate_id, event_type, payload, "
    "created_at, processed_at) VALUES (%s, 'order', 'p', 'order.changed', '{}', %s, %s) "
    "RETURNING ctid::text"
)


def test_prune_of_a_partitioned_outbox_keeps_the_rows_of_other_partitions_at_the_same_ctid(
    outbox_db: str,
) -> None:
    """A ctid names a row of one partition; a DELETE by ctid on the partitioned table reaches
    the row at that ctid in every partition. An unprocessed row there stays."""
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute(PARTITIONED)
        old, new = str(uuid.uuid4()), str(uuid.uuid4())
        # The old row processed long ago, the new one not processed.
        at_old = conn.execute(INSERT_PART, (old, "2010-01-01", "2010-01-02")).fetchone()
        at_new = conn.execute(INSERT_PART, (new, "2030-01-01", None)).fetchone()
        assert at_old == at_new == ("(0,1)",)
    pruned = cli("prune", "--dsn", outbox_db, "--table", "outbox_parts", "--older-than", "7d")
    assert pruned.returncode == 0, pruned.stderr
    assert pruned.stdout.startswith("pruned 1 processed row "), pruned.stdout
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        assert conn.execute("SELECT id::text FROM outbox_parts").fetchall() == [(new,)]
