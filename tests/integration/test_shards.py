"""Sharded streaming: one outbox over N relays, each with its own slot, and resharding at
one cut, against a real PostgreSQL and a real Kafka broker (ARCHITECTURE.md, "Shards and
resharding")."""

from __future__ import annotations

import random
import secrets
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row
from relaytools import (
    Load,
    RelayProcess,
    Writer,
    Written,
    check,
    consume,
    create_topics,
    relay_env,
    set_topic_config,
    wait_until,
    writers_only,
)

from cdc_relay.lsn import parse as parse_lsn
from cdc_relay.postgres.reshard import prepare_reshard, write_cut
from cdc_relay.postgres.shards import Shard, hashtext
from cdc_relay.postgres.slot import SlotSpec, setup

pytestmark = pytest.mark.integration


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cdc_relay", *args], capture_output=True, text=True, timeout=180
    )


def shard_relay(tmp_path: Path, dsn: str, kafka: Any, names: Any, shard: str, **extra: str) -> Any:
    env = relay_env(dsn, kafka.bootstrap, names, shard=shard, **extra)
    return RelayProcess(tmp_path, env, name="shard-" + shard.replace("/", "of"))


def emit(dsn: str, events: list[tuple[str, str]]) -> list[Written]:
    """Events written as logical decoding messages (outbox_emit), which publications do not
    filter: each shard must keep its own."""
    written = []
    with psycopg.connect(dsn) as conn:
        for aggregate_type, aggregate_id in events:
            event_id = str(uuid.uuid4())
            payload = {"emitted": aggregate_id}
            with conn.transaction():
                conn.execute(
                    "SELECT outbox_emit(%s, %s, %s, %s::jsonb, %s::uuid)",
                    (
                        aggregate_type,
                        aggregate_id,
                        f"{aggregate_type}.changed",
                        psycopg.types.json.Jsonb(payload),
                        event_id,
                    ),
                )
            ((text, lsn),) = conn.execute(
                "SELECT %s::jsonb::text, pg_current_wal_lsn()::text",
                (psycopg.types.json.Jsonb(payload),),
            ).fetchall()
            conn.commit()
            written.append(
                Written(
                    id=event_id,
                    aggregate_type=aggregate_type,
                    aggregate_id=aggregate_id,
                    event_type=f"{aggregate_type}.changed",
                    payload=text.encode(),
                    after_commit_lsn=parse_lsn(lsn),
                    committed_at=time.monotonic(),
                )
            )
    return written


def test_python_and_postgresql_hash_100000_keys_alike(outbox_db: str) -> None:
    """The shard of a logical decoding message is computed in Python, that of a row by the
    publication's row filter: both must agree on every key, non-ASCII ones included."""
    rnd = random.Random(20261130)
    alphabets = [(0x20, 0x7E), (0xA0, 0x2FF), (0x370, 0x3FF), (0x4E00, 0x9FFF), (0x1F300, 0x1F64F)]
    keys = ["", "0", "order-1", str(uuid.UUID(int=rnd.getrandbits(128)))]
    while len(keys) < 100_000:
        low, high = rnd.choice(alphabets)
        keys.append("".join(chr(rnd.randint(low, high)) for _ in range(rnd.randint(1, 40))))
    with psycopg.connect(outbox_db) as conn:
        theirs = [
            row[0]
            for row in conn.execute(
                "SELECT hashtext(k) FROM unnest(%s::text[]) WITH ORDINALITY AS u(k, n) ORDER BY n",
                (keys,),
            )
        ]
    ours = [hashtext(key.encode()) for key in keys]
    differ = [(k, t, o) for k, t, o in zip(keys, theirs, ours, strict=True) if t != o]
    assert differ == []
    # and the shards: the row filter's expression, evaluated by PostgreSQL, against owns()
    sample: list[str | None] = [*keys[:10_000], None]
    with psycopg.connect(outbox_db) as conn:
        sql_shards = [
            row[0]
            for row in conn.execute(
                "SELECT (hashtext(coalesce(k, '')) & 2147483647) %% 7 "
                "FROM unnest(%s::text[]) WITH ORDINALITY AS u(k, n) ORDER BY n",
                (sample,),
            )
        ]
    for key, shard in zip(sample, sql_shards, strict=True):
        assert Shard(shard, 7).owns(key)


