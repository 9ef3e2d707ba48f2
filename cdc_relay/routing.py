"""Event -> Kafka message: topic from a template, key, value and headers.

Both relays (``stream`` and ``poll``) route through here, so they put byte-identical
messages on the wire.
"""

from __future__ import annotations

import hashlib
import re
import string
from dataclasses import dataclass

from cdc_relay.errors import UsageError
from cdc_relay.events import OutboxEvent, SchemaError
from cdc_relay.lsn import Lsn

DEFAULT_TOPIC_TEMPLATE = "outbox.event.{aggregate_type}"
TEMPLATE_FIELDS = frozenset({"aggregate_type", "event_type"})
_ILLEGAL_TOPIC_CHARS = re.compile(r"[^A-Za-z0-9._-]")
_MAX_TOPIC = 249


@dataclass(frozen=True, slots=True)
class Message:
    topic: str
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]
    lsn: Lsn = 0  # where the event was committed (0 when not from a slot); never sent


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


class Router:
    """Routes events to topics; key = aggregate_id, value = the payload bytes as stored."""

    def __init__(
        self, topic_template: str = DEFAULT_TOPIC_TEMPLATE, tombstone_on_empty: bool = False
    ) -> None:
        try:
            fields = {name for _, name, _, _ in string.Formatter().parse(topic_template) if name}
        except ValueError as exc:
            raise UsageError(f"--topic-template {topic_template!r}: {exc}") from None
        unknown = fields - TEMPLATE_FIELDS
        if unknown:
            raise UsageError(
                f"--topic-template names {', '.join(sorted(unknown))}; "
                f"it may use only {{{'}, {'.join(sorted(TEMPLATE_FIELDS))}}}"
            )
        self._template = topic_template
        self._tombstone_on_empty = tombstone_on_empty
        self._topics: dict[tuple[str, str], str] = {}

    def route(self, event: OutboxEvent) -> Message:
        headers = [
            ("id", event.id.encode()),
            ("event_type", event.event_type.encode()),
            ("aggregate_type", event.aggregate_type.encode()),
        ]
        if event.headers:
            headers.extend(event.headers)
        return Message(
            topic=self.topic(event),
            key=None if event.aggregate_id is None else event.aggregate_id.encode(),
            value=self._value(event),
            headers=headers,
            lsn=event.commit_lsn,
        )

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

    def topic(self, event: OutboxEvent) -> str:
        cache_key = (event.aggregate_type, event.event_type)
        topic = self._topics.get(cache_key)
        if topic is None:
            topic = legal_topic(
                self._template.format(
                    aggregate_type=event.aggregate_type, event_type=event.event_type
                )
            )
            if len(self._topics) < 10_000:  # bounded: aggregate types are few in practice
                self._topics[cache_key] = topic
        return topic
