"""A slot lost without failover slots (PostgreSQL 15, or 17+ without the settings): gone after
a promotion, or dropped once PostgreSQL invalidated it. ``setup-slot --republish-since T`` makes
it anew at an exported snapshot and first publishes every row created since T committed in
that snapshot; ``stream`` takes everything committed after it. Writers run throughout: nothing
may fall between the two, and only events created at or after T may reach Kafka twice."""

from __future__ import annotations

import base64
import random
import subprocess
import sys
import time
from collections import Counter
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from relaytools import (
    Load,
    RelayProcess,
    Writer,
    check,
    consume,
    create_topics,
    relay_env,
    setup_slot,
    wait_slot,
)

pytestmark = pytest.mark.integration


def republish(
    dsn: str, kafka: str, names: Any, *options: str, **env: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cdc_relay", "setup-slot", *options],
        env=relay_env(dsn, kafka, names, **env),
        capture_output=True,
        text=True,
        timeout=120,
    )


def slots(dsn: str) -> list[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT slot_name::text FROM pg_replication_slots "
            "WHERE database = current_database() ORDER BY 1"
        ).fetchall()
    return [name for (name,) in rows]


def drop_slot(dsn: str, slot: str) -> None:
    """What a promotion without failover slots leaves: no slot (the publication stays)."""
    wait_slot(dsn, slot, active=False)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_drop_replication_slot(%s)", [slot])


def created_at(dsn: str, ids: list[str]) -> dict[str, datetime]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT id::text, created_at FROM outbox_events WHERE id = ANY(%s::uuid[])", [ids]
        ).fetchall()
    return dict(rows)


