"""A topic before its first event: Kafka's rule on topic names, and ``--create-topics``.

Kafka takes ``.`` and ``_`` in a topic name for the same (its metrics write one for the
other), so a broker refuses to create ``orders.line`` once ``orders_line`` exists: "collides
with existing topic", said in its own log only. The producer hears that the topic is unknown
and waits ``topic.metadata.propagation.max.ms`` (30 s) before it gives the event up, saying
nothing meanwhile. So the sink asks, before the first event of a topic it has not sent to:
whether Kafka has the topic, and if not, whether Kafka has (or this relay sends to) one
it collides with. Such an event is refused at once, as the client refuses a message it cannot
send (sink.KafkaSink.offer), with the topic it collides with; the refusal policy decides the
rest (cdc_relay.kafka.refusals).

With ``--create-topics`` (a ``TopicSpec``) the same check makes a missing topic, through the
AdminClient, with the partitions, replication factor and settings asked, before its first event
goes out; a topic Kafka has is used as it is. The creation is asked once and not waited for
on the loop: until Kafka answers, the event waits as for a full queue (the sink's ``offer``
says False). A creation Kafka refuses (not authorised, an invalid setting) stops the relay in
one line (``TopicNotCreated``); it is never an event's refusal, so never a dead letter. The
checkpoint topic of exactly once is made by the same code (``ensure``). A topic being made
counts for the collision check as one the relay sends to, and a creation Kafka refuses as
colliding (another relay made the other name since the listing) is the event's refusal, as
the listing would have made it. A name of Kafka's own (``__``) is never made: its event is
refused.

Kafka's topics are its own record, so the check holds across restarts.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    NewTopic,
)

from cdc_relay.errors import KafkaUnavailableError, RelayError

log = logging.getLogger(__name__)

BROKER_DEFAULT = -1
"""A partition count or replication factor left to the broker (num.partitions,
default.replication.factor)."""
CREATE_TIMEOUT = 30.0  # seconds Kafka has to answer a creation before it is asked again
_ASK_AGAIN = 5.0  # seconds before a creation Kafka did not answer is asked for again


def collides(topic: str, other: str) -> bool:
    """Whether Kafka refuses to have both topics: they differ, but only in ``.`` and ``_``."""
    return topic != other and topic.replace(".", "_") == other.replace(".", "_")


def client_settings(config: Mapping[str, str]) -> dict[str, str]:
    """What a consumer or admin client takes of the producer's settings: where and how to
    connect."""
    return {
        k: v
        for k, v in config.items()
        if k.startswith(("bootstrap.", "security.", "ssl.", "sasl.", "client."))
    }


@dataclass(frozen=True)
class TopicSpec:
    """What ``--create-topics`` makes a missing topic with: ``partitions`` and
    ``replication_factor`` (BROKER_DEFAULT: the broker's), the topic settings ``config``, and
    partition counts of named topics (``--topic-partitions-for``)."""

    partitions: int = BROKER_DEFAULT
    replication_factor: int = BROKER_DEFAULT
    config: Mapping[str, str] = field(default_factory=dict)
    partitions_for: Mapping[str, int] = field(default_factory=dict)

    def partitions_of(self, topic: str) -> int:
        return self.partitions_for.get(topic, self.partitions)

    def checkpoints(self) -> TopicSpec:
        """The checkpoint topic's: one partition, compacted, the replication and settings
        asked otherwise."""
        return TopicSpec(1, self.replication_factor, {**self.config, "cleanup.policy": "compact"})

    def describe(self, topic: str) -> str:
        """How ``topic`` is made, for the log and setup-slot's lines."""
        partitions, factor = self.partitions_of(topic), self.replication_factor
        parts = [
            "the broker's partition count" if partitions < 0 else f"{partitions} partitions",
            "the broker's replication factor" if factor < 0 else f"replication factor {factor}",
        ]
        parts += [f"{key}={value}" for key, value in sorted(self.config.items())]
        return ", ".join(parts)

    def new_topic(self, topic: str) -> NewTopic:
        return NewTopic(
            topic, self.partitions_of(topic), self.replication_factor, config=dict(self.config)
        )


class TopicNotCreated(RelayError):
    """Kafka refused to create a topic; the relay stops before its first event."""


class Unanswered(Exception):
    """Kafka did not answer a creation (or is away): asked again later."""


# Kafka will not create the topic as asked: the options are the user's to fix.
_INVALID = frozenset(
    {
        KafkaError.INVALID_PARTITIONS,
        KafkaError.INVALID_REPLICATION_FACTOR,
        KafkaError.INVALID_REPLICA_ASSIGNMENT,
        KafkaError.INVALID_CONFIG,
        KafkaError.POLICY_VIOLATION,
        KafkaError.INVALID_REQUEST,
        KafkaError._INVALID_ARG,
    }
)
_DENIED = frozenset(
    {KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.CLUSTER_AUTHORIZATION_FAILED}
)
# Answers a later try may not meet: the broker away or busy.
_LATER = frozenset(
    {
        KafkaError._TIMED_OUT,
        KafkaError.REQUEST_TIMED_OUT,
        KafkaError._TRANSPORT,
        KafkaError._ALL_BROKERS_DOWN,
        KafkaError.NOT_CONTROLLER,
    }
)
# Kafka does not have the topic (an answer about the topic, not about a message): unknown to
# the broker, or to the producer's metadata (a partition of it, after the topic was deleted).
MISSING = frozenset(
    {KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC, KafkaError._UNKNOWN_PARTITION}
)


def request(admin: AdminClient, topic: str, spec: TopicSpec) -> Future[None]:
    """Ask Kafka to create ``topic`` as ``spec`` says; the answer comes in the future."""
    futures = admin.create_topics(
        [spec.new_topic(topic)],
        request_timeout=CREATE_TIMEOUT,
        operation_timeout=CREATE_TIMEOUT,
    )
    future: Future[None] = futures[topic]
    return future


_BEFORE_EVENT = "; nothing from its first event on was confirmed"


def outcome(topic: str, spec: TopicSpec, future: Future[None], after: str = _BEFORE_EVENT) -> bool:
    """Kafka's answer to a done creation: True if it made the topic, False if it had it
    (another relay made it meanwhile); TopicNotCreated when it refused (its line ends with
    ``after``), Unanswered when a later try may do."""
    try:
        future.result(timeout=0)
    except KafkaException as exc:
        err: KafkaError = exc.args[0]
        code = err.code()
        if code == KafkaError.TOPIC_ALREADY_EXISTS:
            return False
        if code in _DENIED:
            raise TopicNotCreated(
                f"Kafka refused to create topic {topic} ({err.str()}): grant the relay's "
                "principal CREATE on the topic (or on the cluster) and DESCRIBE_CONFIGS on it, "
                f"or create the topic yourself{after}"
            ) from None
        if code in _INVALID:
            raise TopicNotCreated(
                f"Kafka would not create topic {topic} with {spec.describe(topic)}: "
                f"{err.str()}; fix --topic-partitions, --topic-replication-factor or "
                "--topic-config (a replication factor may not exceed the brokers), or create "
                f"the topic yourself{after}"
            ) from None
        if code in _LATER or err.retriable():
            raise Unanswered(err.str()) from None
        raise TopicNotCreated(
            f"Kafka did not create topic {topic}: {err.str()}; create the topic yourself, or "
            f"fix the cause and try again{after}"
        ) from None
    return True


def admin_client(config: Mapping[str, str]) -> AdminClient:
    """An AdminClient connected as the producer of ``config`` is."""
    return AdminClient({**client_settings(config), "log_level": 0})


def ensure(config: Mapping[str, str], topic: str, spec: TopicSpec, timeout: float) -> bool:
    """Create ``topic`` as ``spec`` says unless Kafka has it, waiting up to ``timeout``
    seconds; True if it was created here. For the set-up and the start of a relay, which may
    wait."""
    admin = admin_client(config)
    try:
        metadata = admin.list_topics(timeout=timeout)
    except KafkaException as exc:
        raise KafkaUnavailableError(
            f"no Kafka broker answered at {config.get('bootstrap.servers', '?')} within "
            f"{timeout:g}s ({exc.args[0].str()}); check --kafka-bootstrap and that the broker "
            "is running"
        ) from None
    found = metadata.topics.get(topic)
    if found is not None and found.error is None:
        return False
    future = request(admin, topic, spec)
    try:
        future.exception(timeout=timeout)
    except TimeoutError:
        pass
    if not future.done():
        future.cancel()
        raise KafkaUnavailableError(
            f"Kafka did not answer the creation of topic {topic} within {timeout:g}s; try "
            "again, or create the topic yourself"
        )
    try:
        return outcome(topic, spec, future, after="")
    except Unanswered as exc:
        raise KafkaUnavailableError(
            f"Kafka did not create topic {topic}: {exc}; try again, or create the topic yourself"
        ) from None


class Creator:
    """Makes missing topics as ``spec`` says, through one AdminClient connected as the
    producer of ``config`` is (made at the first creation)."""

    def __init__(self, config: Mapping[str, str], spec: TopicSpec) -> None:
        self.spec = spec
        self._config = dict(config)
        self._admin: AdminClient | None = None

    def request(self, topic: str) -> Future[None]:
        if self._admin is None:
            self._admin = admin_client(self._config)
        return request(self._admin, topic, self.spec)


class Unmade(Exception):
    """A topic --create-topics does not make, whose event is refused as the broker would
    refuse it (str: why, and what to do)."""


INTERNAL_PREFIX = "__"
"""Kafka's own topics (__consumer_offsets, __transaction_state, ...): a broker that has not
made one yet creates it on request, as asked (not compacted), so the relay never asks."""


class NotYet(Exception):
    """The topic is not known to exist yet (its creation is under way, or Kafka did not
    answer): its event waits, as for room in the producer's queue."""


Listing = Callable[[], Mapping[str, int] | None]
"""Kafka's topics with their partition counts; None when Kafka did not answer."""


class Topics:
    """The topics the sinks of one relay may send to, each checked once (and made, with a
    ``creator``); shared by a poll relay's workers (thread-safe), so two of them cannot start
    two colliding topics, nor ask for one topic twice."""

    def __init__(self, creator: Creator | None = None) -> None:
        # Read without the lock, per event: a topic is added once it may be sent to.
        self.checked: set[str] = set()
        self._listed: dict[str, int] = {}  # Kafka's topics, as last listed: partition counts
        self._creator = creator
        self._creating: dict[str, Future[None]] = {}
        self._unanswered = -math.inf  # when Kafka last did not answer a creation
        self._warned: set[str] = set()
        self.created: set[str] = set()  # topics made here (--create-topics)
        # Kafka refused to make these as colliding (INVALID_TOPIC_EXCEPTION): its words
        self._refused: dict[str, str] = {}
        self._lock = threading.Lock()

    def collision(self, topic: str, listing: Listing) -> str | None:
        """The topic ``topic`` collides with, if any, which Kafka has or this relay sends to;
        ``listing`` lists Kafka's topics (None: Kafka did not answer, and ``topic`` stays
        unchecked). Listed again only for a topic not in the last listing.

        With a creator, a topic Kafka does not have is made before it counts as checked:
        NotYet until Kafka has answered, TopicNotCreated when it refused; Unmade for a name
        of Kafka's own (INTERNAL_PREFIX). A topic being made counts as one this relay sends
        to; one Kafka refused to make as colliding with a topic made since the last listing
        is refused as colliding, as the listing would have said."""
        with self._lock:
            if topic in self.checked:
                return None
            creating = self._creating.get(topic)
            if creating is not None:
                if self._created(topic, creating):
                    return None
                self._listed = {}  # Kafka has a topic the last listing did not show
            if topic not in self._listed:
                listed = listing()
                if listed is None:
                    if self._creator is not None:
                        raise NotYet
                    return None
                self._listed = dict(listed)
            if topic in self._listed:  # it exists: Kafka made it, so nothing collides with it
                self.checked.add(topic)
                self._compare(topic, self._listed[topic])
                return None
            other = next(
                (
                    t
                    for t in sorted(self._listed.keys() | self.checked | self._creating.keys())
                    if collides(topic, t)
                ),
                None,
            )
            if other is not None:
                self._refused.pop(topic, None)
                return other
            if self._creator is None:
                self.checked.add(topic)
                return None
            words = self._refused.pop(topic, None)
            if words is not None:  # not for a collision the listing shows: the name itself
                raise TopicNotCreated(
                    f"Kafka would not create topic {topic}: {words}; create the topic yourself, "
                    f"or route its events elsewhere (--topic-template){_BEFORE_EVENT}"
                )
            if topic.startswith(INTERNAL_PREFIX):
                raise Unmade(
                    f"topic {topic} is not made by --create-topics: a name starting with "
                    f"{INTERNAL_PREFIX} is one of Kafka's internal topics; route the aggregate "
                    "type elsewhere (--topic-template), or create the topic yourself"
                )
            if time.monotonic() - self._unanswered < _ASK_AGAIN:
                raise NotYet
            self._creating[topic] = self._creator.request(topic)
            self._created(topic, self._creating[topic])
            return None

    def _created(self, topic: str, creating: Future[None]) -> bool:
        """Kafka's answer to the creation of ``topic``: True, and checked, once it has the
        topic; False when Kafka refused the name (INVALID_TOPIC_EXCEPTION: it collides with
        a topic made since the last listing)."""
        if not creating.done():
            raise NotYet
        del self._creating[topic]
        refusal = creating.exception(timeout=0)
        if isinstance(refusal, KafkaException):
            err: KafkaError = refusal.args[0]
            if err.code() == KafkaError.TOPIC_EXCEPTION:
                self._refused[topic] = err.str()
                return False
        spec = self._creator.spec if self._creator is not None else TopicSpec()
        try:
            created = outcome(topic, spec, creating)
        except Unanswered as exc:
            self._unanswered = time.monotonic()
            log.warning(
                "Kafka did not answer the creation of topic %s (%s); its events wait, and it "
                "is asked again in %g s",
                topic,
                exc,
                _ASK_AGAIN,
                extra={"action": "topic_creation_unanswered", "topic": topic},
            )
            raise NotYet from None
        self.checked.add(topic)
        if created:
            self.created.add(topic)
            log.info(
                "created topic %s (%s)",
                topic,
                spec.describe(topic),
                extra={"action": "topic_created", "topic": topic},
            )
        else:
            log.info(
                "topic %s exists (another client made it meanwhile): used as it is",
                topic,
                extra={"action": "topic_exists", "topic": topic},
            )
        return True

    def _compare(self, topic: str, partitions: int) -> None:
        """Warn once when a topic Kafka has differs from the partition count asked."""
        if self._creator is None or topic in self._warned:
            return
        asked = self._creator.spec.partitions_of(topic)
        if asked < 0 or asked == partitions:
            return
        self._warned.add(topic)
        log.warning(
            "topic %s exists with %d partitions, not the %d asked: used as it is (adding "
            "partitions moves keys to other partitions, so the relay never changes a topic)",
            topic,
            partitions,
            asked,
            extra={"action": "topic_partitions_differ", "topic": topic},
        )

    def missing(self, topic: str, err: KafkaError) -> bool:
        """With a creator, Kafka saying it does not have ``topic`` (deleted while the relay
        runs, or not yet in the producer's metadata) is no event's fault: True, and the topic
        is checked again, and made if it is still missing, before its next event."""
        if self._creator is None or err.code() not in MISSING:
            return False
        self.forget(topic)
        return True

    def forget(self, topic: str) -> None:
        """Kafka said it does not know ``topic``: checked again before its next event (another
        relay may have made one it collides with, which the last listing did not show)."""
        with self._lock:
            self.checked.discard(topic)
            self._listed.pop(topic, None)
