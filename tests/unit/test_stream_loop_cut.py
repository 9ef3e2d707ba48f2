"""A new shard's side of a resharding cut, on the loop's in-memory stages (test_stream_loop).

The stream is captured from PostgreSQL 15 (tests/tools/capture.py --cut): three outbox
transactions, the cut as reshard writes it (a transactional message of prefix cdc-relay-cut
naming the old slot ``old``, alone in its transaction), three more. The database's answers
the relay reads besides the stream (its publication's comment, where reshard notes the cut;
how far the old slots are confirmed) come from ``Database``.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import psycopg
import pytest
from capture import messages as captured
from test_stream_loop import Sink, Wal, acked_ids, first_seen, record_id, relay_on

from cdc_relay.events import LogicalMessage
from cdc_relay.lsn import Lsn, format_lsn
from cdc_relay.postgres import messages
from cdc_relay.postgres.shards import CUT_PREFIX, Cut, Shard, StartAfterCut
from cdc_relay.queries import QUERIES
from cdc_relay.relay import cut as shard_cut
from cdc_relay.relay import preflight, standby
from cdc_relay.relay.stream import StreamRelay

SHARD = Shard(0, 1)  # a new shard of a reshard from 2 to 1: every aggregate is its own


class Rows:
    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows

    def fetchone(self) -> dict[str, Any] | None:
        return self.rows[0] if self.rows else None

    def fetchall(self) -> list[dict[str, Any]]:
        return self.rows


class Database:
    """What the relay's plain connections read: the shard publication's comment (reshard's
    note of the cut, which also tells a genuine cut from a forged one) and how far the old
    slots are confirmed."""

    def __init__(self, cut: Cut, at: Lsn, old_confirmed: Lsn) -> None:
        self.comment = StartAfterCut(cut.cut, at).comment(SHARD)
        self.old_confirmed = old_confirmed

    def execute(self, query: str, params: dict[str, Any] | None = None) -> Rows:
        if query in (QUERIES["publication_comment"], QUERIES["cut_comments"]):
            return Rows([{"comment": self.comment}])
        if query == QUERIES["slots_confirmed"]:
            return Rows([{"slot_name": "old", "confirmed": format_lsn(self.old_confirmed)}])
        raise AssertionError(f"unexpected query: {query}")

    @contextmanager
    def connect(self, dsn: str, **options: Any) -> Iterator[Database]:
        yield self

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """The relay's plain connections reach this database (its parts', and messages.py's
        check of a cut)."""
        for module in (shard_cut, preflight):
            monkeypatch.setattr(module, "connect", self.connect)
        monkeypatch.setattr(standby, "reconnecting", self.connect)
        fake = types.SimpleNamespace(
            connect=self.connect, OperationalError=psycopg.OperationalError
        )
        monkeypatch.setattr(messages, "psycopg", fake)


def cut_wal() -> tuple[Wal, Cut, LogicalMessage]:
    wal = Wal(captured("pgoutput-cut"))
    message = next(
        r
        for _, unit in wal.units
        for _, r in unit
        if isinstance(r, LogicalMessage) and r.prefix == CUT_PREFIX
    )
    cut = Cut.from_content(message.content)
    assert cut is not None and cut.slots == ("old",)
    return wal, cut, message


def ids_around_the_cut(wal: Wal, at: Lsn) -> tuple[list[str], list[str]]:
    """The event ids of the transactions committed before the cut's message, and after."""
    before = [i for end, u in wal.units if end <= at for _, r in u if (i := record_id(r))]
    after = [i for end, u in wal.units if end > at for _, r in u if (i := record_id(r))]
    return before, after


def new_shard(wal: Wal, database: Database) -> tuple[StreamRelay, Sink]:
    """A relay of the new shard, which found at start (as ``_check_database`` does) that its
    slot has not passed the cut reshard noted in its publication's comment."""
    relay, sink = relay_on(wal, shard=SHARD)
    relay._start_after_cut(cast(Any, database), SHARD, format_lsn(wal.confirmed))
    assert relay._cut.waiting
    return relay, sink


def test_a_new_shard_relays_what_comes_after_the_cut_and_nothing_before_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The baseline: the old slot is confirmed past the cut's commit; the new shard skips
    the three transactions before the cut and relays the three after it."""
    wal, cut, message = cut_wal()
    database = Database(cut, message.lsn, old_confirmed=wal.units[-1][0])
    database.install(monkeypatch)
    relay, sink = new_shard(wal, database)
    _, after = ids_around_the_cut(wal, message.lsn)
    wal.on_idle = lambda: set(acked_ids(sink)) >= set(after) and relay.request_stop()

    relay.stream(wal.tables)

    assert acked_ids(sink) == after


def test_a_new_shard_reconnected_to_a_promoted_server_behind_the_cut_skips_what_precedes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The new shard passed the cut and relayed what follows it; its connection is lost and
    it reconnects to a standby promoted since (timeline 2), whose copy of the failover slot
    lags behind the cut (the copy is synchronised now and then, and the relay confirms a
    little after it acknowledges). The relay now starts from the slot's position there
    (_follow_timeline, LsnTracker.rebase): before the cut. What precedes the cut is the old
    shards', delivered by them; the new shard must skip it again, as a restart from that
    position does (_start_after_cut). It does not decide again: it relays the old shard's
    events once more, after its own later events of the same aggregates (o-0, o-1): each of
    them twice, and an aggregate's events out of order (a3, a101, a3)."""
    wal, cut, message = cut_wal()
    database = Database(cut, message.lsn, old_confirmed=wal.units[-1][0])
    database.install(monkeypatch)
    relay, sink = new_shard(wal, database)
    before, after = ids_around_the_cut(wal, message.lsn)
    lagging = wal.units[0][0]  # the copy: after the first transaction, before the cut
    assert lagging < message.lsn
    lost: list[bool] = []

    def on_idle() -> None:
        if not lost and set(acked_ids(sink)) >= set(after):
            lost.append(True)
            wal.connections[-1].lose_after = 0  # the primary dies
        elif lost and len(wal.starts) == 2:
            relay.request_stop()

    def promoted() -> None:
        wal.timeline = 2
        wal.confirmed = lagging

    wal.on_idle = on_idle
    wal.on_lost = promoted

    relay.stream(wal.tables)

    assert wal.starts[1] == lagging  # from the slot's position on the new timeline
    relayed = acked_ids(sink)
    assert not set(relayed) & set(before), (
        f"the new shard relayed {sorted(set(relayed) & set(before))}, events committed before "
        f"the cut that the old shard delivered, after {first_seen(relayed)[:2]}"
    )
    assert first_seen(relayed) == after
