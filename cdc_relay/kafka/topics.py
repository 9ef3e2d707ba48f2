"""Kafka's rule on topic names, checked before a topic's first event.

Kafka takes ``.`` and ``_`` in a topic name for the same (its metrics write one for the
other), so a broker refuses to create ``orders.line`` once ``orders_line`` exists: "collides
with existing topic", said in its own log only. The producer hears that the topic is unknown
and waits ``topic.metadata.propagation.max.ms`` (30 s) before it gives the event up, saying
nothing meanwhile. So the sink asks, before the first event of a topic it has not sent to:
whether Kafka has the topic, and if not, whether Kafka has (or this relay sends to) one
it collides with. Such an event is refused at once, as the client refuses a message it cannot
send (sink.KafkaSink.offer), with the topic it collides with; the refusal policy decides the
rest (cdc_relay.kafka.refusals).

Kafka's topics are its own record, so the check holds across restarts.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection


def collides(topic: str, other: str) -> bool:
    """Whether Kafka refuses to have both topics: they differ, but only in ``.`` and ``_``."""
    return topic != other and topic.replace(".", "_") == other.replace(".", "_")


class Topics:
    """The topics the sinks of one relay may send to, each checked once; shared by a poll
    relay's workers (thread-safe), so two of them cannot start two colliding topics."""

    def __init__(self) -> None:
        # Read without the lock, per event: a topic is added once it may be sent to.
        self.checked: set[str] = set()
        self._listed: frozenset[str] = frozenset()  # Kafka's topics, as last listed
        self._lock = threading.Lock()

    def collision(self, topic: str, listing: Callable[[], Collection[str] | None]) -> str | None:
        """The topic ``topic`` collides with, if any, which Kafka has or this relay sends to;
        ``listing`` lists Kafka's topics (None: Kafka did not answer, and ``topic`` stays
        unchecked). Listed again only for a topic not in the last listing."""
        with self._lock:
            if topic in self.checked:
                return None
            if topic not in self._listed:
                listed = listing()
                if listed is None:
                    return None
                self._listed = frozenset(listed)
            if topic in self._listed:  # it exists: Kafka made it, so nothing collides with it
                self.checked.add(topic)
                return None
            other = next(
                (t for t in sorted(self._listed | self.checked) if collides(topic, t)), None
            )
            if other is None:
                self.checked.add(topic)
            return other

    def forget(self, topic: str) -> None:
        """Kafka said it does not know ``topic``: checked again before its next event (another
        relay may have made one it collides with, which the last listing did not show)."""
        with self._lock:
            self.checked.discard(topic)
            self._listed -= {topic}
