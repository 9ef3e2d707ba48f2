"""The poll loop (``PollRelay``'s workers) on in-memory stages: no database, no broker.

The outbox is memory_outbox's, which answers the claim's queries as PostgreSQL does; the sink
is test_stream_loop's, which acknowledges or refuses what it holds as the test says. What
these prove is the loop's own logic: order per aggregate with several workers, back-pressure,
the refusal classes (a suspect is tried again alone and never made a dead letter; the culprit
is, after --max-attempts; rows behind a failed one of their aggregate wait), the walk past a
row another transaction locks, what each kind of database error does (retry on a new
connection, wait out a read-only server, stop with one line), and the stop. The integration
suite proves the same against PostgreSQL and Kafka (tests/integration/test_poller.py,
test_refusals.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from confluent_kafka import KafkaError
from memory_outbox import MemoryOutbox
from prometheus_client import REGISTRY
from test_stream_loop import Sink, event_id

from cdc_relay.errors import RelayError
from cdc_relay.postgres.shards import hashtext
from cdc_relay.relay.poller import PollRelay
from cdc_relay.relay.worker import PollSettings

WATCHDOG = 10.0  # seconds: a loop that never ends fails its test instead of hanging it


def settings(**more: Any) -> PollSettings:
    base: dict[str, Any] = {
        "dsn": "dbname=test",
        "kafka_config": {},
        "topic_template": "outbox.{aggregate_type}",
        "table": "outbox_events",
        "batch_size": 8,
        "poll_interval": 0.01,
        "progress_interval": 0.05,
        "backoff_base": 0.005,
        "backoff_max": 0.02,
        "shutdown_timeout": 0.3,
    }
    return PollSettings(**(base | more))


class Relay:
    """A PollRelay on ``store``, its workers' sinks made alike and kept for the test."""

    def __init__(self, store: MemoryOutbox, sink_class: type[Sink] = Sink, **more: Any) -> None:
        self.store = store
        self.sinks: list[Sink] = []
        self.poison: dict[str, int] = {}  # shared by every worker's sink
        self.setup: Callable[[Sink], object] = lambda sink: None

        def open_sink(on_ack: Any, on_refused: Any) -> Sink:
            sink = sink_class(on_ack, on_refused)
            sink.poison = self.poison
            self.setup(sink)
            self.sinks.append(sink)
            return sink

        self.relay = PollRelay(settings(**more), open_sink=open_sink)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._poll, name="test-poll")

    def _poll(self) -> None:
        try:
            self.relay.poll(self.store)
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            self.error = exc

    def run_until(self, done: Callable[[], bool]) -> None:
        """Poll until ``done`` (or the relay stops on its own), then stop it."""
        self._thread.start()
        deadline = time.monotonic() + WATCHDOG
        try:
            while not done() and self._thread.is_alive():
                assert time.monotonic() < deadline, "the condition never came"
                time.sleep(0.002)
        finally:
            self.relay.request_stop()
            self._thread.join(WATCHDOG)
        assert not self._thread.is_alive(), "the relay did not stop"

    def acked(self) -> list[str]:
        """The event ids Kafka acknowledged, per sink in their order, sinks one after another."""
        return [event_id(m) for sink in self.sinks for m in sink.acked]

    def offered(self) -> list[str]:
        return [i for sink in self.sinks for i, _ in sink.offered]


def assert_in_order(store: MemoryOutbox, relay: Relay) -> None:
    """Each aggregate's acknowledged events in the order of its rows: an aggregate is one
    worker's at a time, and a sink acknowledges in the order it was offered; a row published
    again (acknowledged, its mark lost) comes again after the ones before it."""
    by_aggregate: dict[str, list[int]] = {}
    seq = {r.id: r.seq for r in store.rows}
    aggregate = {r.id: r.aggregate_id for r in store.rows}
    for sink in relay.sinks:
        seen: dict[str, list[int]] = {}
        for message in sink.acked:
            i = event_id(message)
            seen.setdefault(aggregate[i], []).append(seq[i])
        for agg, seqs in seen.items():
            by_aggregate.setdefault(agg, []).extend(seqs)
    for agg, seqs in by_aggregate.items():
        firsts = list(dict.fromkeys(seqs))
        assert firsts == sorted(firsts), f"aggregate {agg} out of order: {seqs}"


