"""--trace-column: the column's value read (a plain traceparent, or Debezium's
java.util.Properties text), checked, and sent as the headers traceparent and tracestate.

The rows are real: captured from PostgreSQL 15 through pgoutput and wal2json
(tests/tools/capture.py --trace), so the bytes the decoders hand over are the ones parsed.
"""

from __future__ import annotations

import dataclasses

import pytest
from capture import messages
from confluent_kafka import KafkaError

from cdc_relay.errors import UsageError
from cdc_relay.events import (
    Begin,
    Column,
    Insert,
    OutboxEvent,
    OutboxLayout,
    Relation,
    RowMapper,
    SchemaError,
)
from cdc_relay.kafka.cloudevents import CloudEvents
from cdc_relay.kafka.deadletter import DeadLetters
from cdc_relay.kafka.routing import Router
from cdc_relay.metrics import TRACE_CONTEXT_MALFORMED
from cdc_relay.postgres import pgoutput
from cdc_relay.postgres.store import OutboxRow
from cdc_relay.postgres.wal2json import Wal2JsonDecoder
from cdc_relay.tracecontext import TraceContext, load_properties, parse, traceparent_problem

PLAIN = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
PARENT = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
STATE = b"rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"
MALFORMED = b"00-0AF7651916CD43DD8448EB211C80319C-x-01"

# What each captured row must become: the headers it carries after the event's own three.
EXPECTED: dict[str, list[tuple[str, bytes]]] = {
    "plain traceparent": [("traceparent", PLAIN)],
    "debezium properties": [("traceparent", PARENT), ("tracestate", STATE)],
    "properties without tracestate": [("traceparent", PARENT[:-2] + b"00")],
    "null trace": [],
    "malformed traceparent": [("traceparent", MALFORMED)],  # as stored
    "empty trace": [],
}
LAYOUT = OutboxLayout(trace_column="tracingspancontext")


def _events(plugin: str, layout: OutboxLayout = LAYOUT) -> dict[str, OutboxEvent]:
    decode = Wal2JsonDecoder().decode if plugin == "wal2json" else lambda m: [pgoutput.decode(m)]
    mappers: dict[int, RowMapper] = {}
    begin = Begin(final_lsn=1, commit_time_us=0, xid=1)
    found = {}
    for step in EXPECTED:
        for raw in messages(f"{plugin}-trace", step):
            for record in decode(raw):
                if isinstance(record, Relation):
                    mappers[record.relid] = RowMapper.for_relation(record, layout)
                elif isinstance(record, Insert):
                    found[step] = mappers[record.relid].event(record, begin)
    return found


@pytest.mark.parametrize("plugin", ["pgoutput", "wal2json"])
def test_captured_rows_carry_their_trace_headers(plugin: str) -> None:
    events = _events(plugin)
    assert set(events) == set(EXPECTED)
    router = Router()
    for step, expected in EXPECTED.items():
        message = router.route(events[step])
        assert message.headers[3:] == expected, step
    assert events["malformed traceparent"].trace is not None
    assert events["malformed traceparent"].trace.problem is not None
    assert events["debezium properties"].trace == TraceContext(PARENT, STATE, None)
    assert events["null trace"].trace is None
    assert events["empty trace"].trace is None


@pytest.mark.parametrize("plugin", ["pgoutput", "wal2json"])
def test_without_the_option_the_column_is_not_sent(plugin: str) -> None:
    router = Router()
    for event in _events(plugin, OutboxLayout()).values():
        assert event.trace is None
        assert [name for name, _ in router.route(event).headers] == [
            "id",
            "event_type",
            "aggregate_type",
        ]


def test_a_missing_trace_column_stops_at_its_relation() -> None:
    relation = next(
        record
        for raw in messages("pgoutput-trace", "plain traceparent")
        if isinstance(record := pgoutput.decode(raw), Relation)
    )
    with pytest.raises(SchemaError, match=r"no column tracecontext \(--trace-column\)"):
        RowMapper.for_relation(relation, OutboxLayout(trace_column="tracecontext"))


def test_the_poller_reads_the_same_text() -> None:
    """A claimed row's trace text (the column ::text) becomes the same trace context."""
    row = OutboxRow(
        id="e-1",
        aggregate_type="order",
        aggregate_id="o-1",
        event_type="order.traced",
        payload=b"{}",
        payload_type=3802,
        attempts=0,
        trace="#Tue Dec 02 15:16:00 UTC 2026\ntraceparent="
        + PARENT.decode()
        + "\ntracestate=rojo\\=00f067aa0ba902b7,congo\\=t61rcWkgMzE\n",
    )
    assert Router().route(row.event()).headers[3:] == EXPECTED["debezium properties"]
    assert dataclasses.replace(row, trace=None).event().trace is None


