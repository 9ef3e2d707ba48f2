"""``StreamRelay.run`` as a standby, on the loop's in-memory stages (test_stream_loop,
test_stream_loop_eos): what it decides at start from the server, and again once it holds the
slot (``_held``), while the server changed under it.

``run`` reads the database besides the stream: its checks at start (``_check_database``:
here only what they note of the server, its timeline and the slot's position), the slot once
held (``_held``), the watcher. ``Server`` answers those from the ``Wal``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from test_stream_loop import BACKLOG, Wal, record_id
from test_stream_loop_eos import Kafka, Killed, Transactions

from cdc_relay.events import Insert
from cdc_relay.kafka.exactly_once import ExactlyOnce
from cdc_relay.lsn import format_lsn
from cdc_relay.postgres import pgoutput
from cdc_relay.postgres.tables import OutboxTable
from cdc_relay.queries import QUERIES
from cdc_relay.relay import cut, preflight, standby, stream
from cdc_relay.relay.stream import StreamRelay
from cdc_relay.relay.stream_settings import StreamSettings


class Rows:
    def __init__(self, row: dict[str, Any] | None) -> None:
        self.row = row

    def fetchone(self) -> dict[str, Any] | None:
        return self.row


class Server:
    """The database as ``run`` reads it besides the stream, from ``wal``: the server's
    timeline and the slot's confirmed position."""

    def __init__(self, wal: Wal) -> None:
        self.wal = wal

    def execute(self, query: str, params: dict[str, Any] | None = None) -> Rows:
        wal = self.wal
        if query == QUERIES["slot"]:
            return Rows({"slot_name": "test", "confirmed_flush_lsn": format_lsn(wal.confirmed)})
        if query == QUERIES["timeline"]:
            return Rows({"timeline": wal.timeline or None})
        if query == QUERIES["publication_comment"]:
            return Rows({"comment": None})
        raise AssertionError(f"unexpected query: {query}")

    @contextmanager
    def connect(self, dsn: str) -> Iterator[Server]:
        yield self

    def check_database(self, relay: StreamRelay) -> tuple[tuple[OutboxTable, ...], str, str]:
        """What ``_check_database`` notes of the server: its timeline, the slot's position."""
        wal = self.wal
        relay._timeline.note(wal.timeline)
        relay._slot_confirmed = wal.confirmed
        return wal.tables, format_lsn(wal.confirmed), "pgoutput"


class NoWatcher:
    """The watcher, with nothing to report: every table published whole, always."""

    problem = None
    shutting_down = False
    verified = 1 << 62

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def start(self) -> NoWatcher:
        return self

    def stop(self) -> None:
        pass

    def check_now(self, timeout: float = 5.0) -> None:
        pass


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Callable[[Wal], Server]:
    """``run`` on the in-memory server of a ``Wal``."""
    monkeypatch.setattr(stream, "_TICK", 0.0)
    monkeypatch.setattr(standby, "_STANDBY_RETRY", 0.01)
    monkeypatch.setattr(stream, "Watcher", NoWatcher)

    def on(wal: Wal) -> Server:
        answers = Server(wal)
        for module in (cut, preflight):
            monkeypatch.setattr(module, "connect", answers.connect)
        monkeypatch.setattr(standby, "reconnecting", answers.connect)
        monkeypatch.setattr(StreamRelay, "_check_database", lambda r: answers.check_database(r))
        return answers

    return on