def test_every_row_goes_out_in_order_per_aggregate_with_several_workers() -> None:
    store = MemoryOutbox()
    for n in range(60):
        store.add(f"a{n % 7}")
    relay = Relay(store, workers=3)

    relay.run_until(store.done)

    assert relay.error is None
    assert all(r.processed and r.marks == ["processed"] for r in store.rows)
    assert sorted(relay.acked()) == sorted(r.id for r in store.rows)  # each once
    assert len(relay.sinks) == 3
    assert_in_order(store, relay)
    # The aggregates sorted out per worker: no aggregate went through two sinks.
    owners = {
        store.row(event_id(m)).aggregate_id: n
        for n, sink in enumerate(relay.sinks)
        for m in sink.acked
    }
    for n, sink in enumerate(relay.sinks):
        assert all(owners[store.row(event_id(m)).aggregate_id] == n for m in sink.acked)


def test_a_full_producer_queue_waits_and_loses_nothing() -> None:
    store = MemoryOutbox()
    for n in range(40):
        store.add(f"a{n % 3}")
    relay = Relay(store)
    relay.setup = lambda sink: setattr(sink, "capacity", 2)

    relay.run_until(store.done)

    assert relay.error is None
    assert relay.sinks[0].full > 0  # the loop met a full queue, and waited
    assert relay.acked() == [r.id for r in store.rows]  # one worker: the queue's order
    assert all(r.processed for r in store.rows)


def test_a_refused_batch_makes_suspects_the_culprit_alone_becomes_a_dead_letter() -> None:
    store = MemoryOutbox()
    first = store.add("a", 2)
    poison = store.add("b")[0]
    behind = store.add("b")[0]  # after the culprit, of its aggregate
    last = store.add("c", 2)
    relay = Relay(store, max_attempts=2)
    relay.poison[poison] = KafkaError.MSG_SIZE_TOO_LARGE

    relay.run_until(store.done)

    assert relay.error is None
    culprit = store.row(poison)
    # Refused among others first (an attempt, but not its own failure), then alone, and
    # parked with Kafka's reason.
    assert culprit.dead
    assert culprit.attempts == 2
    assert "MSG_SIZE_TOO_LARGE" in (culprit.last_error or "")
    # The innocents of the refused batch went again and were delivered; none is a dead letter.
    for i in (*first, behind, *last):
        assert store.row(i).processed, i
        assert store.row(i).attempts == 1
    assert set(relay.acked()) == {*first, behind, *last}
    # The first try was the whole claim in one batch; the second went alone.
    tries = [others for sink in relay.sinks for i, others in sink.offered if i == poison]
    assert tries == [2, 0]
    # The row behind the culprit was offered again only once the culprit was given up on.
    offered = relay.offered()
    again = [n for n, i in enumerate(offered) if i == behind][1:]
    assert again
    assert min(again) > max(n for n, i in enumerate(offered) if i == poison)


def test_a_row_tried_again_goes_with_nothing_else_in_flight() -> None:
    store = MemoryOutbox()
    fresh = store.add("x")[0]
    innocent = store.add("a")[0]
    poison = store.add("b")[0]
    later = store.add("y")[0]
    # The rows new to Kafka before and after the retried ones are locked by another
    # transaction at the first claim, and free by the time the retried ones are due again:
    # the second claim mixes rows tried before with rows that were not.
    store.locked_rows |= {fresh, later}
    # The retried rows come due when the test says, not by the clock: their back-off outlasts
    # the test, and the store's clock jumps to its end, and the locks go, at the first claim
    # after their failure that walks past no aggregate. (The claim right after the first walks
    # past the locked rows' aggregates: due by then, the retried rows would go alone.)
    shift = 0.0
    store.clock = lambda: time.monotonic() + shift

    def free_once_due(skip: list[int]) -> None:
        nonlocal shift
        due = [store.row(i).retry_after for i in (innocent, poison)]
        if store.locked_rows and not skip and None not in due:
            shift = max(d or 0.0 for d in due) - time.monotonic()
            store.locked_rows.clear()

    store.before_claim = free_once_due
    relay = Relay(store, max_attempts=2, backoff_base=60.0, backoff_max=60.0)
    relay.poison[poison] = KafkaError.MSG_SIZE_TOO_LARGE

    relay.run_until(store.done)

    assert relay.error is None
    assert store.claimed[0] == [innocent, poison]
    assert store.claimed[1] == [fresh, innocent, poison, later]
    offers = {i: [o for j, o in relay.sinks[0].offered if j == i] for i in store.claimed[0]}
    assert offers[poison] == [1, 0]  # beside the innocent first; then alone
    assert offers[innocent][1:] == [0]
    assert store.row(poison).dead
    # The row after the retried ones went only once the culprit's report had come.
    assert [o for j, o in relay.sinks[0].offered if j == later] == [0]
    assert store.row(fresh).processed and store.row(later).processed


