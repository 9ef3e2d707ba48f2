"""The Kafka side: an idempotent confluent-kafka producer with delivery reports.

The sink never flushes per message. ``offer`` returns False when the local queue is full, so
the caller can keep the replication connection alive while it waits (back-pressure).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer
from mypy_extensions import mypyc_attr

from cdc_relay.errors import DeliveryError, KafkaUnavailableError, UsageError
from cdc_relay.kafka.outage import KAFKA
from cdc_relay.kafka.overdue import Overdue
from cdc_relay.kafka.routing import Message
from cdc_relay.kafka.topics import (
    MISSING,
    Creator,
    NotYet,
    Topics,
    TopicSpec,
    Unmade,
    collides,
)

log = logging.getLogger(__name__)
# librdkafka's own lines, through our handlers instead of raw stderr
_KAFKA_LOG = logging.getLogger("cdc_relay.kafka")

# Settings the relay's guarantees rest on; a user may not weaken them (value: the accepted
# spellings, the first one is set).
REQUIRED = {
    "enable.idempotence": ("true",),
    "acks": ("all", "-1"),
    # A batch Kafka refuses stops the producer instead of letting later batches of the same
    # partition through: a refused event is never overtaken by a later one of its key.
    "enable.gapless.guarantee": ("true",),
    # Java clients' partitioner: a key lands where Debezium and Java producers put it.
    "partitioner": ("murmur2_random",),
    # Retriable failures (broker down) are retried until the broker is back: the relay waits,
    # it does not give up on an event, which could then be overtaken by a later one.
    "message.timeout.ms": ("0",),
    # One produce request in flight per broker. With more, a batch the broker refused as not
    # its leader's (a partition just made, a leader moving) is taken for written when the
    # next batch of its partition, sent meanwhile, is accepted (librdkafka's "implicitly acked
    # by subsequent batch success"): its events are reported delivered and Kafka never had
    # them (tests/integration/test_poller.py, several pollers after a broker restart).
    "max.in.flight.requests.per.connection": ("1",),
}
_ALIASES = {
    "request.required.acks": "acks",
    "delivery.timeout.ms": "message.timeout.ms",
    "max.in.flight": "max.in.flight.requests.per.connection",
}
_REMEDIES = {
    "partitioner": "another partitioner puts a key elsewhere than Java clients and Debezium do",
    "message.timeout.ms": "a timeout lets the producer give up on an event while the broker is "
    "away, and a later event of its key can overtake it; the relay waits for the broker and "
    "says so in its readiness",
    "max.in.flight.requests.per.connection": "with more than one request in flight, a batch "
    "refused while a partition's leader changes can be reported delivered when the next one "
    "is accepted, and Kafka never has its events",
}
# Settings that belong to modes the relay does not run in.
FORBIDDEN = {
    "transactional.id": "stream --exactly-once runs the transactions (its transactional id is "
    "--transactional-id); remove transactional.id",
}

DEFAULTS = {
    "client.id": "cdc-relay",
    "compression.type": "lz4",
    "linger.ms": "10",
    # What the producer may hold: 20,000 events is a fifth of a second of a backlog at 100,000
    # events/s, enough for full batches, and caps the relay's memory. With librdkafka's
    # 100,000, a backlog met by a broker just started (bench/README.md) grew the relay's peak
    # RSS to 125-136 MiB, and drained no faster.
    "queue.buffering.max.messages": "20000",
    "queue.buffering.max.kbytes": "131072",
    # Statistics tell whether a broker connection is up (readiness, cdc_relay_connected).
    "statistics.interval.ms": "5000",
}


def producer_config(bootstrap: str, overrides: Mapping[str, str]) -> dict[str, str]:
    """The producer configuration: our defaults, the user's settings, then the guarantees."""
    settings: dict[str, str] = {}
    for key, value in overrides.items():
        name = _ALIASES.get(key, key)
        # Named by key only, like every error about --kafka-config and --kafka-config-file.
        where = f"the Kafka setting {key} (--kafka-config or --kafka-config-file)"
        if name in FORBIDDEN:
            raise UsageError(f"{where}: {FORBIDDEN[name]}")
        accepted = REQUIRED.get(name)
        if accepted is not None and value.strip().lower() not in accepted:
            why = _REMEDIES.get(name, "it would let events be lost or reordered")
            raise UsageError(
                f"{where}: {why}; cdc-relay needs {name}={accepted[0]}: remove the setting"
            )
        settings[name if accepted is not None else key] = value
    required = {key: accepted[0] for key, accepted in REQUIRED.items()}
    return {**DEFAULTS, "bootstrap.servers": bootstrap, **settings, **required}