def eos_relay(wal: Wal, kafka: Kafka, standby: bool = False) -> tuple[StreamRelay, Transactions]:
    """An exactly-once relay on ``wal`` and ``kafka``, 50 events per Kafka transaction."""
    sinks: list[Transactions] = []

    def open_transactions(on_ack: Any, on_refused: Any) -> Transactions:
        sinks.append(Transactions(kafka, on_ack, on_refused))
        return sinks[0]

    relay = StreamRelay(
        StreamSettings(
            dsn="test",
            slot="test",
            publication="test",
            tables=("public.outbox_events",),
            kafka_config={},
            topic_template="outbox.{aggregate_type}",
            status_interval=0.01,
            shutdown_timeout=0.05,
            progress_interval=3600.0,
            standby=standby,
            exactly_once=ExactlyOnce("test", interval=3600.0, max_events=50),
        ),
        open_source=wal.open,
        open_transactions=open_transactions,
        checkpoints=kafka,
        read_timeline=lambda dsn, slot: (wal.timeline, wal.confirmed),
    )
    return relay, sinks[0]


def new_primarys_own(raw: list[bytes], from_unit: int) -> list[bytes]:
    """The backlog as the promoted standby's WAL: the same up to transaction ``from_unit``
    (what it had received), then transactions of its own at the same positions (the old
    primary's, which it never received, are gone): each insert's event id replaced by
    another of the same length."""
    out, units = [], 0
    for data in raw:
        record = pgoutput.decode(data)
        if units >= from_unit and isinstance(record, Insert):
            old = record.values[0]
            assert isinstance(old, bytes)
            new = str(uuid.uuid5(uuid.NAMESPACE_OID, old.decode())).encode()
            assert len(new) == len(old) and data.count(old) == 1
            data = data.replace(old, new)
        if data[:1] == b"C":
            units += 1
        out.append(data)
    return out


def test_an_exactly_once_standby_that_takes_over_on_a_promoted_server_skips_none_of_its_wal(
    server: Callable[[Wal], Server],
) -> None:
    """Relay A streams the primary (timeline 1) with exactly once; its standby S started
    then, and noted timeline 1. The standby server, behind the primary by 40 transactions
    (asynchronous replication), is promoted (timeline 2) while A dies with the primary; its
    copy of the failover slot is at the 5th transaction. S takes the slot there. A's
    checkpoint (timeline 1) reaches the 30th transaction of the old primary's WAL; past the
    10th, the new primary's WAL is its own, which no relay has read.

    Checkpoint.trusted_on trusts a checkpoint of another timeline only up to the slot; but S
    compares it with the timeline it noted before it stood by (_held reads the slot's
    position again, not the timeline): 1 = 1, so it trusts it whole and skips the new
    primary's own transactions 11 to 30 (200 events), which no consumer ever sees, and the
    slot moves past them."""
    raw = [bytes.fromhex(json.loads(line)["hex"]) for line in BACKLOG.read_text().splitlines()]
    wal = Wal(raw)
    wal.timeline = 1
    server(wal)
    kafka = Kafka()

    active, sink = eos_relay(wal, kafka)
    sink.on_commit = lambda: sink.commits == 6 and sink.kill()  # 300 events: 30 transactions
    with pytest.raises(Killed):
        active.run()
    assert kafka.checkpoint.timeline == 1
    # Past the 10th transaction, where the standby's WAL will end.
    assert kafka.checkpoint.position.lsn > wal.units[10][0]

    promoted = Wal(new_primarys_own(raw, 10))
    own = [i for _, u in promoted.units[10:] for _, r in u if (i := record_id(r))]
    assert not set(own) & set(wal.event_ids)

    def promote() -> None:
        if wal.taken == 0:  # the last attempt that found the slot held: the primary dies
            wal.units = promoted.units
            wal.timeline = 2
            wal.confirmed = wal.units[4][0]  # the copy of the failover slot

    standby, _ = eos_relay(wal, kafka, standby=True)
    wal.taken = 3  # A holds the slot, then the primary dies and the standby is promoted
    wal.on_taken = promote
    wal.on_idle = standby.request_stop
    standby.run()

    missing = [i for i in own if i not in set(kafka.ids())]
    assert not missing, (
        f"{len(missing)} of the new primary's {len(own)} events never reached Kafka "
        f"(checkpoint trusted: {standby._eos.committed if standby._eos else None})"
    )
