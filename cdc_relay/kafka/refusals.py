"""The error policy for what Kafka answers about one event: retry, isolate or refuse.

A delivery report's error does not always belong to the message it is reported for. Kafka
refuses a whole batch when one record in it is too large, invalid for the topic or not
authorised, and every message of the batch is reported with that error; the gapless
guarantee (cdc_relay.kafka.sink) then fails whatever else the producer held. So a refusal reported
for a message among others only makes it a *suspect*: the stream replays from the slot's
confirmed position and sends each suspect alone. A message refused alone, or refused by the
client before it was queued, is the *culprit*, and only a culprit is dead-lettered or stops
the relay. Errors that a later try may not meet again are retried; errors the user must fix
stop the relay. What a relay does with each is its ``RefusalPolicy``, declared here.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from typing import Any, Protocol

from confluent_kafka import KafkaError

from cdc_relay.errors import DeliveryError, RelayError
from cdc_relay.kafka.routing import Message
from cdc_relay.lsn import format_lsn
from cdc_relay.metrics import count_failed

log = logging.getLogger(__name__)


class Fate(enum.Enum):
    ISOLATE = "isolate"  # a permanent refusal, or collateral: send alone to find the culprit
    RETRY = "retry"  # may not happen again: replay after a pause
    STOP = "stop"  # the producer or the relay's credentials: the user must act


# Permanent answers about one record (its size, its topic, its key): when the message was
# alone, it is the one Kafka refuses.
PER_MESSAGE = frozenset(
    {
        KafkaError.MSG_SIZE_TOO_LARGE,
        KafkaError.INVALID_RECORD,
        KafkaError.INVALID_MSG,
        KafkaError.RECORD_LIST_TOO_LARGE,
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.TOPIC_EXCEPTION,
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError._UNKNOWN_TOPIC,
        KafkaError._UNKNOWN_PARTITION,
        KafkaError.POLICY_VIOLATION,
        KafkaError._INVALID_ARG,
    }
)
# Answers about another message than the one they are reported for.
COLLATERAL = frozenset(
    {
        KafkaError._INVALID_DIFFERENT_RECORD,
        KafkaError._GAPLESS_GUARANTEE,
        KafkaError._FATAL,
        KafkaError._PURGE_QUEUE,
        KafkaError._PURGE_INFLIGHT,
    }
)
# Answers no replay changes.
STOPPING = frozenset(
    {
        KafkaError._AUTHENTICATION,
        KafkaError.CLUSTER_AUTHORIZATION_FAILED,
        KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
        KafkaError._FENCED,
        KafkaError.PRODUCER_FENCED,
    }
)


class RefusalPolicy(Protocol):
    """What the loop does with what Kafka refuses (a stage of the pipeline: see
    cdc_relay.relay.stages); the functions below say which refusal is whose. The stream
    rewinds to its confirmed position; a poll worker marks the row for a later try and holds
    its aggregate back."""

    def refused(self, token: Any, err: KafkaError) -> None:
        """Kafka refused ``token``'s message among others: a suspect (called while the sink
        serves its reports; ``served`` acts on it)."""

    def served(self) -> None:
        """Reports were served: act on the refusals among them (the stream raises Rewind)."""

    def culprit(self, message: Message, token: Any, err: KafkaError) -> None:
        """The message's own refusal, for certain: the client refused it, or Kafka refused it
        sent alone."""

    def retry(self, token: Any, err: KafkaError) -> None:
        """Sent alone, it was refused for a reason not about it: a later try."""

    def cleared(self, token: Any) -> None:
        """Sent alone, it was acknowledged: no longer a suspect."""

    def unroutable(self, token: Any, exc: RelayError) -> None:
        """The router cannot make a message of it (no legal topic, no payload)."""


def fate(err: KafkaError) -> Fate:
    """What the stream does about a refusal reported for a message among others."""
    code = err.code()
    if code in PER_MESSAGE or code in COLLATERAL:
        return Fate.ISOLATE
    if code in STOPPING:
        return Fate.STOP
    return Fate.RETRY


def is_culprit(err: KafkaError) -> bool:
    """Whether ``err``, reported for a message that was alone, is a refusal of that message."""
    return err.code() in PER_MESSAGE


def header(message: Message, name: str) -> str:
    for key, value in message.headers:
        if key == name:
            return value.decode(errors="replace")
    return "?"


def log_refusal(emit: Callable[..., None], text: str, message: Message, err: KafkaError) -> None:
    """One log line with the event's stable fields and Kafka's reason."""
    emit(
        "%s: %s",
        text,
        err.str(),
        extra={
            "action": "event_refused",
            "event_id": header(message, "id"),
            "event_type": header(message, "event_type"),
            "aggregate_id": message.key.decode(errors="replace") if message.key else None,
            "lsn": format_lsn(message.lsn) if message.lsn else None,
            "error": err.str(),
        },
    )


_REMEDIES = {
    KafkaError.MSG_SIZE_TOO_LARGE: "raise max.message.bytes of the topic (or message.max.bytes "
    "of the broker) and, above 1 MB, --kafka-config message.max.bytes; make the event "
    "smaller, or pass --dead-letter-topic",
    KafkaError.TOPIC_AUTHORIZATION_FAILED: "grant the relay's principal WRITE on the topic, or "
    "pass --dead-letter-topic",
    KafkaError.UNKNOWN_TOPIC_OR_PART: "create the topic (the broker does not create topics on "
    "demand), or start the relay with --create-topics, or pass --dead-letter-topic",
    KafkaError._UNKNOWN_TOPIC: "create the topic (the broker does not create topics on demand), "
    "or start the relay with --create-topics, or pass --dead-letter-topic",
    KafkaError.INVALID_RECORD: "the topic refuses this record (a compacted topic needs a key: "
    "give the event an aggregate_id), or pass --dead-letter-topic",
    # Kafka will not create the topic (cdc_relay.kafka.topics): no restart changes that.
    KafkaError.TOPIC_EXCEPTION: "pass --dead-letter-topic to set such events aside, and give "
    "new events a topic Kafka accepts (another aggregate type, or another --topic-template)",
}


def refusal_error(message: Message, err: KafkaError, relay: str) -> DeliveryError:
    """The relay stops at ``message``: counted, logged, and the one-line error with a remedy."""
    event_id = header(message, "id")
    event_type = header(message, "event_type")
    aggregate_id = message.key.decode(errors="replace") if message.key else "(none)"
    remedy = _REMEDIES.get(
        err.code(), "fix the cause and restart the relay; it resumes from this event"
    )
    count_failed(relay, event_type)
    log_refusal(log.error, "event refused", message, err)
    return DeliveryError(
        f"Kafka refused event {event_id} ({event_type}, aggregate {aggregate_id}) "
        f"for topic {message.topic}: {err.str()}; nothing from it on was confirmed: {remedy}"
    )
