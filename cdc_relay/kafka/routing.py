"""Event -> Kafka message: topic from a template, key, value and headers.

Both relays (``stream`` and ``poll``) route through here, so they put byte-identical
messages on the wire.
"""

from __future__ import annotations

import hashlib
import logging
import re
import string
import threading
from dataclasses import dataclass

from cdc_relay.errors import UsageError
from cdc_relay.events import HEADERS, OutboxEvent, SchemaError
from cdc_relay.kafka.cloudevents import CloudEvents
from cdc_relay.lsn import Lsn
from cdc_relay.metrics import TRACE_CONTEXT_MALFORMED
from cdc_relay.tracecontext import shown

log = logging.getLogger(__name__)

DEFAULT_TOPIC_TEMPLATE = "outbox.event.{aggregate_type}"
TEMPLATE_FIELDS = frozenset({"aggregate_type", "event_type", "schema", "table"})
# The outbox table's schema and name: only stream knows them per event (several tables).
TABLE_FIELDS = frozenset({"schema", "table"})
_ILLEGAL_TOPIC_CHARS = re.compile(r"[^A-Za-z0-9._-]")
_MAX_TOPIC = 249
_ID, _EVENT_TYPE, _AGGREGATE_TYPE = HEADERS  # every message's first headers, in this order


@dataclass(init=False, slots=True)
class Message:
    """A Kafka message, made per event: never changed once made (not frozen, which would
    cost four times as much to make, bench/per_stage.py; its ``__init__`` and ``__reduce__``
    written for the compiled build, as cdc_relay.events says of Insert)."""

    topic: str
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]
    lsn: Lsn = 0  # where the event was committed (0 when not from a slot); never sent

    def __init__(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: list[tuple[str, bytes]],
        lsn: Lsn = 0,
    ) -> None:
        self.topic = topic
        self.key = key
        self.value = value
        self.headers = headers
        self.lsn = lsn

    def __reduce__(
        self,
    ) -> tuple[type[Message], tuple[str, bytes | None, bytes | None, list[tuple[str, bytes]], Lsn]]:
        return (Message, (self.topic, self.key, self.value, self.headers, self.lsn))


class TopicTaken(SchemaError):
    """Two names the template made are one topic once made legal (``legal_topic``): the
    second the router met is refused. ``message`` is where its event would have gone, for a
    dead letter."""

    def __init__(self, text: str, message: Message) -> None:
        super().__init__(text)
        self.message = message


def legal_topic(name: str) -> str:
    """A legal Kafka topic name for ``name``: characters outside ``[A-Za-z0-9._-]`` become
    ``_``; a name over 249 characters is cut and ends in 8 hex digits of its SHA-1, so two
    long names stay apart."""
    topic = _ILLEGAL_TOPIC_CHARS.sub("_", name)
    if topic in ("", ".", ".."):
        topic = topic.replace(".", "_") or "_"
    if len(topic) > _MAX_TOPIC:
        digest = hashlib.sha1(name.encode(), usedforsecurity=False).hexdigest()[:8]
        topic = f"{topic[: _MAX_TOPIC - 9]}-{digest}"
    return topic


_TEMPLATE_RULE = (
    "a template may use {aggregate_type} and {event_type}, and with stream {schema} and "
    "{table} of the event's outbox table, as they are (no conversion, format spec, attribute "
    "or index), and {{ and }} for literal braces"
)


def _fields(template: str) -> list[tuple[str, str | None, str | None, str | None]]:
    try:
        return list(string.Formatter().parse(template))
    except ValueError as exc:
        raise UsageError(f"--topic-template {template!r}: {exc}; {_TEMPLATE_RULE}") from None


def table_fields(template: str) -> frozenset[str]:
    """The fields of ``template`` (a checked one) that name the event's outbox table."""
    return frozenset(name for _, name, _, _ in _fields(template) if name in TABLE_FIELDS)


def fill_table(template: str, schema: str, table: str) -> str:
    """``template`` with ``{schema}`` and ``{table}`` filled in, the other fields left as they
    are: for a tool that knows the one outbox table (trace)."""
    out = []
    for text, name, spec, conversion in _fields(template):
        out.append(_braces(text))
        if name in TABLE_FIELDS:
            out.append(_braces(schema if name == "schema" else table))
        elif name is not None:
            field = name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "")
            out.append("{" + field + "}")
    return "".join(out)