# Answers that no retry will change: start-up stops at once with the broker's reason.
_REFUSALS = (KafkaError._AUTHENTICATION, KafkaError._SSL)
# A connection failed: one broker of several may be away (librdkafka reconnects), so only the
# reason is kept, for the outage's line when no broker is left (outage.py).
_CONNECTION_FAILED = (KafkaError._TRANSPORT, KafkaError._RESOLVE)


_LIST_TIMEOUT = 2.0  # seconds a listing of Kafka's topics may hold up the loop
_LIST_AGAIN = 5.0  # seconds before Kafka's topics are asked for again, after no answer


def _reason(err: KafkaError) -> str:
    """librdkafka's text without the broker's name before it and the timing after it."""
    return re.sub(r"^\S+/\S+: | \(after \d+ms in state \w+.*\)$", "", err.str())


Acked = Callable[[Any], None]
Refused = Callable[[Any, KafkaError], None]


def topics_of(config: Mapping[str, str], creation: TopicSpec | None) -> Topics:
    """The topic check of a relay's sinks; with ``creation`` (--create-topics) it makes the
    topics Kafka does not have."""
    return Topics(Creator(config, creation) if creation is not None else None)


def kafka_sink(
    config: Mapping[str, str], relay: str = "stream", creation: TopicSpec | None = None
) -> Callable[[Acked, Refused], KafkaSink]:
    """What opens the idempotent producer's sink for ``config`` from its two report callbacks
    (stages.OpenSink): the default sink of every relay; ``creation``: --create-topics'."""

    topics = topics_of(config, creation)  # shared by the sinks it opens: a poll relay's workers

    def open_sink(acked: Acked, refused: Refused) -> KafkaSink:
        return KafkaSink(config, on_ack=acked, on_refused=refused, relay=relay, topics=topics)

    return open_sink


def _collision(topic: str, other: str) -> KafkaError:
    """The refusal of an event for ``topic``, which Kafka will not create (cdc_relay.kafka.topics):
    the broker's own answer to the creation, INVALID_TOPIC_EXCEPTION, with its reason."""
    return KafkaError(
        KafkaError.TOPIC_EXCEPTION,
        f"topic {topic} collides with existing topic {other}: Kafka takes '.' and '_' in a "
        "topic name for the same, and does not create it",
    )


def _header(headers: list[tuple[str, bytes]], name: str) -> str:
    return next((v.decode(errors="replace") for k, v in headers if k == name), "?")