def test_a_suspect_is_never_a_dead_letter_whatever_max_attempts() -> None:
    store = MemoryOutbox()
    innocent = store.add("a")[0]
    poison = store.add("b")[0]
    relay = Relay(store, max_attempts=1)
    relay.poison[poison] = KafkaError.MSG_SIZE_TOO_LARGE

    relay.run_until(store.done)

    assert relay.error is None
    assert store.row(innocent).processed  # refused with the culprit, then alone: delivered
    assert store.row(innocent).attempts == 1
    assert store.row(poison).dead
    assert store.row(poison).attempts == 2  # the batch's refusal was not its own


def test_what_the_router_refuses_is_the_rows_own_at_once() -> None:
    store = MemoryOutbox()
    ok = store.add("a")[0]
    empty = store.add("b", payload=None)[0]  # a NULL payload, without tombstones
    behind = store.add("b")[0]
    relay = Relay(store, max_attempts=1)

    relay.run_until(store.done)

    assert relay.error is None
    assert store.row(ok).processed
    assert store.row(empty).dead
    assert store.row(empty).attempts == 1
    assert empty not in relay.offered()
    # The row behind it was held back in that batch (a later claim took it, once the refused
    # row was a dead letter, which holds nothing back), and went out then.
    assert store.claimed[0] == [ok, empty, behind]
    assert relay.offered() == [ok, behind]
    assert sum(behind in claim for claim in store.claimed) == 2
    assert store.row(behind).processed


def test_rows_behind_a_failed_one_of_their_aggregate_wait_for_it() -> None:
    store = MemoryOutbox()
    flaky = store.add("a")[0]
    behind = store.add("a", 3)
    other = store.add("b", 3)
    relay = Relay(store, max_attempts=5)
    # Kafka refuses it (not authorised) in the first batch, which makes every row of it a
    # suspect, and alone once more; then the grant comes.
    relay.poison[flaky] = KafkaError.TOPIC_AUTHORIZATION_FAILED

    def grant(sink: Sink) -> None:
        original = sink.on_refused

        def on_refused(token: Any, err: KafkaError) -> None:
            original(token, err)
            if sum(i == flaky for i, _, _ in sink.refused) == 2:
                relay.poison.pop(flaky, None)

        sink.on_refused = on_refused

    relay.setup = grant

    relay.run_until(store.done)

    assert relay.error is None
    assert all(store.row(i).processed for i in (flaky, *behind, *other))
    assert store.row(flaky).attempts == 2
    acked = relay.acked()
    assert acked.index(flaky) < min(acked.index(i) for i in behind)
    assert [i for i in acked if i in behind] == behind
    # After the first batch, nothing behind the failed row was offered before it went through.
    offered = relay.offered()[7:]
    delivered = len(offered) - 1 - offered[::-1].index(flaky)
    assert all(n > delivered for n, i in enumerate(offered) if i in behind)


def test_a_row_another_transaction_locks_holds_its_aggregate_only() -> None:
    store = MemoryOutbox()
    held = store.add("a")[0]
    behind = store.add("a", 2)
    others = [i for n in range(10) for i in store.add(f"b{n}")]
    store.locked_rows.add(held)  # a prepared transaction deleting it, say
    relay = Relay(store, batch_size=2)

    released = {"done": False}

    def others_then_release() -> bool:
        if not released["done"] and all(store.row(i).processed for i in others):
            with store.lock:
                assert not any(store.row(i).marks for i in (held, *behind))
                store.locked_rows.discard(held)
            released["done"] = True
        return released["done"] and store.done()

    relay.run_until(others_then_release)

    assert relay.error is None
    acked = relay.acked()
    assert acked[-3:] == [held, *behind]  # the aggregate in order once released
    assert set(acked[:-3]) == set(others)


