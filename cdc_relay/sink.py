"""The Kafka side: an idempotent confluent-kafka producer with delivery reports.

The sink never flushes per message. ``offer`` returns False when the local queue is full, so
the caller can keep the replication connection alive while it waits (back-pressure).
"""

from __future__ import annotations

import functools
import json
import logging
import re
import time
from collections.abc import Callable, Mapping
from typing import Any, cast

from confluent_kafka import KafkaError, KafkaException, Producer

from cdc_relay.errors import DeliveryError, KafkaUnavailableError, UsageError
from cdc_relay.lsn import format_lsn
from cdc_relay.metrics import EVENTS_FAILED
from cdc_relay.routing import Message

log = logging.getLogger(__name__)
# librdkafka's own lines, through our handlers instead of raw stderr
_KAFKA_LOG = logging.getLogger("cdc_relay.kafka")

# Settings the relay's guarantees rest on; a user may not weaken them.
REQUIRED = {"enable.idempotence": "true", "acks": "all"}

DEFAULTS = {
    "client.id": "cdc-relay",
    "compression.type": "lz4",
    "linger.ms": "10",
    # Java clients' partitioner: a key lands where Debezium and Java producers put it.
    "partitioner": "murmur2_random",
    # Retriable failures (broker down) are retried until the broker is back: the relay waits,
    # it does not drop or crash. Permanent refusals still come back at once.
    "message.timeout.ms": "0",
    "queue.buffering.max.messages": "100000",
    "queue.buffering.max.kbytes": "131072",
    # Statistics tell whether a broker connection is up (readiness, cdc_relay_connected).
    "statistics.interval.ms": "5000",
}


def producer_config(bootstrap: str, overrides: Mapping[str, str]) -> dict[str, str]:
    """The producer configuration: our defaults, the user's settings, then the guarantees."""
    for key, required in REQUIRED.items():
        given = overrides.get(key)
        if given is not None and given.lower() not in (required, "-1"):
            raise UsageError(
                f"--kafka-config {key}={given} would let events be lost or reordered; "
                f"cdc-relay needs {key}={required}: remove the setting"
            )
    return {**DEFAULTS, "bootstrap.servers": bootstrap, **overrides, **REQUIRED}


# Answers that no retry will change: start-up stops at once with the broker's reason.
_REFUSALS = (KafkaError._AUTHENTICATION, KafkaError._SSL)

Acked = Callable[[Any], None]
Refused = Callable[[Any, KafkaError], None]