# Compiled (cdc_relay/compiled.py): offer and the delivery reports run per event. Exactly
# once's sink extends it (transactional.py).
@mypyc_attr(allow_interpreted_subclasses=True)
class KafkaSink:
    """Produces routed messages and reports each with the caller's token: ``on_ack`` when
    Kafka acknowledged it, ``on_refused`` when it did not (at once, from ``offer``, when the
    client refuses the message itself; later, from ``poll``, when the broker refused it or
    the batch it was in).

    What a refusal means is the caller's to decide (cdc_relay.kafka.refusals). After a refused
    batch the producer stops (the gapless guarantee) and fails what it still holds; the next
    ``offer`` once nothing is outstanding starts a new producer.

    Before the first event of a topic, ``topics`` (shared by the sinks of one relay) checks
    that Kafka can have it (cdc_relay.kafka.topics); an event Kafka has not answered for in
    ``overdue.OVERDUE`` seconds is named in a warning, with the reason if its topic's
    metadata tells it (cdc_relay.kafka.overdue).
    """

    def __init__(
        self,
        config: Mapping[str, str],
        on_ack: Acked,
        on_refused: Refused,
        relay: str = "stream",
        topics: Topics | None = None,
    ) -> None:
        self._config = dict(config)
        self._relay = relay
        self._on_ack = on_ack
        self._on_refused = on_refused
        self._topics = topics or Topics()
        self._checked = self._topics.checked  # read per event
        self._unlisted = -_LIST_AGAIN  # when Kafka last did not list its topics
        # A message of each topic watched for Kafka's answer: its key and headers.
        self._overdue: Overdue[tuple[bytes | None, list[tuple[str, bytes]]]] = Overdue()
        self._watched = self._overdue.watched  # read per event
        self.failure: DeliveryError | None = None
        self.connected = False
        # The producer stopped after a refused batch: a new one takes over once it is empty.
        self.broken = False
        # The last error the client reported, for the message of a failed start.
        self._last_error: KafkaError | None = None
        self._checking = False
        self._producer = self._new_producer()

    def _new_producer(self) -> Producer:
        try:
            return Producer(
                {
                    **self._config,
                    "error_cb": self._on_error,
                    "stats_cb": self._on_stats,
                    "logger": _KAFKA_LOG,
                }
            )
        except KafkaException as exc:
            raise UsageError(f"Kafka client settings: {exc.args[0].str()}") from None

    def renew(self) -> None:
        """Drop what the producer holds (each gets its refusal report) and start a new one."""
        old = self._producer
        old.purge()
        # Serves the purged messages' reports. A purge of messages already in flight fails an
        # idempotent producer with the gapless guarantee (fatal: "Purged in flight"), which
        # flush then raises: that producer is being replaced, and the reports it had served
        # are for what the caller forgot.
        with contextlib.suppress(KafkaException):
            old.flush(0)
        self._overdue.clear()  # a report that did not come by now never will
        self._producer = self._new_producer()
        self.broken = False

    def check_reachable(self, timeout: float) -> None:
        """Fail fast, with a remedy, when no broker answers, or one refuses the relay's TLS
        settings or credentials (at once: waiting would not change its answer)."""
        deadline = time.monotonic() + timeout
        self._checking = True
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
        self.connected = True

    def _unreachable(self, timeout: float) -> str:
        where = self._config["bootstrap.servers"]
        err = self._last_error
        reason = _reason(err) if err else ""
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
        """Hand a message to the producer; False when its queue is full (poll, then retry).

        A message the client refuses (larger than message.max.bytes, ...) is reported to
        ``on_refused`` before this returns True; so is one whose topic Kafka cannot create
        (cdc_relay.kafka.topics). False too while its topic is being made (--create-topics).
        """
        if self.broken and not len(self._producer):
            self.renew()
        topic = message.topic
        if topic not in self._checked:
            try:
                other = self._topics.collision(topic, self._list_topics)
            except NotYet:
                return False
            except Unmade as exc:
                self._on_refused(token, KafkaError(KafkaError.TOPIC_EXCEPTION, str(exc)))
                return True
            if other is not None:
                self._on_refused(token, _collision(topic, other))
                return True
        watch = topic not in self._watched
        if watch:
            self._overdue.watch(topic, (message.key, message.headers))
            report = functools.partial(self._watched_report, token)
        else:
            report = functools.partial(self._delivered, token)
        try:
            # Every argument by position, in the order of produce's signature (topic, value,
            # key, partition, callback, on_delivery, timestamp, headers): the C extension
            # parses keyword arguments at about 4,000 instructions a call, a twentieth of
            # the relay's per event (bench/README.md). -1 is librdkafka's "any partition" (the
            # partitioner's choice) and 0 "no timestamp", the defaults the keywords left.
            self._producer.produce(
                topic,
                message.value,
                message.key,
                -1,
                report,
                None,
                0,
                message.headers,  # type: ignore[arg-type]
            )
        except BufferError:
            if watch:
                self._overdue.answered(topic)
            return False
        except KafkaException as exc:
            if watch:
                self._overdue.answered(topic)
            self._on_refused(token, exc.args[0])
        return True

    def _list_topics(self) -> dict[str, int] | None:
        """Kafka's topics with their partition counts; None when it does not answer, and then
        for a while without asking (the loop must not wait for it at each event of the topic)."""
        now = time.monotonic()
        if KAFKA.down or now - self._unlisted < _LIST_AGAIN:
            return None
        try:
            topics = self._producer.list_topics(timeout=_LIST_TIMEOUT).topics
        except KafkaException:
            self._unlisted = now
            return None
        return {name: len(metadata.partitions) for name, metadata in topics.items()}

    def poll(self, timeout: float = 0) -> None:
        """Serve delivery reports; raise DeliveryError if the producer failed for good."""
        try:
            self._producer.poll(timeout)
        except KafkaException as exc:
            self._on_fatal(exc.args[0])
        if self._watched:
            self._look()
        if self.failure is not None:
            raise self.failure

    def _on_fatal(self, err: KafkaError) -> None:
        if err.code() == KafkaError._GAPLESS_GUARANTEE:
            # A refused batch; its messages' reports follow, each with the broker's answer.
            self.broken = True
        elif self.failure is None:
            self.failure = DeliveryError(
                f"Kafka producer failed: {err.str()}; fix the cause and restart the relay: it "
                "resumes after the last event Kafka acknowledged"
            )

    def settle(self, timeout: float) -> None:
        """Serve delivery reports for up to ``timeout`` seconds, or until none is outstanding.

        Does not raise for a refused event: when stopping, the acks of the others still count.
        """
        try:
            self._producer.flush(timeout)
        except KafkaException as exc:
            self._on_fatal(exc.args[0])
        if self._watched:
            self._look()

    def _look(self) -> None:
        """Name an event Kafka has not answered for, when it waited too long."""
        if not len(self._producer):
            self._overdue.clear()  # a report that did not come by now never will
            return
        if KAFKA.down:
            return  # the outage's lines say why everything waits
        late = self._overdue.due()
        if late is None:
            return
        waited, topic, (key, headers) = late
        why = self._why(topic)
        log.warning(
            "event %s (%s, aggregate %s) for topic %s has waited %.0f s for Kafka's answer: %s "
            "(%d awaiting Kafka's answer in all)",
            _header(headers, "id"),
            _header(headers, "event_type"),
            key.decode(errors="replace") if key is not None else None,
            topic,
            waited,
            why,
            len(self._producer),
            extra={
                "action": "event_overdue",
                "event_id": _header(headers, "id"),
                "event_type": _header(headers, "event_type"),
                "aggregate_id": key.decode(errors="replace") if key is not None else None,
                "topic": topic,
                "error": why,
            },
        )

    def _why(self, topic: str) -> str:
        """What Kafka's metadata says of ``topic`` that keeps its events waiting."""
        try:
            metadata = self._producer.list_topics(timeout=_LIST_TIMEOUT)
        except KafkaException as exc:
            return f"Kafka did not list its topics ({exc.args[0].str()})"
        found = metadata.topics.get(topic)
        if found is None or (found.error is not None and found.error.code() in MISSING):
            other = next((t for t in sorted(metadata.topics) if collides(topic, t)), None)
            if other is not None:
                self._topics.forget(topic)  # its next event is refused at once (offer)
                return _collision(topic, other).str()
            if topic in self._topics.created:
                return (
                    f"topic {topic} was created by this relay, and Kafka's metadata does not "
                    "show it yet; the producer waits up to topic.metadata.propagation.max.ms "
                    "(30 s by default) for it"
                )
            return (
                f"topic {topic} does not exist, and Kafka did not create it (the broker's "
                "auto.create.topics.enable, or allow.auto.create.topics in --kafka-config, is "
                "false): create the topic; the producer gives the event up after "
                "topic.metadata.propagation.max.ms (30 s by default)"
            )
        if found.error is not None:
            return f"topic {topic}: {found.error.str()}"
        leaderless = sorted(n for n, partition in found.partitions.items() if partition.leader < 0)
        if leaderless:
            return f"partitions {', '.join(map(str, leaderless))} of topic {topic} have no leader"
        return "Kafka's metadata of the topic shows no reason (a broker slow to answer?)"

    def in_flight(self) -> int:
        """Messages handed to the producer and not yet reported."""
        return len(self._producer)

    def missing(self, topic: str, err: KafkaError) -> bool:
        """Whether ``err`` says Kafka does not have ``topic`` and this sink makes its topics:
        checked again (and made) before its next event (cdc_relay.kafka.topics)."""
        return self._topics.missing(topic, err)

    def close(self) -> int:
        """Close the producer; return how many messages were still unacknowledged. A report
        that comes now goes to no one (the caller is done with its events): it is counted."""
        reports = 0

        def count(*_: Any) -> None:
            nonlocal reports
            reports += 1

        self._on_ack = self._on_refused = count
        # The client's queue holds its events too (a statistics report every 5 s that no one
        # served while the relay idled): served first, so that only messages are counted.
        self._producer.poll(0)
        left = len(self._producer) + reports
        self._producer.purge()
        self._producer.flush(0)
        self._overdue.clear()
        return left

    def _watched_report(self, token: Any, err: KafkaError | None, message: Any) -> None:
        """The report of a topic's watched message (cdc_relay.kafka.overdue)."""
        topic = message.topic()
        self._overdue.answered(topic)
        if err is not None and err.code() in MISSING:
            self._topics.forget(topic)  # checked again before its next event
        self._delivered(token, err, message)

    def _delivered(self, token: Any, err: KafkaError | None, _: Any) -> None:
        if err is None:
            self.connected = True
            if KAFKA.since is not None:  # per event: no call while Kafka was not away
                KAFKA.back()
            self._on_ack(token)
        else:
            self._on_refused(token, err)

    def _on_stats(self, stats_json: str) -> None:
        try:
            brokers = json.loads(stats_json).get("brokers", {}).values()
        except ValueError:
            return
        self.connected = any(b.get("state") == "UP" and b.get("nodeid", -1) >= 0 for b in brokers)
        if self.connected:
            KAFKA.back()
        else:
            KAFKA.waiting(len(self._producer))

    def _on_error(self, err: KafkaError) -> None:
        # While start-up checks the broker, errors go into its exception, not into the log.
        code = err.code()
        if code in _CONNECTION_FAILED:
            self._last_error = err
            if not self._checking:
                KAFKA.noted(_reason(err))
        elif code == KafkaError._ALL_BROKERS_DOWN or code in _REFUSALS:
            if code == KafkaError._ALL_BROKERS_DOWN:
                self.connected = False
            else:
                self._last_error = err
            if not self._checking:
                # librdkafka's text for it ("1/1 brokers are down") can be stale: "0/1 ..."
                KAFKA.failed(
                    "no broker connection is up"
                    if code == KafkaError._ALL_BROKERS_DOWN
                    else _reason(err)
                )
        elif err.fatal():
            self._on_fatal(err)
        else:
            self._last_error = err
            if not self._checking:
                log.warning("kafka: %s", err.str(), extra={"action": "kafka_error"})


