"""Event -> Kafka message: topic from a template, key, value and headers.

Both relays (``stream`` and ``poll``) route through here, so they put byte-identical
messages on the wire.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass

from cdc_relay.errors import DeliveryError, UsageError
from cdc_relay.events import OutboxEvent
from cdc_relay.lsn import Lsn

DEFAULT_TOPIC_TEMPLATE = "outbox.event.{aggregate_type}"
TEMPLATE_FIELDS = frozenset({"aggregate_type", "event_type"})
_LEGAL_TOPIC = re.compile(r"^[A-Za-z0-9._-]{1,249}$")


@dataclass(frozen=True, slots=True)
class Message:
    topic: str
    key: bytes
    value: bytes | None
    headers: list[tuple[str, bytes]]
    lsn: Lsn = 0  # where the event was committed (0 when not from a slot); never sent


class Router:
    """Routes events to topics; key = aggregate_id, value = the payload bytes as stored."""

    def __init__(self, topic_template: str = DEFAULT_TOPIC_TEMPLATE) -> None:
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
        self._topics: dict[tuple[str, str], str] = {}

    def route(self, event: OutboxEvent) -> Message:
        return Message(
            topic=self.topic(event),
            key=event.aggregate_id.encode(),
            value=event.payload,
            headers=[
                ("id", event.id.encode()),
                ("event_type", event.event_type.encode()),
                ("aggregate_type", event.aggregate_type.encode()),
            ],
            lsn=event.commit_lsn,
        )

    def topic(self, event: OutboxEvent) -> str:
        cache_key = (event.aggregate_type, event.event_type)
        topic = self._topics.get(cache_key)
        if topic is None:
            topic = self._template.format(
                aggregate_type=event.aggregate_type, event_type=event.event_type
            )
            if not _LEGAL_TOPIC.match(topic):
                raise DeliveryError(
                    f"event {event.id} ({event.event_type}, aggregate {event.aggregate_id}) "
                    f"routes to {topic!r}, which is not a legal Kafka topic name "
                    "(letters, digits, '.', '_', '-', at most 249); fix its aggregate_type "
                    "or choose another --topic-template"
                )
            if len(self._topics) < 10_000:  # bounded: aggregate types are few in practice
                self._topics[cache_key] = topic
        return topic
