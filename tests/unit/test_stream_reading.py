"""The stream's messages while they flow (relay/reading.py): what the connection holds already
is handled in one go, but never past the loop's tick, a keepalive or a stop.

On test_stream_loop's in-memory stages, with the backlog captured from PostgreSQL 15.
"""

from __future__ import annotations

from typing import Any

from test_stream_loop import Connection, Sink, Wal, acked_ids, backlog, relay_on

from cdc_relay.errors import RelayError
from cdc_relay.kafka.routing import Message
from cdc_relay.postgres.replication import Keepalive, XLogData
from cdc_relay.relay.stream import StreamRelay

FAR = float("inf")


def opened(wal: Wal) -> tuple[StreamRelay, Sink, Connection]:
    """A relay's parts on ``wal``, with a connection started as the loop would start it."""
    relay, sink = relay_on(wal)
    records = relay._records
    records.tables = wal.tables
    conn = Connection(wal)
    conn.start("test", 0, records.start_options())
    return relay, sink, conn


def transactions(count: int) -> int:
    """Where the first ``count`` transactions of the backlog (10 events each) end."""
    raw = backlog()
    return [i for i, data in enumerate(raw) if data[:1] == b"C"][count - 1] + 1


def first(conn: Connection) -> XLogData:
    message = conn.read(1.0)
    assert isinstance(message, XLogData)
    return message


def test_a_flow_stops_at_the_tick_and_leaves_the_rest_to_the_connection() -> None:
    wal = Wal(backlog()[: transactions(2)])
    relay, _, conn = opened(wal)
    message = first(conn)
    held = len(conn.queue)
    assert held > 20
    assert relay._reading.flow(conn, message, until=0.0) is None
    assert len(conn.queue) == held  # the first message alone: the tick was due


def test_a_flow_handles_what_the_connection_holds_up_to_a_keepalive() -> None:
    two, three = transactions(2), transactions(3)
    wal = Wal(backlog()[:two])
    wal.keepalive()
    wal.write(backlog()[two:three])
    relay, sink, conn = opened(wal)

    came = relay._reading.flow(conn, first(conn), until=FAR)

    assert isinstance(came, Keepalive)
    assert [event_id for event_id, _ in sink.offered] == wal.event_ids[:20]
    assert relay._reading.received == wal.units[1][0]  # the second transaction's end
    # Then the rest, until the connection holds nothing more.
    assert relay._reading.flow(conn, first(conn), until=FAR) is None
    assert [event_id for event_id, _ in sink.offered] == wal.event_ids


def test_a_stop_while_a_backlog_is_in_hand_offers_nothing_after_it() -> None:
    wal = Wal(backlog())
    relay, sink = relay_on(wal)
    offer = sink.offer

    def offer_then_stop(message: Message, token: Any) -> bool:
        accepted = offer(message, token)
        if len(sink.offered) == 5:
            relay.request_stop()  # as the SIGTERM handler does
        return accepted

    sink.offer = offer_then_stop  # type: ignore[method-assign]
    relay.stream(wal.tables)

    assert [event_id for event_id, _ in sink.offered] == wal.event_ids[:5]
    assert acked_ids(sink) == wal.event_ids[:5]  # the graceful stop still delivers them


def test_a_message_that_does_not_decode_names_its_position() -> None:
    wal = Wal(backlog())
    relay, _, conn = opened(wal)
    broken = XLogData(0x16B3748, 0x16B3748, b"I\x00")  # an insert cut short

    try:
        relay._reading.flow(conn, broken, until=FAR)
    except RelayError as exc:
        assert "cannot decode pgoutput message at 0/16B3748" in str(exc)
        assert "please report it" in str(exc)
    else:
        raise AssertionError("a message that does not decode went by")
