from __future__ import annotations

import random

from capture import pgoutput_messages

from cdc_relay.events import Begin, Commit, Insert
from cdc_relay.postgres import pgoutput
from cdc_relay.relay.lsn_tracker import Acknowledgements, LsnTracker, Transaction


def committed(tracker: LsnTracker, end_lsn: int, events: int) -> Transaction:
    txn = tracker.begin()
    for _ in range(events):
        tracker.sent(txn)
    tracker.commit(txn, end_lsn)
    return txn


def test_nothing_is_safe_until_every_event_of_the_transaction_is_acked() -> None:
    tracker = LsnTracker(confirmed=100)
    txn = committed(tracker, 200, events=3)
    tracker.acked(txn)
    tracker.acked(txn)
    assert tracker.safe_lsn == 100
    tracker.acked(txn)
    assert tracker.safe_lsn == 200
    assert tracker.in_flight == 0
    assert tracker.idle


def test_acks_out_of_order_across_transactions_confirm_only_the_acked_prefix() -> None:
    tracker = LsnTracker()
    first = committed(tracker, 100, events=1)
    second = committed(tracker, 200, events=1)
    third = committed(tracker, 300, events=1)
    tracker.acked(third)  # another partition answered first
    tracker.acked(second)
    assert tracker.safe_lsn == 0
    tracker.acked(first)
    assert tracker.safe_lsn == 300


def test_open_transaction_holds_back_later_positions() -> None:
    tracker = LsnTracker()
    first = committed(tracker, 100, events=1)
    open_txn = tracker.begin()
    tracker.sent(open_txn)
    tracker.acked(first)
    tracker.acked(open_txn)  # acked, but its Commit has not arrived
    assert tracker.safe_lsn == 100
    tracker.keepalive(500)  # something is in flight: keepalives must not move the position
    assert tracker.safe_lsn == 100
    tracker.commit(open_txn, 200)
    assert tracker.safe_lsn == 200


def test_empty_transactions_are_safe_at_once() -> None:
    tracker = LsnTracker()
    committed(tracker, 100, events=0)
    assert tracker.safe_lsn == 100
    assert tracker.idle


def test_empty_transaction_behind_an_unacked_one_waits() -> None:
    tracker = LsnTracker()
    busy = committed(tracker, 100, events=2)
    committed(tracker, 150, events=0)
    assert tracker.safe_lsn == 0
    tracker.acked(busy)
    tracker.acked(busy)
    assert tracker.safe_lsn == 150


def test_keepalive_with_nothing_in_flight_confirms_its_position() -> None:
    tracker = LsnTracker(confirmed=100)
    tracker.keepalive(400)
    assert tracker.safe_lsn == 400
    tracker.keepalive(300)  # positions never move backwards
    assert tracker.safe_lsn == 400


def test_positions_are_monotonic_under_random_interleavings() -> None:
    rng = random.Random(7)
    for _ in range(200):
        tracker = LsnTracker()
        unacked: list[Transaction] = []
        ends = {}
        lsn = 0
        for _ in range(rng.randint(1, 30)):
            lsn += rng.randint(1, 1000)
            txn = committed(tracker, lsn, events=rng.randint(0, 4))
            ends[id(txn)] = lsn
            unacked.extend([txn] * txn.pending)
        rng.shuffle(unacked)
        seen = tracker.safe_lsn
        acked: set[int] = set()
        for txn in unacked:
            tracker.acked(txn)
            if txn.pending == 0:
                acked.add(id(txn))
            assert tracker.safe_lsn >= seen
            seen = tracker.safe_lsn
            # Never past a transaction with an unacked event.
            pending_ends = [ends[id(t)] for t in unacked if t.pending > 0]
            if pending_ends:
                assert tracker.safe_lsn < min(pending_ends)
        assert tracker.safe_lsn == lsn
        assert tracker.in_flight == 0


def test_reset_forgets_in_flight_and_ignores_their_late_acks() -> None:
    tracker = LsnTracker()
    done = committed(tracker, 100, events=1)
    tracker.acked(done)
    lost = committed(tracker, 200, events=2)
    tracker.reset()
    assert tracker.in_flight == 0
    assert tracker.safe_lsn == 100
    tracker.acked(lost)  # a late report from before the reconnect
    assert tracker.in_flight == 0
    assert tracker.safe_lsn == 100
    again = committed(tracker, 200, events=2)  # the replay
    tracker.acked(again)
    tracker.acked(again)
    assert tracker.safe_lsn == 200


def test_acknowledgements_move_the_tracker_count_and_time_each_transaction_once() -> None:
    """The stream's checkpointer: each report moves the tracker and leaves the unacknowledged
    ids; the commit-to-ack latency is observed once per transaction, on the clock given, and
    not for a transaction forgotten by a rewind, whose late reports are still counted."""
    tracker = LsnTracker()
    latencies: list[float] = []
    acks = Acknowledgements(tracker, latencies.append, clock=lambda: 12.5)
    txn = tracker.begin(commit_time_us=10_000_000)
    for event in ("a", "b"):
        tracker.sent(txn)
        acks.unacknowledged.add(event)
    tracker.commit(txn, 100)
    acks.acked((txn, "b"))
    assert (tracker.safe_lsn, acks.unacknowledged, latencies) == (0, {"a"}, [])
    acks.acked((txn, "a"))
    assert (tracker.safe_lsn, acks.unacknowledged, latencies) == (100, set(), [2.5])
    lost = committed(tracker, 200, events=1)
    acks.unacknowledged.add("c")
    tracker.reset()
    acks.acked((lost, "c"))  # late, from before the rewind
    assert (tracker.safe_lsn, acks.unacknowledged, latencies) == (100, set(), [2.5])
    assert (acks.take(), acks.take()) == (3, 0)


def test_real_stream_confirms_each_commit_end_once_acked() -> None:
    tracker = LsnTracker()
    txn: Transaction | None = None
    held: list[Transaction] = []
    ends = []
    for message in pgoutput_messages():
        record = pgoutput.decode(message)
        if isinstance(record, Begin):
            txn = tracker.begin()
        elif isinstance(record, Insert) and txn is not None:
            tracker.sent(txn)
            held.append(txn)
        elif isinstance(record, Commit) and txn is not None:
            tracker.commit(txn, record.end_lsn)
            ends.append(record.end_lsn)
    assert tracker.safe_lsn < ends[0]  # the first transaction has an unacked insert
    for t in reversed(held):
        tracker.acked(t)
    assert tracker.safe_lsn == ends[-1]