def _braces(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")


def check_template(template: str) -> str:
    """``template`` if every topic it makes can be legal; a UsageError saying why not otherwise.

    ``str.format`` would take much more (``{}``, ``{0}``, ``{aggregate_type!r:>9}``, ...),
    and fail only at the first event; the template is checked once, at start-up.
    """
    parts = _fields(template)
    fixed = "".join(text for text, _, _, _ in parts)
    fields = 0
    for _, name, spec, conversion in parts:
        if name is None:
            continue
        if name not in TEMPLATE_FIELDS or spec or conversion:
            field = "{" + name + (f"!{conversion}" if conversion else "")
            field += (f":{spec}" if spec else "") + "}"
            raise UsageError(f"--topic-template {template!r}: {field} is refused; {_TEMPLATE_RULE}")
        fields += 1
    if not fields and legal_topic(fixed) != fixed:
        raise UsageError(
            f"--topic-template {template!r} names no field, so it is one topic for every event, "
            "and that is not a legal topic name: use 1 to 249 of A-Z a-z 0-9 . _ -, "
            "not . or .."
        )
    if len(fixed) > _MAX_TOPIC:
        raise UsageError(
            f"--topic-template is {len(fixed)} characters without its fields; a Kafka topic "
            f"name has at most {_MAX_TOPIC}"
        )
    return template


def could_make(template: str, topic: str) -> bool:
    """Whether ``template`` (a checked one) can name a topic ``topic``: its text as it is,
    each field some text."""
    pattern = "".join(
        re.escape(text) + ("" if name is None else ".+") for text, name, _, _ in _fields(template)
    )
    return re.fullmatch(pattern, topic) is not None


def aggregate_topic(template: str, aggregate_type: str) -> str | None:
    """The topic ``template`` (a checked one) names for ``aggregate_type``, its other fields
    shown as they are; None if it does not name topics by aggregate type."""
    if not any(name == "aggregate_type" for _, name, _, _ in _fields(template)):
        return None
    shown = {name: "{" + name + "}" for name in TEMPLATE_FIELDS}
    return template.format_map(shown | {"aggregate_type": aggregate_type})


class Router:
    """Routes events to topics; key = aggregate_id, value = the payload bytes as stored;
    headers: the event's own three, its header columns, its trace context (``traceparent``,
    ``tracestate``), and with ``cloudevents`` the CloudEvents headers after the others.

    ``by_table``: the relay names each event's outbox table (``OutboxEvent.source``), so the
    template may use ``{schema}`` and ``{table}``; otherwise they are refused here, at start-up.
    """

    def __init__(
        self,
        topic_template: str = DEFAULT_TOPIC_TEMPLATE,
        tombstone_on_empty: bool = False,
        cloudevents: CloudEvents | None = None,
        by_table: bool = False,
    ) -> None:
        check_template(topic_template)
        fields = table_fields(topic_template)
        if fields and not by_table:
            raise UsageError(
                f"--topic-template {topic_template!r}: "
                f"{' and '.join('{' + name + '}' for name in sorted(fields))} name the outbox "
                "table of a row, which only cdc-relay stream tells apart; poll relays one "
                "table: write its schema and name into the template"
            )
        self._template = topic_template
        self._tombstone_on_empty = tombstone_on_empty
        self._cloudevents = cloudevents
        self._by_table = bool(fields)  # the topic depends on the table too
        self._topics: dict[tuple[object, ...], str] = {}
        # Each topic made, with the name the template made it from (and the aggregate type
        # in it): a topic is one name's. Kept for every topic, not bounded like the cache:
        # there are no more of them than topics in Kafka.
        self._names: dict[str, tuple[str, str]] = {}
        # The template names the aggregate type only: a refusal names the two types.
        self._by_type = {name for _, name, _, _ in _fields(topic_template) if name} == {
            "aggregate_type"
        }
        # Several poll workers share a router: two names must not take one topic at once.
        self._lock = threading.Lock()

    def route(self, event: OutboxEvent) -> Message:
        # First: it refuses an event without the attributes CloudEvents requires.
        cloudevents = None if self._cloudevents is None else self._cloudevents.headers(event)
        headers = [
            (_ID, event.id.encode()),
            (_EVENT_TYPE, event.event_type.encode()),
            (_AGGREGATE_TYPE, event.aggregate_type.encode()),
        ]
        if event.headers:
            headers.extend(event.headers)
        if event.trace is not None:
            headers.extend(event.trace.headers())
            if event.trace.problem is not None:
                _malformed(event)
        if cloudevents:
            headers.extend(cloudevents)
        # Per event: the common cases inline (a cached topic, a payload), the rest in methods.
        topic = (
            self._topics.get((event.aggregate_type, event.event_type, event.source))
            if self._by_table
            else self._topics.get((event.aggregate_type, event.event_type))
        )
        taken = None
        if topic is None:
            topic, taken = self._topic(event)
        message = Message(
            topic,
            None if event.aggregate_id is None else event.aggregate_id.encode(),
            event.payload if event.payload else self._value(event),
            headers,
            event.commit_lsn,
        )
        if taken is not None:
            raise TopicTaken(taken, message)
        return message

    def _value(self, event: OutboxEvent) -> bytes | None:
        if event.payload:
            return event.payload
        if self._tombstone_on_empty:
            return None  # a tombstone: compacted topics forget the key
        if event.payload is None:
            raise SchemaError(
                f"event {event.id} ({event.event_type}, aggregate {event.aggregate_id}) has a "
                "NULL payload; give it one, or pass --tombstone-on-empty-payload to publish "
                "NULL and empty payloads as tombstones"
            )
        return event.payload  # empty: published as an empty value

    def _topic(self, event: OutboxEvent) -> tuple[str, str | None]:
        """The topic of ``event``, and why it is refused (None: it is not)."""
        cache_key: tuple[object, ...] = (event.aggregate_type, event.event_type)
        schema = table = ""
        if self._by_table:
            if event.source is None:
                raise SchemaError(
                    f"event {event.id} ({event.event_type}, aggregate {event.aggregate_id}) "
                    "came as a logical decoding message, which belongs to no table, and "
                    f"--topic-template {self._template!r} names the outbox table; write such "
                    "events as rows of their outbox table, or send them with a prefix this "
                    "relay's --message-prefix does not take"
                )
            cache_key = (*cache_key, event.source)
            schema, table = event.source
        topic = self._topics.get(cache_key)
        if topic is not None:
            return topic, None
        name = self._template.format(
            aggregate_type=event.aggregate_type,
            event_type=event.event_type,
            schema=schema,
            table=table,
        )
        topic = legal_topic(name)
        with self._lock:
            first = self._names.setdefault(topic, (name, event.aggregate_type))
            if first[0] != name:
                # Not cached: each of its events is refused, and says so.
                return topic, self._taken(event, topic, name, first)
            if len(self._topics) < 10_000:  # bounded: aggregate types are few in practice
                self._topics[cache_key] = topic
        return topic, None

    def _taken(self, event: OutboxEvent, topic: str, name: str, first: tuple[str, str]) -> str:
        """Why ``event`` may not go to ``topic``, which ``first`` (a name and its aggregate
        type) made before ``name``: its consumers would take the two for one. Which came
        first is this router's memory, not Kafka's: a restarted relay may meet them the
        other way round."""
        if self._by_type:
            both = (
                f"aggregate types {event.aggregate_type!r} and {first[1]!r} both make topic {topic}"
            )
        else:
            both = (
                f"--topic-template {self._template!r} makes topic {topic} of {name!r} and of "
                f"{first[0]!r}"
            )
        return (
            f"{both} (characters Kafka does not allow in a topic name become _), and one "
            f"topic must not mix them unnoticed: event {event.id} ({event.event_type}, "
            f"aggregate {event.aggregate_id}), of the second this relay met, is refused. "
            "Rename one of them, or make --topic-template keep them apart; events already "
            "written keep their name: stream sets them aside with --dead-letter-topic, poll "
            "after --max-attempts"
        )


def _malformed(event: OutboxEvent) -> None:
    """Tell of a trace context that is no W3C one. A traceparent goes out as stored (a W3C
    receiver ignores a malformed one and starts a trace of its own), so nothing the
    application wrote is lost; the log names the event, the counter totals them."""
    TRACE_CONTEXT_MALFORMED.inc()
    trace = event.trace
    if trace is None:
        return
    if trace.traceparent is None:
        what = f"the --trace-column value {trace.problem}; write traceparent (and tracestate) there"
    else:
        what = (
            f"its traceparent {shown(trace.traceparent)} (--trace-column) "
            f"{trace.problem}; sent as stored, a receiver ignores it (and with --cloudevents "
            "no ce_traceparent): fix what the application writes there"
        )
    log.warning(
        "event %s (%s, aggregate %s): %s",
        event.id,
        event.event_type,
        event.aggregate_id,
        what,
        extra={
            "action": "trace_context_malformed",
            "event_id": event.id,
            "event_type": event.event_type,
            "aggregate_id": event.aggregate_id,
        },
    )