# -- the two forms ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stored", "expected"),
    [
        (PLAIN, TraceContext(PLAIN)),
        # a later version may add fields after a dash
        (b"01-" + PLAIN[3:] + b"-what-comes", TraceContext(b"01-" + PLAIN[3:] + b"-what-comes")),
        (b"traceparent=" + PARENT, TraceContext(PARENT)),
        (b"traceparent: " + PARENT, TraceContext(PARENT)),
        (b"traceparent " + PARENT + b"\ntracestate=", TraceContext(PARENT)),  # empty: none
        (
            b"! comment\r\n  traceparent = " + PARENT + b"\r\ntracestate=a\\=1,\\\n    b\\=2\n",
            TraceContext(PARENT, b"a=1,b=2"),
        ),
        (b"tracestate=a\\u003d1\ntraceparent=" + PARENT, TraceContext(PARENT, b"a=1")),
        # the last value of a key wins, as in Properties.load
        (b"traceparent=x\ntraceparent=" + PARENT, TraceContext(PARENT)),
        (b"", None),
        (b"  \n", None),
    ],
)
def test_parse(stored: bytes, expected: TraceContext | None) -> None:
    assert parse(stored) == expected


@pytest.mark.parametrize(
    "stored",
    [
        PLAIN.upper(),
        b" " + PLAIN,
        PLAIN[:-1],
        b"ff" + PLAIN[2:],
        PLAIN + b"-more",  # version 00 has no more fields
        b"00-" + b"0" * 32 + PLAIN[35:],
        PLAIN[:36] + b"0" * 16 + b"-01",
        b"garbage",
        PLAIN + b"\n",  # blanks around it aside, a plain one: kept as stored
    ],
)
def test_a_malformed_traceparent_is_kept_as_stored_with_its_problem(stored: bytes) -> None:
    trace = parse(stored)
    assert trace is not None
    assert trace.traceparent == stored
    assert trace.problem
    assert not trace.valid
    assert trace.headers() == [("traceparent", stored)]


def test_properties_without_traceparent_send_nothing_and_say_why() -> None:
    trace = parse(b"#Tue Dec 02\nuber-trace-id=abc\\:def\\:0\\:1\n")
    assert trace is not None
    assert trace.headers() == []
    assert trace.problem is not None
    assert "keys: uber-trace-id" in trace.problem


def test_load_properties_as_java_reads_them() -> None:
    text = (
        "# a comment \\\n"
        "key1 = value with trailing space \n"
        "key\\ 2:with\\:colon\\=eq\\tand tab\n"
        "cont = one\\\n"
        "   two\\\\\n"
        "empty\n"
        "\\#hash=\\u00e9\n"
    )
    assert load_properties(text) == {
        "key1": "value with trailing space ",
        "key 2": "with:colon=eq\tand tab",
        "cont": "onetwo\\",
        "empty": "",
        "#hash": "é",
    }


def test_traceparent_problem() -> None:
    assert traceparent_problem(PLAIN.decode()) is None
    assert traceparent_problem("01-" + PLAIN.decode()[3:]) is None
    assert "version ff" in str(traceparent_problem("ff" + PLAIN.decode()[2:]))


# -- the headers on every path --------------------------------------------------------------


def _event(trace: TraceContext | None, headers: tuple[tuple[str, bytes], ...] = ()) -> OutboxEvent:
    return OutboxEvent(
        "e-1", "order", "o-1", "order.traced", b"{}", 0, 0, 0, headers=headers, trace=trace
    )


def test_trace_headers_follow_the_header_columns_and_precede_cloudevents() -> None:
    router = Router(cloudevents=CloudEvents("/s"))
    message = router.route(_event(TraceContext(PARENT, STATE), (("region", b"eu"),)))
    assert [name for name, _ in message.headers] == [
        "id",
        "event_type",
        "aggregate_type",
        "region",
        "traceparent",
        "tracestate",
        "ce_specversion",
        "ce_id",
        "ce_source",
        "ce_type",
        "ce_subject",
        "ce_traceparent",
        "ce_tracestate",
        "content-type",
    ]
    values = dict(message.headers)
    assert values["traceparent"] == values["ce_traceparent"] == PARENT
    assert values["tracestate"] == values["ce_tracestate"] == STATE


def test_cloudevents_leave_the_extension_out_for_a_malformed_traceparent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    before = TRACE_CONTEXT_MALFORMED._value.get()
    message = Router(cloudevents=CloudEvents("/s")).route(_event(parse(MALFORMED)))
    names = [name for name, _ in message.headers]
    assert ("traceparent", MALFORMED) in message.headers
    assert "ce_traceparent" not in names
    assert "ce_tracestate" not in names
    assert TRACE_CONTEXT_MALFORMED._value.get() == before + 1
    [record] = [r for r in caplog.records if getattr(r, "action", "") == "trace_context_malformed"]
    assert record.levelname == "WARNING"
    assert "event e-1" in record.getMessage()
    assert "sent as stored" in record.getMessage()