def test_a_lost_connection_rolls_back_the_marks_and_publishes_again() -> None:
    store = MemoryOutbox()
    for n in range(12):
        store.add(f"a{n % 2}")
    store.fail["mark_processed"] = [psycopg.OperationalError("server closed the connection")]
    relay = Relay(store)

    relay.run_until(store.done)

    assert relay.error is None
    assert store.rollbacks >= 1
    assert store.connections == 2  # the connection was dropped and made anew
    assert all(r.processed for r in store.rows)
    acked = relay.acked()
    assert set(acked) == {r.id for r in store.rows}
    assert len(acked) > len(store.rows)  # the first batch again: at least once
    assert_in_order(store, relay)


def test_a_read_only_server_is_waited_out(caplog: pytest.LogCaptureFixture) -> None:
    store = MemoryOutbox()
    ids = store.add("a", 3)
    store.fail["claim_aggregates"] = [
        psycopg.errors.ReadOnlySqlTransaction("cannot execute SELECT FOR UPDATE"),
        psycopg.errors.ReadOnlySqlTransaction("cannot execute SELECT FOR UPDATE"),
    ]
    relay = Relay(store)

    with caplog.at_level(logging.WARNING, logger="cdc_relay.relay.worker"):
        relay.run_until(store.done)

    assert relay.error is None
    assert relay.acked() == ids
    waits = [r for r in caplog.records if getattr(r, "action", None) == "read_only"]
    assert len(waits) == 2


def test_an_error_the_user_must_fix_stops_the_relay_with_one_line() -> None:
    store = MemoryOutbox()
    store.add("a", 3)
    store.fail["claim"] = [psycopg.errors.UndefinedColumn('column "seq" does not exist')]
    relay = Relay(store)

    relay.run_until(lambda: False)

    assert isinstance(relay.error, RelayError)
    assert "PostgreSQL refused the poller's query on public.outbox_events" in str(relay.error)
    assert "SQLSTATE 42703" in str(relay.error)
    assert not any(r.marks for r in store.rows)  # rolled back: nothing marked
    assert relay.acked() == []


def test_a_payload_column_retyped_while_polling_stops_before_publishing_its_rows() -> None:
    store = MemoryOutbox()
    before = store.add("a", 2)
    relay = Relay(store)

    def retype_then_write() -> bool:
        if all(store.row(i).processed for i in before) and len(store.rows) == 2:
            for i in store.add("a", 2):
                store.row(i).payload_type = 25  # text now: read as jsonb it was other bytes
            relay.relay.wake.notify()
        return False

    relay.run_until(retype_then_write)

    assert isinstance(relay.error, RelayError)
    assert "the payload column of public.outbox_events changed type" in str(relay.error)
    assert relay.acked() == before
    assert not any(r.marks for r in store.rows[2:])


def test_stopping_with_reports_outstanding_leaves_the_rows_unprocessed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = MemoryOutbox()
    store.add("a", 2)
    store.add("b", 2)
    relay = Relay(store, shutdown_timeout=0.2)
    relay.setup = lambda sink: setattr(sink, "hold_all", True)  # Kafka never answers

    with caplog.at_level(logging.INFO, logger="cdc_relay.relay.poller"):
        relay.run_until(lambda: bool(relay.sinks) and len(relay.sinks[0].queue) == 4)

    assert relay.error is None
    assert not any(r.processed or r.marks for r in store.rows)
    assert store.rollbacks == 0 and store.commits >= 1  # the batch's transaction, marking none
    released = [r for r in caplog.records if getattr(r, "action", None) == "batch_released"]
    assert [r.getMessage() for r in released] == [
        "stopping before Kafka answered for 4 rows; they stay unprocessed"
    ]
    stop = [r for r in caplog.records if getattr(r, "action", None) == "stop"]
    assert stop[-1].getMessage() == (
        "stopped; 4 messages were still waiting for Kafka and may be published again"
    )