class KafkaSink:
    """Produces routed messages and reports each acknowledgement with the caller's token."""

    def __init__(
        self,
        config: Mapping[str, str],
        on_ack: Acked,
        relay: str = "stream",
        dead_letter_topic: str | None = None,
        on_refused: Refused | None = None,
    ) -> None:
        self._config = dict(config)
        self._relay = relay
        self._on_ack = on_ack
        # The poller's way: each refused event is reported with its token and the sink goes
        # on (the poller retries the row later). Without it, a refusal stops the relay.
        self._on_refused = on_refused
        self._dead_letter_topic = dead_letter_topic
        # Refused messages waiting to go to the dead-letter topic (produced from poll, not
        # from inside a delivery report, where the queue may be full).
        self._to_dead_letter: list[tuple[Message, KafkaError, int, Any]] = []
        self.failure: DeliveryError | None = None
        self.connected = False
        # The last error the client reported, for the message of a failed start.
        self._last_error: KafkaError | None = None
        self._checking = False
        try:
            self._producer = Producer(
                {
                    **self._config,
                    "error_cb": self._on_error,
                    "stats_cb": self._on_stats,
                    "logger": _KAFKA_LOG,
                }
            )
        except KafkaException as exc:
            raise UsageError(f"Kafka client settings: {exc.args[0].str()}") from None

    def check_reachable(self, timeout: float) -> None:
        """Fail fast, with a remedy, when no broker answers, or one refuses the relay's TLS
        settings or credentials (at once: waiting would not change its answer)."""
        deadline = time.monotonic() + timeout
        self._checking = True
        _KAFKA_LOG.addFilter(_connection_failures)
        try:
            while True:
                try:
                    self._producer.list_topics(timeout=min(1.0, deadline - time.monotonic()))
                    break
                except KafkaException:
                    self._producer.poll(0.1)  # serves the error callbacks
                    refused = self._last_error is not None and self._last_error.code() in _REFUSALS
                    if refused or time.monotonic() >= deadline - 0.01:
                        raise KafkaUnavailableError(self._unreachable(timeout)) from None
        finally:
            self._checking = False
            _KAFKA_LOG.removeFilter(_connection_failures)
        self.connected = True

    def _unreachable(self, timeout: float) -> str:
        where = self._config["bootstrap.servers"]
        err = self._last_error
        # librdkafka's text without the broker's name before it and the timing after it
        reason = re.sub(r"^\S+/\S+: | \(after \d+ms in state \w+\)$", "", err.str()) if err else ""
        if err is not None and err.code() == KafkaError._AUTHENTICATION:
            return (
                f"Kafka at {where} refused the relay's credentials: {reason}; check "
                "sasl.mechanisms, sasl.username and the password (CDC_RELAY_KAFKA_SASL_PASSWORD, "
                "or sasl.password in --kafka-config-file)"
            )
        if err is not None and err.code() == KafkaError._SSL:
            return (
                f"TLS with Kafka at {where} failed: {reason}; ssl.ca.location must name the CA "
                "that signed the broker's certificate, and that certificate the broker's host"
            )
        protocol = self._config.get("security.protocol", "plaintext").upper()
        return (
            f"no Kafka broker answered at {where} within {timeout:g}s"
            + (f" ({reason})" if reason else "")
            + f"; check --kafka-bootstrap, that the broker is running, and that "
            f"security.protocol={protocol} is what its listener there speaks"
        )

    def offer(self, message: Message, token: Any) -> bool:
        """Hand a message to the producer; False when its queue is full (poll, then retry)."""
        try:
            self._produce(
                message,
                # The headers name the event if Kafka refuses it: delivery reports lack them.
                functools.partial(self._delivered, token, message.headers, message.lsn),
            )
        except BufferError:
            return False
        except KafkaException as exc:
            if self._on_refused is not None:
                _refused(message, exc.args[0], self._relay)  # logged and counted
                self._on_refused(token, exc.args[0])
            elif self._dead_letter_topic is None:
                raise _refused(message, exc.args[0], self._relay) from None
            else:
                self._to_dead_letter.append(
                    (message, exc.args[0], len(message.value or b""), token)
                )
        return True

    def _produce(self, message: Message, on_delivery: Callable[..., None]) -> None:
        self._producer.produce(
            message.topic,
            value=message.value,
            key=message.key,
            headers=cast(list[tuple[str, str | bytes | None]], message.headers),
            on_delivery=on_delivery,
        )

    def poll(self, timeout: float = 0) -> None:
        """Serve delivery reports (calls ``on_ack``); raise if Kafka refused an event."""
        self._producer.poll(timeout)
        if self._to_dead_letter:
            self._send_dead_letters()
        if self.failure is not None:
            raise self.failure

    def _send_dead_letters(self) -> None:
        """Refused events go to the dead-letter topic: same key and headers, no value, the
        error in headers. Their acknowledgement stands for the refused event's."""
        while self._to_dead_letter:
            message, err, size, token = self._to_dead_letter[0]
            letter = Message(
                topic=str(self._dead_letter_topic),
                key=message.key,
                value=None,
                headers=[
                    *message.headers,
                    ("error", err.str().encode()),
                    ("error_code", str(err.name()).encode()),
                    ("original_topic", message.topic.encode()),
                    ("payload_bytes", str(size).encode()),
                ],
                lsn=message.lsn,
            )
            try:
                self._produce(letter, functools.partial(self._dead_lettered, token, letter))
            except BufferError:
                return  # the next poll tries again
            except KafkaException as exc:
                self.failure = _refused(letter, exc.args[0], self._relay)
                return
            self._to_dead_letter.pop(0)
            _log_event(log.warning, "event sent to the dead-letter topic", message, err)
            EVENTS_FAILED.labels(relay=self._relay, event_type=_header(message, "event_type")).inc()

    def _dead_lettered(self, token: Any, letter: Message, err: KafkaError | None, _: Any) -> None:
        if err is None:
            self._on_ack(token)
        elif self.failure is None:
            self.failure = _refused(letter, err, self._relay)

    def settle(self, timeout: float) -> None:
        """Serve delivery reports for up to ``timeout`` seconds, or until none is outstanding.

        Does not raise for a refused event: when stopping, the acks of the others still count.
        """
        self._producer.flush(timeout)

    def in_flight(self) -> int:
        """Messages handed to the producer and not yet reported."""
        return len(self._producer)

    def close(self) -> int:
        """Close the producer; return how many messages were still unacknowledged."""
        left = len(self._producer)
        self._producer.purge()
        self._producer.flush(0)
        return left

    def _delivered(
        self,
        token: Any,
        headers: list[tuple[str, bytes]],
        message_lsn: int,
        err: KafkaError | None,
        msg: Any,
    ) -> None:
        if err is None:
            self.connected = True
            self._on_ack(token)
            return
        refused = Message(msg.topic(), msg.key(), None, headers, message_lsn)
        if self._on_refused is not None:
            _refused(refused, err, self._relay)  # logged and counted
            self._on_refused(token, err)
        elif self._dead_letter_topic is not None:
            self._to_dead_letter.append((refused, err, len(msg), token))
        elif self.failure is None:
            self.failure = _refused(refused, err, self._relay)

    def _on_stats(self, stats_json: str) -> None:
        try:
            brokers = json.loads(stats_json).get("brokers", {}).values()
        except ValueError:
            return
        self.connected = any(b.get("state") == "UP" and b.get("nodeid", -1) >= 0 for b in brokers)

    def _on_error(self, err: KafkaError) -> None:
        # While start-up checks the broker, errors go into its exception, not into the log.
        if err.code() == KafkaError._ALL_BROKERS_DOWN:
            self.connected = False
            if not self._checking:
                log.warning("kafka unreachable, retrying", extra={"action": "kafka_down"})
        elif err.fatal():
            self.failure = DeliveryError(f"Kafka producer failed: {err.str()}")
        else:
            self._last_error = err
            if not self._checking:
                log.warning("kafka: %s", err.str(), extra={"action": "kafka_error"})