def test_a_tracestate_cloudevents_cannot_carry_is_left_out_of_the_extension_only() -> None:
    message = Router(cloudevents=CloudEvents("/s")).route(_event(TraceContext(PARENT, b"a=\x01")))
    names = [name for name, _ in message.headers]
    assert ("tracestate", b"a=\x01") in message.headers
    assert "ce_traceparent" in names
    assert "ce_tracestate" not in names


def test_a_valid_trace_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    before = TRACE_CONTEXT_MALFORMED._value.get()
    Router().route(_event(TraceContext(PLAIN)))
    assert TRACE_CONTEXT_MALFORMED._value.get() == before
    assert not [r for r in caplog.records if getattr(r, "action", "") == "trace_context_malformed"]


def test_a_dead_letter_carries_the_trace_headers() -> None:
    message = Router().route(_event(TraceContext(PARENT, STATE)))
    letter = DeadLetters("", "slot", "dead").letter(
        message, KafkaError(KafkaError.MSG_SIZE_TOO_LARGE, "too large"), with_value=True
    )
    assert letter.headers[3:5] == [("traceparent", PARENT), ("tracestate", STATE)]


# -- the options ----------------------------------------------------------------------------


def test_the_trace_column_is_not_a_header_column_too() -> None:
    with pytest.raises(UsageError, match="leave it out of --header-column"):
        OutboxLayout.from_options([], ["tracingspancontext"], "tracingspancontext")
    with pytest.raises(UsageError, match="named like the trace context"):
        OutboxLayout.from_options([], ["TraceParent"], "tracingspancontext")
    with pytest.raises(UsageError, match="--trace-column is empty"):
        OutboxLayout.from_options([], [], " ")
    layout = OutboxLayout.from_options([], ["traceparent"], None)  # as before: a plain header
    assert layout.header_columns == ("traceparent",)
    assert layout.trace_column is None


@pytest.mark.parametrize(
    ("stored", "traceparent", "tracestate"),
    [
        # Java's Properties.store writes a character outside the BMP as its UTF-16 pair of
        # \u escapes; Properties.load joins them back into the one character.
        (
            b"traceparent=" + PLAIN + b"\ntracestate=vendor=caf\\u00e9\\ud83d\\ude00\n",
            PLAIN,
            "vendor=caf\u00e9\U0001f600".encode(),
        ),
        # A lone surrogate has no UTF-8 form: replaced (as Java's getBytes does), not raised.
        (b"traceparent=\\uD800" + PLAIN[1:] + b"\n", "\ufffd".encode() + PLAIN[1:], None),
        (b"traceparent=" + PLAIN + b"\ntracestate=a=\\udc00\n", PLAIN, "a=\ufffd".encode()),
    ],
)
def test_surrogate_escapes_never_stop_the_relay(
    stored: bytes, traceparent: bytes, tracestate: bytes | None
) -> None:
    trace = parse(stored)
    assert trace is not None
    assert trace.traceparent == traceparent
    assert trace.tracestate == tracestate
    # a row of it, mapped as the stream maps it, routes (the event is not stopped at)
    relation = Relation(
        1,
        "public",
        "outbox",
        tuple(
            Column(n, 25)
            for n in ("id", "aggregate_type", "aggregate_id", "event_type", "payload", "trace")
        ),
    )
    layout = OutboxLayout(trace_column="trace")
    mapper = RowMapper.for_relation(relation, layout)
    row = Insert(1, (b"1", b"order", b"42", b"created", b"{}", stored))
    event = mapper.event(row, Begin(0, 0, 1))
    assert event.trace == trace


def test_a_key_with_a_lone_surrogate_is_named_in_a_line_a_log_can_write() -> None:
    trace = parse(b"x\\uD800=1\n")
    assert trace is not None and trace.problem is not None
    trace.problem.encode()  # no lone surrogate in the message the router logs


@pytest.mark.parametrize(
    "stored",
    [
        b"00-" + b"x" * 1_000_000,  # a megabyte in the column, logged with every event
        b"x\\nERROR cdc_relay: forged=1\n" + b"k" * 1_000_000 + b"=1\n",  # keys of any size
    ],
)
def test_the_warning_of_a_malformed_trace_is_one_short_line(
    stored: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    message = Router().route(_event(parse(stored)))
    if b"\n" not in stored:  # the header is sent as stored, whatever its size
        assert message.headers[3] == ("traceparent", stored)
    (record,) = [r for r in caplog.records if getattr(r, "action", "") == "trace_context_malformed"]
    line = record.getMessage()
    assert "\n" not in line and "\r" not in line
    assert len(line) < 1_000