def _gapless_warning(record: logging.LogRecord) -> bool:
    """False for librdkafka's lines about the gapless guarantee: its warning that the setting is
    experimental (the relay sets it on purpose, REQUIRED) and its FATAL line when a refused
    batch stops the producer, which the relay handles and reports itself (refusals.py)."""
    args = record.args
    if not isinstance(args, tuple) or not args:
        return True
    text = str(args[-1]).lower()
    if args[0] == "CONFWARN":
        return "gapless" not in text
    return not (args[0] == "FATAL" and "gap-less" in text)


_KAFKA_LOG.addFilter(_gapless_warning)


def _connection_failures(record: logging.LogRecord) -> bool:
    """False for librdkafka's lines about a failed connection (facility FAIL): the error
    callback reports the same failures, to the start-up check's message or to the outage's
    log (outage.py), which says it once instead of once per attempt of every producer."""
    return not (isinstance(record.args, tuple) and record.args[:1] == ("FAIL",))


_KAFKA_LOG.addFilter(_connection_failures)


def _leader_not_cached(record: logging.LogRecord) -> bool:
    """False for librdkafka's line that a partition's new leader is not in its metadata cache
    yet, printed per partition and per refresh while a broker comes back: it refreshes the
    metadata until it is, and the outage's line tells when Kafka is back."""
    args = record.args
    return not (
        isinstance(args, tuple)
        and args[:1] == ("METADATAUPDATE",)
        and "not found in cache" in str(args[-1])
    )


_KAFKA_LOG.addFilter(_leader_not_cached)