def test_a_claim_postgresql_released_while_kafka_was_away_is_dropped_not_delivered_late() -> None:
    """The worker's session ends (terminated, idle_in_transaction_session_timeout) while Kafka
    holds its batch: PostgreSQL released the claim, and another poller may publish those rows
    and newer ones of their aggregates. The producer's copies are dropped before Kafka comes
    back, instead of arriving after that poller's newer events."""
    store = MemoryOutbox()
    first = store.add("a", 3)
    relay = Relay(store)
    relay.setup = lambda sink: setattr(sink, "hold_all", True)  # Kafka away
    state = {"ended": False}

    def end_session_then_kafka_back() -> bool:
        sinks = relay.sinks
        if not state["ended"]:
            if sinks and len(sinks[0].queue) == 3:
                store.end_sessions()
                state["ended"] = True
            return False
        if sinks[0].queue:
            return False  # still holding the released claim's messages
        for sink in sinks:
            sink.hold_all = False  # Kafka is back
        return store.done()

    relay.run_until(end_session_then_kafka_back)

    assert relay.error is None
    assert relay.acked() == first  # each once, from the claim made again: not the dropped copies
    assert all(store.row(i).marks == ["processed"] for i in first)


def test_a_row_published_after_a_later_one_of_its_aggregate_is_said_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Its transaction committed after the later row went out (docs/how-it-works.md, "Order per
    aggregate on each path"): it follows that row, and the poller says so."""
    store = MemoryOutbox()
    first, second = store.add("a", 2)
    store.row(second).processed = True  # published before the first row's commit
    before = REGISTRY.get_sample_value("outbox_events_out_of_seq_order_total", {"relay": "poll"})
    relay = Relay(store)

    with caplog.at_level(logging.WARNING, logger="cdc_relay.relay.worker"):
        relay.run_until(store.done)

    assert relay.error is None
    assert relay.acked() == [first]
    after = REGISTRY.get_sample_value("outbox_events_out_of_seq_order_total", {"relay": "poll"})
    assert (after or 0) - (before or 0) == 1
    (said,) = [r for r in caplog.records if getattr(r, "action", None) == "out_of_seq_order"]
    assert said.getMessage() == (
        f"event {first} went out after event seq 2 of its aggregate, out of seq order (its seq "
        "is 1): its transaction committed after that one was published"
    )


def test_a_refused_row_is_counted_in_outbox_events_failed() -> None:
    """docs/polling.md lists outbox_events_failed_total among the poller's metrics."""
    store = MemoryOutbox()
    poison = store.add("b")[0]

    def failed() -> float:  # whatever label its type got (metrics.count_failed)
        return sum(
            sample.value
            for metric in REGISTRY.collect()
            if metric.name == "outbox_events_failed"
            for sample in metric.samples
            if sample.name == "outbox_events_failed_total" and sample.labels["relay"] == "poll"
        )

    before = failed()
    relay = Relay(store, max_attempts=2)
    relay.poison[poison] = KafkaError.MSG_SIZE_TOO_LARGE

    relay.run_until(store.done)

    assert relay.error is None
    assert store.row(poison).dead
    assert failed() - before == 2


def test_two_aggregate_types_made_into_one_topic_are_told_apart_across_workers() -> None:
    """The workers share one router: whichever meets its name second is refused, though
    each holds only one of them (a worker looks at its share of the aggregates)."""

    def on_worker(n: int) -> str:
        return next(
            f"a{i}" for i in range(100) if (hashtext(f"a{i}".encode()) & 0x7FFFFFFF) % 2 == n
        )

    store = MemoryOutbox()
    for n, aggregate_type in enumerate(("order/line", "order_line")):
        store.add(on_worker(n), 3, aggregate_type=aggregate_type)
    relay = Relay(store, workers=2, max_attempts=2)

    relay.run_until(store.done)

    assert relay.error is None
    assert {event_id(m) for sink in relay.sinks for m in sink.acked} == {
        r.id for r in store.rows if r.processed
    }
    processed = {r.aggregate_type for r in store.rows if r.processed}
    dead = {r.aggregate_type for r in store.rows if r.dead}
    assert len(processed) == len(dead) == 1 and processed != dead, (processed, dead)
    (refused,) = dead
    (kept,) = processed
    for row in store.rows:
        if row.dead:
            assert f"'{refused}' and '{kept}' both make topic outbox.order_line" in (
                row.last_error or ""
            )
            assert row.attempts == 2