def test_two_shards_split_the_outbox_by_aggregate_each_in_order(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    setup = cli(
        "setup-slot",
        "--dsn",
        outbox_db,
        "--slot",
        names.slot,
        "--publication",
        names.publication,
        "--shards",
        "2",
    )
    assert setup.returncode == 0, setup.stderr
    assert f"created slot {names.slot}_0of2" in setup.stdout
    assert f"created publication {names.publication}_1of2" in setup.stdout
    again = cli(
        "setup-slot",
        "--dsn",
        outbox_db,
        "--slot",
        names.slot,
        "--publication",
        names.publication,
        "--shards",
        "2",
    )
    assert again.returncode == 0, again.stderr
    assert f"exists: slot {names.slot}_1of2" in again.stdout

    prefixes = [f"{names.topic_prefix}_s{k}" for k in range(2)]
    writers_only(outbox_db)  # stream --messages, once only writers may emit messages
    relays = [
        shard_relay(
            tmp_path,
            outbox_db,
            kafka_service,
            names,
            f"{k}/2",
            topic_template=f"{prefixes[k]}.{{aggregate_type}}",
            messages="true",
        ).start()
        for k in range(2)
    ]
    try:
        load = Load(outbox_db, writers=3, pause=0.001, aggregates=40).start()
        emitted = emit(outbox_db, [("invoice", f"m{i}") for i in range(60)])
        time.sleep(2)
        written = load.stop() + emitted
        # Each shard's topics hold exactly the events of its aggregates, in order, once.
        for k, prefix in enumerate(prefixes):
            mine = [w for w in written if Shard(k, 2).owns(w.aggregate_id)]
            received = consume(kafka_service.bootstrap, prefix, expected=len(mine))
            verdict = check(mine, received, prefix)
            print(f"shard {k}/2:", verdict)
            assert 0 < len(mine) < len(written)
            assert {w.id for w in emitted} & {w.id for w in mine}  # messages too
            assert verdict.lost == []
            assert verdict.duplicates == 0
            assert verdict.out_of_order == []
            assert verdict.mismatched == []  # an event of the other shard would be here
        assert [relay.stop() for relay in relays] == [0, 0]
    finally:
        for relay in relays:
            relay.close()

    status = cli(
        "status",
        "--dsn",
        outbox_db,
        "--slot",
        names.slot,
        "--publication",
        names.publication,
        "--shards",
        "2",
    )
    assert status.returncode == 0, status.stderr
    assert f"{names.slot}_0of2" in status.stdout and f"{names.slot}_1of2" in status.stdout


def test_a_shard_refuses_a_publication_that_filters_other_rows(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    assert (
        cli(
            "setup-slot",
            "--dsn",
            outbox_db,
            "--slot",
            names.slot,
            "--publication",
            names.publication,
            "--shards",
            "2",
        ).returncode
        == 0
    )
    # Someone points shard 1's publication at shard 0's rows: its relay must not start.
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute(
            f"ALTER PUBLICATION {names.publication}_1of2 SET TABLE outbox_events "
            "WHERE (((hashtext(COALESCE(aggregate_id, ''::text)) & 2147483647) % 2) = 0)"
        )
    relay = shard_relay(tmp_path, outbox_db, kafka_service, names, "1/2").start()
    try:
        assert relay.wait(60) == 1
    finally:
        relay.close()
    (line,) = [x for x in relay.log().splitlines() if "cdc-relay: error" in x]
    assert f"publication {names.publication}_1of2 does not publish the rows of shard 1/2" in line


def test_prune_refuses_a_shards_slot_which_confirms_its_own_rows_only(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    # Shard 0's slot passes the rows of shard 1 without relaying them: pruning by it would
    # delete rows whose events shard 1 has not relayed (its relay is not even running here).
    base = ["--dsn", outbox_db, "--slot", names.slot, "--publication", names.publication]
    assert cli("setup-slot", *base, "--shards", "2").returncode == 0
    written = Load(outbox_db, writers=1, pause=0.001, aggregates=20).start()
    time.sleep(0.5)
    events = written.stop()
    assert {Shard(0, 2).owns(w.aggregate_id) for w in events} == {True, False}
    relay = shard_relay(tmp_path, outbox_db, kafka_service, names, "0/2").start()
    try:
        mine = [w for w in events if Shard(0, 2).owns(w.aggregate_id)]
        assert len(consume(kafka_service.bootstrap, names.topic_prefix, len(mine))) == len(mine)
        time.sleep(1.1)  # every row older than --older-than
        pruned = cli(
            "prune",
            "--dsn",
            outbox_db,
            "--slot",
            f"{names.slot}_0of2",
            "--publication",
            f"{names.publication}_0of2",
            "--older-than",
            "1s",
        )
    finally:
        relay.close()
    assert pruned.returncode == 1, pruned
    assert "publishes only the rows of public.outbox_events where" in pruned.stderr, pruned
    with psycopg.connect(outbox_db) as conn:
        assert conn.execute("SELECT count(*) FROM outbox_events").fetchone() == (len(events),)


def test_reshard_from_two_to_three_under_writes_loses_nothing_and_duplicates_nothing(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    base = ["--dsn", outbox_db, "--slot", names.slot, "--publication", names.publication]
    assert cli("setup-slot", *base, "--shards", "2").returncode == 0
    writers_only(outbox_db)  # stream --messages, once only writers may emit messages
    old = [
        shard_relay(tmp_path, outbox_db, kafka_service, names, f"{k}/2", messages="true").start()
        for k in range(2)
    ]
    new = [
        shard_relay(tmp_path, outbox_db, kafka_service, names, f"{k}/3", messages="true")
        for k in range(3)
    ]
    try:
        load = Load(outbox_db, writers=3, pause=0.001, aggregates=40).start()
        emitted = emit(outbox_db, [("invoice", f"before{i}") for i in range(30)])
        time.sleep(2)
        wait_until(
            lambda: all("streaming slot" in relay.log() for relay in old), 60, "the old relays"
        )
        # One old relay is frozen at the cut, with a backlog before it: no new relay may relay
        # past the cut until it has delivered that backlog (its aggregates' order).
        old[1].signal(signal.SIGSTOP)
        time.sleep(1)
        resharded = cli("reshard", *base, "--from", "2", "--to", "3")
        assert resharded.returncode == 0, resharded.stderr
        print(resharded.stdout)
        assert "wrote resharding cut" in resharded.stdout
        new[0].start()  # one new relay at once, the others a little later
        emitted += emit(outbox_db, [("invoice", f"after{i}") for i in range(30)])
        time.sleep(1)
        new[1].start()
        new[2].start()
        assert old[0].wait(60) == 0  # stopped by itself at the cut
        wait_until(
            lambda: all("waiting for the relays of" in relay.log() for relay in new),
            60,
            "the new relays to wait for the old one",
        )
        assert all("passed resharding cut" not in relay.log() for relay in new)
        time.sleep(1)
        old[1].signal(signal.SIGCONT)
        assert old[1].wait(60) == 0
        for relay in old:
            assert "reached resharding cut" in relay.log()
        wait_until(
            lambda: all("passed resharding cut" in relay.log() for relay in new),
            60,
            "the new relays to pass the cut",
        )
        # One restarted stops there again, publishing nothing twice.
        old[0].start()
        assert old[0].wait(60) == 0
        time.sleep(2)
        written = load.stop() + emitted
        received = consume(kafka_service.bootstrap, names.topic_prefix, expected=len(written))
        assert [relay.stop() for relay in new] == [0, 0, 0]
    finally:
        load.stop()
        for relay in old + new:
            relay.close()
    verdict = check(written, received, names.topic_prefix)
    print(verdict)
    assert verdict.lost == []
    assert verdict.duplicates == 0
    assert verdict.out_of_order == []
    assert verdict.mismatched == []
    dropped = cli("drop-slot", *base, "--shards", "2", "--yes")
    assert dropped.returncode == 0, dropped.stderr
    assert f"{names.slot}_1of2" in dropped.stdout
    wait_until(lambda: cli("status", *base, "--shards", "3").returncode == 0, 30, "the new shards")


def test_reshard_from_a_generation_a_reshard_has_left_is_refused(
    outbox_db: str, names: Any
) -> None:
    """Once the relays stream the shards of a reshard, a cut naming the slots they left would
    stop none of them: both generations would relay what follows it."""
    base = ["--dsn", outbox_db, "--slot", names.slot, "--publication", names.publication]
    assert cli("setup-slot", *base).returncode == 0
    first = cli("reshard", *base, "--from", "1", "--to", "2")
    assert first.returncode == 0, first.stderr
    # The slot without shards is still there (dropped once its relay stopped at the cut).
    again = cli("reshard", *base, "--from", "1", "--to", "3")
    output = (again.stdout + again.stderr).strip()
    assert again.returncode == 1, output
    assert len(output.splitlines()) == 1, output
    assert f"{names.slot}_0of2" in output and "--from 2" in output, output
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        made = conn.execute(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE %s",
            [f"{names.slot}_%of3"],
        ).fetchone()
    assert made == (0,)
    # From the generation the relays stream, it goes on; back to one shard, that one is the
    # generation --from 1 names from then on, not the slot without shards.
    assert cli("reshard", *base, "--from", "2", "--to", "1").returncode == 0
    last = cli("reshard", *base, "--from", "1", "--to", "3")
    assert last.returncode == 0, last.stderr
    assert f"the relays of {names.slot}_0of1 stop at it" in last.stdout, last.stdout
    assert "drop-slot --shards 1 --yes" in last.stdout, last.stdout


def test_shard_mistakes_are_one_line_errors(outbox_db: str, names: Any) -> None:
    base = ["--dsn", outbox_db, "--slot", names.slot, "--publication", names.publication]

    def error(*args: str) -> str:
        done = cli(*args)
        assert done.returncode in (1, 2), done
        (line,) = done.stderr.strip().splitlines()[-1:]
        return line

    assert "shards need the pgoutput plugin" in error(
        "setup-slot", *base, "--shards", "2", "--plugin", "wal2json"
    )
    assert "K/N" in error("stream", *base, "--kafka-bootstrap", "127.0.0.1:9", "--shard", "2/2")
    assert "nothing to reshard" in error("reshard", *base, "--from", "2", "--to", "2")
    assert f"slot {names.slot}_0of3 does not exist" in error(
        "reshard", *base, "--from", "3", "--to", "2"
    )
    assert cli("setup-slot", *base, "--shards", "2").returncode == 0
    assert cli("reshard", *base, "--from", "2", "--to", "4").returncode == 0
    # a second reshard to the same count finds the shards of the first, and says it is done
    again = error("reshard", *base, "--from", "2", "--to", "4")
    assert "this reshard is done" in again and "do not drop them" in again
    assert cli("drop-slot", *base, "--shards", "2", "--yes").returncode == 0
    assert cli("drop-slot", *base, "--shards", "4", "--yes").returncode == 0


def test_a_transaction_committed_between_the_cut_message_and_its_commit_is_before_the_cut(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    """The cut's place among the transactions is its commit. Held open after its message (as
    a slow COMMENT or a network pause would), the cut transaction has B's event and A's event
    a2 commit before it; a2 is too large for its topic, so the old relay delivers B's, is
    refused a2 and stops with exit 1. Its slot is then confirmed past the cut message (B's
    transaction) but not past the cut's commit: the new shards must wait, or A's a3 after the
    cut overtakes a2 (before: both passed the cut, and Kafka held a1, a3 and never a2)."""
    prefix = names.topic_prefix
    big = f"{prefix}.big"
    create_topics(kafka_service.bootstrap, {big: {"max.message.bytes": "2000"}})
    spec = SlotSpec(slot=names.slot, publication=names.publication, table="outbox_events")
    setup(outbox_db, spec)
    old = RelayProcess(tmp_path, relay_env(outbox_db, kafka_service.bootstrap, names), "old")
    new = [shard_relay(tmp_path, outbox_db, kafka_service, names, f"{k}/2") for k in range(2)]
    writer = Writer(outbox_db)
    try:
        old.start()
        writer.transaction([("big", "A", {"n": 1})])
        plan = prepare_reshard(outbox_db, spec, 1, 2)
        for relay in new:
            relay.start()
        with psycopg.connect(outbox_db, row_factory=dict_row) as cut:
            write_cut(cut, plan)
            writer.transaction([("small", "B", {"n": 1})])
            # Random hex: the producer compresses, and "x" * 5000 would fit after all.
            writer.transaction([("big", "A", {"n": 2, "pad": secrets.token_hex(4000)})])
            cut.commit()
        writer.transaction([("big", "A", {"n": 3})])
        assert old.wait(90) == 1, old.log()[-2000:]
        assert "Kafka refused event" in old.log()
        wait_until(
            lambda: all("waiting for the relays of" in relay.log() for relay in new),
            60,
            "the new relays to wait at the cut",
        )
        time.sleep(3)
        assert all("passed resharding cut" not in relay.log() for relay in new)
        set_topic_config(kafka_service.bootstrap, big, "max.message.bytes", "1000000")
        old.start()
        assert old.wait(90) == 0, old.log()[-2000:]
        assert "reached resharding cut" in old.log()
        received = consume(kafka_service.bootstrap, prefix, expected=4, timeout=90)
        assert [relay.stop() for relay in new] == [0, 0]
    finally:
        writer.close()
        for relay in [old, *new]:
            relay.close()
    verdict = check(writer.written, received, prefix)
    print(verdict)
    assert verdict.lost == []
    assert verdict.duplicates == 0
    assert verdict.out_of_order == []
    assert all("passed resharding cut" in relay.log() for relay in new)


@pytest.mark.parametrize("takeover", ["past the cut", "before the cut"])
def test_a_standby_of_a_new_shard_taking_over_relays_everything(
    tmp_path: Path, outbox_db: str, kafka_service: Any, names: Any, takeover: str
) -> None:
    """A standby of new shard 0/2, started before the cut was written, decided at start that
    its slot had not passed the cut. ``past the cut``: the active relay passes the cut,
    relays and confirms, and is killed; the standby takes over a slot past the cut, which it
    never sees again: deciding from the position read before it held the slot, it would skip
    every event for ever. ``before the cut``: the active relay is killed while it waits at
    the cut for the old relay, which is frozen; the standby waits there in turn."""
    base = ["--dsn", outbox_db, "--slot", names.slot, "--publication", names.publication]
    assert cli("setup-slot", *base).returncode == 0
    old = RelayProcess(tmp_path, relay_env(outbox_db, kafka_service.bootstrap, names), "old")
    writer = Writer(outbox_db)
    active = shard_relay(tmp_path, outbox_db, kafka_service, names, "0/2")
    standby = shard_relay(tmp_path, outbox_db, kafka_service, names, "0/2", standby="true")
    standby.name = "standby"
    other = shard_relay(tmp_path, outbox_db, kafka_service, names, "1/2")
    try:
        old.start()
        for i in range(10):
            writer.transaction([("order", f"a{i}", {"before": i})])
        plan = prepare_reshard(
            outbox_db, SlotSpec(names.slot, names.publication, "outbox_events"), 1, 2
        )
        active.start()
        wait_until(lambda: "starts after resharding cut" in active.log(), 60, "the active relay")
        standby.start()
        other.start()
        wait_until(lambda: "standing by" in standby.log(), 60, "the standby to stand by")
        if takeover == "before the cut":
            old.signal(signal.SIGSTOP)
        with psycopg.connect(outbox_db, row_factory=dict_row) as cut:
            write_cut(cut, plan)
        for i in range(10):
            writer.transaction([("order", f"a{i}", {"after": i})])
        if takeover == "past the cut":
            wait_until(lambda: "passed resharding cut" in active.log(), 60, "the cut passed")
            time.sleep(2)  # it relays and confirms past the cut
        else:
            wait_until(lambda: "waiting for the relays of" in active.log(), 60, "the cut")
        active.kill()
        wait_until(lambda: "streaming slot" in standby.log(), 60, "the standby to take over")
        if takeover == "before the cut":
            old.signal(signal.SIGCONT)
        for i in range(10):
            writer.transaction([("order", f"a{i}", {"later": i})])
        received = consume(kafka_service.bootstrap, names.topic_prefix, expected=30, timeout=90)
        assert old.wait(60) == 0
        assert standby.stop() == 0
        assert other.stop() == 0
    finally:
        writer.close()
        for relay in [old, active, standby, other]:
            relay.close()
    verdict = check(writer.written, received, names.topic_prefix)
    print(verdict)
    assert verdict.lost == []
    assert verdict.out_of_order == []
    assert "passed resharding cut" in standby.log() or takeover == "past the cut"
