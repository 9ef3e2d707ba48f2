"""A slot lost without failover slots (PostgreSQL 15, or 17+ without the settings): gone after
a promotion, or dropped once PostgreSQL invalidated it. ``setup-slot --republish-since T`` makes
it anew at an exported snapshot and first publishes every row created since T committed in
that snapshot; ``stream`` takes everything committed after it. Writers run throughout: nothing
may fall between the two, and only events created at or after T may reach Kafka twice."""

from __future__ import annotations

import base64
import difflib
import json
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from relaytools import (
    Load,
    Received,
    RelayProcess,
    Writer,
    Written,
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


@dataclass
class Outcome:
    made: subprocess.CompletedProcess[str]  # setup-slot --republish-since
    since: datetime  # its TIME
    started: float  # time.monotonic() when it started
    written: list[Written]
    received: list[Received]


def republish_then_stream(
    dsn: str, bootstrap: str, names: Any, load: Load, relay: RelayProcess
) -> Outcome:
    """With the slot lost: T = the start of the oldest event Kafka lacks, less half a second
    (Kafka has events committed after ones it lacks: its partitions fill independently, so a
    relay that died had earlier events in flight); setup-slot --republish-since T; ``relay``
    streams for 2 s under ``load``; then stops, with everything written on Kafka."""
    had = {r.id for r in consume(bootstrap, names.topic_prefix, expected=1, settle=3)}
    lacked = created_at(dsn, [w.id for w in list(load.written) if w.id not in had])
    since = min(lacked.values()) - timedelta(seconds=0.5)
    newest = max(created_at(dsn, list(had)).values())
    print(f"T={since}, {newest - since} before the newest event Kafka had")
    assert since < newest, "T is before the newest event Kafka had"
    started = time.monotonic()
    made = republish(dsn, bootstrap, names, "--republish-since", since.isoformat())
    assert made.returncode == 0, made.stderr
    relay.start()
    time.sleep(2)
    written = load.stop()
    received = consume(bootstrap, names.topic_prefix, expected=len(written))
    assert relay.stop() == 0, relay.log()
    print(made.stdout)
    return Outcome(made, since, started, written, received)


def judge(dsn: str, names: Any, outcome: Outcome) -> set[str]:
    """Lost 0, as stored, first deliveries in order per aggregate, each event at most twice and
    twice only if created at or after T; the ids sent twice."""
    verdict = check(outcome.written, outcome.received, names.topic_prefix)
    counts = Counter(r.id for r in outcome.received)
    twice = {event_id for event_id, n in counts.items() if n > 1}
    moments = created_at(dsn, list(twice))
    print(f"{verdict}; sent twice: {len(twice)}; T={outcome.since}")
    lost = created_at(dsn, verdict.lost)
    assert verdict.lost == [], f"created from {min(lost.values())} to {max(lost.values())}"
    assert verdict.mismatched == []
    assert verdict.out_of_order == []
    assert max(counts.values()) <= 2
    assert all(moments[event_id] >= outcome.since for event_id in twice), "older than T"
    return twice


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
        outcome = republish_then_stream(outbox_db, bootstrap, names, load, after)
    finally:
        load.stop()
        relay.close()
        after.close()

    lines = outcome.made.stdout.splitlines()
    assert lines[0] == f"exists: publication {names.publication} on public.outbox_events"
    assert lines[1].startswith(f"created slot {names.slot} (pgoutput) at ")
    assert lines[2].startswith("published ")
    republished = int(lines[2].split()[1])
    twice = judge(outbox_db, names, outcome)
    # committed while no slot existed: on Kafka only through the republish, and once
    gap = {w.id for w in outcome.written if dropped < w.committed_at < outcome.started}
    print(f"republished={republished}; committed while the slot was gone: {len(gap)}")
    assert twice, "T was before events Kafka had: they go out again"
    assert republished >= len(twice)
    assert len(gap) > 50, "too few events were committed while the slot was gone"
    assert not gap & twice
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
        assert f"{bad!r} is neither an ISO 8601 moment with its zone" in refused.stderr
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


def test_the_republish_reproduces_the_golden_wire_contract(
    outbox_db: str, kafka_service: Any, names: Any
) -> None:
    """Every golden file's events, republished table by table with the options stream runs
    with there, are the golden messages byte for byte; all but event 37, created in 44 BC,
    before any TIME --republish-since takes (event 39, created_at NULL, goes out)."""
    import test_golden as g  # the scenario and the files, as every relay path reads them

    too_old = {event.id for event in g.CLOUDEVENTS.events if event.n == 37}
    goldens = list(g.GOLDEN_FILES)
    g.prepare_tables(outbox_db, goldens)
    g.create_topics(
        kafka_service.bootstrap,
        {
            f"{names.topic_prefix}.{json.loads(line)['topic']}"
            for x in goldens
            for line in x.lines()
        },
    )
    for golden in goldens:
        g.write_scenario(outbox_db, golden, as_messages=False)
    for n, table in enumerate(dict.fromkeys(golden.table for golden in goldens)):
        options = dict(next(x.options for x in goldens if x.table == table))
        made = republish(
            outbox_db,
            kafka_service.bootstrap,
            names,
            "--republish-since",
            "0001-01-01T00:00:00Z",
            slot=f"{names.slot}_{n}",
            publication=f"{names.publication}_{n}",
            table=table,
            topic_template=f"{names.topic_prefix}.{g.TOPIC_TEMPLATE}",
            tombstone_on_empty_payload="true",
            header_column=g.HEADER_COLUMNS,
            **options,
        )
        assert made.returncode == 0, made.stderr
    topics = g.Topics(kafka_service.bootstrap, names.topic_prefix)
    try:
        received = topics.read()
    finally:
        topics.close()

    owner = {event.id: golden for golden in goldens for event in golden.events}
    assert all(m.id in owner for m in received), [m.line() for m in received]
    problems = []
    for golden in goldens:
        messages = [m for m in received if owner[m.id or ""] is golden]
        expected = [
            line
            for line in golden.lines()
            if dict(json.loads(line)["headers"])["id"] not in too_old
        ]
        got = g.golden_lines(messages, golden)
        if got != expected:
            problems.append(
                f"{golden.name}:\n"
                + "\n".join(
                    d for d in difflib.ndiff(expected, got) if d.startswith(("- ", "+ ", "? "))
                )
            )
        problems += g.random_partition_order_problems(messages, golden)
    assert not problems, "\n\n".join(problems)
    assert len(received) == sum(len(golden.events) for golden in goldens) - len(too_old)


@pytest.fixture
def promotable(tmp_path: Path, pg18_bin: Path) -> Iterator[Any]:
    """A PostgreSQL 18 primary and a synchronous standby (test_failover.py's pair): what the
    application was told committed survives the primary's death."""
    import failover_pair as f

    pair = f.start_pair(tmp_path, pg18_bin, {"synchronous_standby_names": f.STANDBY})
    try:
        yield pair
    finally:
        pair.standby.cleanup(keep_logs=True)
        pair.primary.cleanup(keep_logs=True)


def test_after_a_real_promotion_without_failover_slots_the_republish_loses_nothing(
    tmp_path: Path, promotable: Any, kafka_service: Any, names: Any
) -> None:
    """The primary dies under load and its standby is promoted: the slot stayed behind and
    stream says so. setup-slot --republish-since on the new primary, then stream: every event
    the application was told committed is on Kafka, in order per aggregate."""
    pair, bootstrap = promotable, kafka_service.bootstrap
    primary = pair.primary.dsn_for("outbox")
    setup_slot(primary, names)  # not a failover slot
    first = RelayProcess(tmp_path, relay_env(pair.dsn, bootstrap, names), name="first")
    second = RelayProcess(tmp_path, relay_env(pair.dsn, bootstrap, names), name="second")
    load = Load(pair.dsn, writers=3, pause=0.002, reconnect=True).start()
    try:
        first.start()
        wait_slot(primary, names.slot, active=True)
        time.sleep(2)
        pair.primary.stop("immediate")
        pair.standby.promote()
        assert first.wait(120) == 1, first.log()
        assert "stayed behind; make it anew with cdc-relay setup-slot" in first.log()
        time.sleep(1)  # the application goes on writing on the new primary
        outcome = republish_then_stream(pair.dsn, bootstrap, names, load, second)
    finally:
        load.stop()
        first.close()
        second.close()
    judge(pair.dsn, names, outcome)