def _connection_failures(record: logging.LogRecord) -> bool:
    """False for librdkafka's lines about a failed connection (facility FAIL), kept out of the
    log while start-up checks the broker: the check's error tells the reason once."""
    return not (isinstance(record.args, tuple) and record.args[:1] == ("FAIL",))


def _header(message: Message, name: str) -> str:
    for key, value in message.headers:
        if key == name:
            return value.decode(errors="replace")
    return "?"


def _log_event(emit: Callable[..., None], text: str, message: Message, err: KafkaError) -> None:
    emit(
        text,
        extra={
            "action": "event_refused",
            "event_id": _header(message, "id"),
            "event_type": _header(message, "event_type"),
            "aggregate_id": message.key.decode(errors="replace") if message.key else None,
            "lsn": format_lsn(message.lsn) if message.lsn else None,
            "error": err.str(),
        },
    )


def _refused(message: Message, err: KafkaError, relay: str) -> DeliveryError:
    event_id = _header(message, "id")
    event_type = _header(message, "event_type")
    aggregate_id = message.key.decode(errors="replace") if message.key else "?"
    remedy = {
        KafkaError.MSG_SIZE_TOO_LARGE: "raise message.max.bytes (broker or topic) and "
        "--kafka-config message.max.bytes, make the event smaller, or pass "
        "--dead-letter-topic",
        KafkaError.TOPIC_AUTHORIZATION_FAILED: "grant the relay's principal WRITE on the topic",
    }.get(err.code(), "fix the cause and restart the relay; it resumes from this event")
    EVENTS_FAILED.labels(relay=relay, event_type=event_type).inc()
    _log_event(log.error, "event refused", message, err)
    return DeliveryError(
        f"Kafka refused event {event_id} ({event_type}, aggregate {aggregate_id}) "
        f"for topic {message.topic}: {err.str()}; {remedy}"
    )