@pytest.mark.pg18
def test_a_lost_slot_made_anew_with_republish_since_loses_nothing_under_load(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    bootstrap = kafka_service.bootstrap
    setup_slot(outbox_db, names)
    relay = RelayProcess(tmp_path, relay_env(outbox_db, bootstrap, names))
    after = RelayProcess(tmp_path, relay_env(outbox_db, bootstrap, names), name="after")
    load = Load(outbox_db, writers=3, pause=0.002).start()
    try:
        relay.start()
        wait_slot(outbox_db, names.slot, active=True)
        time.sleep(2)
        relay.kill()  # the primary dies under it
        drop_slot(outbox_db, names.slot)  # the promoted standby has no slot
        dropped = time.monotonic()
        time.sleep(1)  # commits that no slot will ever decode

        # T: the newest event Kafka had, less a margin for transactions open across it
        had = consume(bootstrap, names.topic_prefix, expected=1, settle=3)
        assert had, relay.log()
        newest = max(created_at(outbox_db, [r.id for r in had]).values())
        since = newest - timedelta(seconds=1)
        started = time.monotonic()
        made = republish(outbox_db, bootstrap, names, "--republish-since", since.isoformat())
        assert made.returncode == 0, made.stderr
        after.start()
        time.sleep(2)
        written = load.stop()
        received = consume(bootstrap, names.topic_prefix, expected=len(written))
        assert after.stop() == 0, after.log()
    finally:
        load.stop()
        relay.close()
        after.close()

    print(made.stdout)
    lines = made.stdout.splitlines()
    assert lines[0] == f"exists: publication {names.publication} on public.outbox_events"
    assert lines[1].startswith(f"created slot {names.slot} (pgoutput) at ")
    assert lines[2].startswith("published ")
    republished = int(lines[2].split()[1])
    verdict = check(written, received, names.topic_prefix)
    counts = Counter(r.id for r in received)
    twice = [event_id for event_id, n in counts.items() if n > 1]
    moments = created_at(outbox_db, list(counts))
    # committed while no slot existed: on Kafka only through the republish, and once
    gap = {w.id for w in written if dropped < w.committed_at < started}
    print(
        f"{verdict}; republished={republished}; sent twice: {len(twice)}; committed while "
        f"the slot was gone: {len(gap)}; T={since}"
    )
    assert verdict.lost == []
    assert verdict.mismatched == []
    assert verdict.out_of_order == []
    assert max(counts.values()) <= 2
    assert all(moments[event_id] >= since for event_id in twice), "a duplicate older than T"
    assert twice, "T was before events Kafka had: they go out again"
    assert republished >= len(twice)
    assert len(gap) > 50, "too few events were committed while the slot was gone"
    assert not gap & set(twice)
    assert slots(outbox_db) == [names.slot]


def test_republish_refuses_an_existing_slot_a_bad_time_and_a_broker_away(
    outbox_db: str, kafka_service: Any, names: Any
) -> None:
    setup_slot(outbox_db, names)
    exists = republish(outbox_db, kafka_service.bootstrap, names, "--republish-since", "2h")
    assert exists.returncode == 1, exists.stdout + exists.stderr
    assert exists.stderr.strip().splitlines() == [
        f"cdc-relay: error: slot {names.slot} exists already, so it cannot start where the "
        "republish ends; if it was lost (invalidated), drop it first (cdc-relay drop-slot), or "
        "choose another --slot"
    ], exists.stderr

    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute("SELECT pg_drop_replication_slot(%s)", [names.slot])
    for bad in ("yesterday", "2026-01-05T09:00:00", "-2h", ""):
        refused = republish(outbox_db, kafka_service.bootstrap, names, "--republish-since", bad)
        assert refused.returncode == 2, refused.stderr
        assert f"--republish-since {bad!r} is neither an ISO 8601 moment" in refused.stderr
    future = (datetime.now().astimezone() + timedelta(days=1)).isoformat()
    refused = republish(outbox_db, kafka_service.bootstrap, names, "--republish-since", future)
    assert refused.returncode == 1
    assert "is in the future" in refused.stderr, refused.stderr

    away = republish(outbox_db, "127.0.0.1:1", names, "--republish-since", "2h", kafka_timeout="2")
    assert away.returncode == 1, away.stderr
    assert away.stderr.strip().splitlines()[-1].startswith("cdc-relay: error: "), away.stderr
    assert "Traceback" not in away.stderr
    assert slots(outbox_db) == []


def test_a_refused_event_undoes_the_republish_and_says_what_went_out(
    outbox_db: str, kafka_service: Any, names: Any
) -> None:
    writer = Writer(outbox_db)
    try:
        writer.transaction([("order", f"o{n}", {"n": n}) for n in range(5)])
        # over the topic's limit, compressed or not
        writer.transaction(
            [("blob", "b1", {"x": base64.b64encode(random.randbytes(120_000)).decode()})]
        )
    finally:
        writer.close()
    create_topics(
        kafka_service.bootstrap,
        {
            f"{names.topic_prefix}.order": {},
            f"{names.topic_prefix}.blob": {"max.message.bytes": "100000"},
        },
    )
    refused = republish(outbox_db, kafka_service.bootstrap, names, "--republish-since", "1h")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith("cdc-relay: error: Kafka refused event "), refused.stderr
    assert last.endswith(
        "; the republish was undone (no slot was created; 5 events were published): fix the "
        "cause and run it again"
    ), last
    assert slots(outbox_db) == []
    received = consume(kafka_service.bootstrap, names.topic_prefix, expected=5, timeout=30)
    assert sorted(r.key for r in received) == [f"o{n}".encode() for n in range(5)]


def test_a_stream_outbox_with_other_column_names_is_republished_as_stream_sends_it(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    """No poller columns, and --column maps the fields: the republished rows and the streamed
    ones are the same messages."""
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE stream_outbox (event_id uuid PRIMARY KEY, "
            "seq bigint GENERATED ALWAYS AS IDENTITY, aggregatetype text NOT NULL, "
            "aggregateid text NOT NULL, type text NOT NULL, body bytea, "
            "created_at timestamptz NOT NULL DEFAULT now())"
        )
    insert = (
        "INSERT INTO stream_outbox (event_id, aggregatetype, aggregateid, type, body, created_at)"
        " VALUES (gen_random_uuid(), %s, %s, %s, %s, %s)"
    )
    rows = [("order", "o1", "order.created", b"\x00\xff first"), ("order", "o1", "order.paid", b"")]
    old = ("order", "o0", "order.ancient", b"too old to go again")
    with psycopg.connect(outbox_db) as conn:
        conn.execute(insert, [*old, datetime.now().astimezone() - timedelta(days=2)])
        for row in rows:
            conn.execute(insert, [*row, datetime.now().astimezone()])
    columns = ("id=event_id", "aggregate_type=aggregatetype", "aggregate_id=aggregateid",
               "event_type=type", "payload=body")  # fmt: skip
    options = [f"--column={c}" for c in columns]
    env = {"table": "stream_outbox", "tombstone_on_empty_payload": "true"}
    made = republish(
        outbox_db, kafka_service.bootstrap, names, "--republish-since", "1d", *options, **env
    )
    assert made.returncode == 0, made.stderr
    assert "published 2 events created since " in made.stdout, made.stdout
    stream = RelayProcess(
        tmp_path,
        relay_env(outbox_db, kafka_service.bootstrap, names, **env, column=" ".join(columns)),
    ).start()
    try:
        wait_slot(outbox_db, names.slot, active=True)
        with psycopg.connect(outbox_db) as conn:
            for row in rows:
                conn.execute(insert, [*row, datetime.now().astimezone()])
        received = consume(kafka_service.bootstrap, names.topic_prefix, expected=4, timeout=60)
        assert stream.stop() == 0, stream.log()
    finally:
        stream.close()
    assert len(received) == 4, received
    republished, streamed = received[:2], received[2:]

    def wire(r: Any) -> tuple[Any, ...]:
        headers = tuple((k, v) for k, v in r.headers if k != "id")
        return r.topic, r.partition, r.key, r.value, headers

    assert [wire(r) for r in republished] == [wire(r) for r in streamed]
    assert [r.value for r in republished] == [b"\x00\xff first", None]
    assert [dict(r.headers)["event_type"] for r in received] == [
        b"order.created",
        b"order.paid",
    ] * 2
