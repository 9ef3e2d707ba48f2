"""A topic before its first event (cdc_relay.kafka.topics): Kafka's rule on topic names, and
the creation of a missing topic (--create-topics)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import Future

import pytest
from confluent_kafka import KafkaError, KafkaException

from cdc_relay.kafka import topics as topics_module
from cdc_relay.kafka.topics import (
    Creator,
    Listing,
    NotYet,
    TopicNotCreated,
    Topics,
    TopicSpec,
    collides,
)


def listing(*topics: str, partitions: int = 3) -> tuple[Listing, list[int]]:
    """A listing of Kafka's topics (each with ``partitions``), and how many times it was asked
    for."""
    calls: list[int] = []

    def list_topics() -> Mapping[str, int]:
        calls.append(1)
        return dict.fromkeys(topics, partitions)

    return list_topics, calls


def test_dot_and_underscore_are_one_to_kafka() -> None:
    assert collides("p.order.line", "p.order_line")
    assert collides("p_order_line", "p.order.line")
    assert not collides("p.order.line", "p.order.line")  # the same topic
    assert not collides("p.order-line", "p.order_line")
    assert not collides("p.Order_line", "p.order_line")


def test_a_topic_that_collides_with_an_existing_one_is_refused_each_time() -> None:
    topics = Topics()
    kafka, calls = listing("p.order_line", "p.customer")
    assert topics.collision("p.order.line", kafka) == "p.order_line"
    assert "p.order.line" not in topics.checked
    # Asked again with the next event: the other topic may have been deleted meanwhile.
    assert topics.collision("p.order.line", kafka) == "p.order_line"
    assert len(calls) == 2


def test_a_topic_kafka_has_passes_and_is_not_listed_for_again() -> None:
    topics = Topics()
    kafka, calls = listing("p.order_line", "p.customer")
    assert topics.collision("p.order_line", kafka) is None
    assert topics.collision("p.customer", kafka) is None  # in the listing already
    assert topics.checked == {"p.order_line", "p.customer"}
    assert len(calls) == 1


def test_a_topic_sent_to_before_kafka_made_it_counts() -> None:
    """Two colliding topics in one run, before the broker created the first: it creates the
    first it is asked for and refuses the other."""
    topics = Topics()
    kafka, _ = listing("p.customer")
    assert topics.collision("p.order_line", kafka) is None
    assert topics.collision("p.order.line", kafka) == "p.order_line"
    assert topics.collision("p.order_line", kafka) is None


def test_a_topic_stays_unchecked_while_kafka_does_not_answer() -> None:
    topics = Topics()
    assert topics.collision("p.order.line", lambda: None) is None
    assert "p.order.line" not in topics.checked
    kafka, _ = listing("p.order_line")
    assert topics.collision("p.order.line", kafka) == "p.order_line"


def test_a_forgotten_topic_is_checked_again_against_a_new_listing() -> None:
    """Kafka said it does not know the topic: another relay may have made a colliding one."""
    topics = Topics()
    before, _ = listing()
    assert topics.collision("p.order.line", before) is None
    topics.forget("p.order.line")
    assert "p.order.line" not in topics.checked
    after, calls = listing("p.order_line")
    assert topics.collision("p.order.line", after) == "p.order_line"
    assert len(calls) == 1


# -- --create-topics ----------------------------------------------------------------------------


class FakeCreator(Creator):
    """Records what it is asked to create; the test answers each future."""

    def __init__(self, spec: TopicSpec) -> None:
        super().__init__({}, spec)
        self.asked: list[tuple[str, Future[None]]] = []

    def request(self, topic: str) -> Future[None]:
        future: Future[None] = Future()
        self.asked.append((topic, future))
        return future


def refused(future: Future[None], code: int) -> None:
    future.set_exception(KafkaException(KafkaError(code, "the broker's words")))


def test_a_missing_topic_is_created_once_and_its_events_wait_for_kafka_s_answer() -> None:
    creator = FakeCreator(TopicSpec(6, 1, {"retention.ms": "1000"}))
    topics = Topics(creator)
    kafka, _ = listing("p.customer")
    with pytest.raises(NotYet):
        topics.collision("p.order", kafka)
    with pytest.raises(NotYet):  # still unanswered: asked once, not again
        topics.collision("p.order", kafka)
    assert [topic for topic, _ in creator.asked] == ["p.order"]
    assert "p.order" not in topics.checked
    creator.asked[0][1].set_result(None)
    assert topics.collision("p.order", kafka) is None
    assert "p.order" in topics.checked
    assert topics.created == {"p.order"}  # what an overdue event's warning says of it
    assert creator.spec.new_topic("p.order").num_partitions == 6


@pytest.mark.parametrize(
    "code",
    [KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC, KafkaError._UNKNOWN_PARTITION],
)
def test_a_topic_deleted_under_a_relay_that_makes_topics_is_made_again(code: int) -> None:
    """A topic deleted while the relay runs: the producer refuses its events as unknown. With
    --create-topics that is no event's fault (so never dead-lettered): the topic is checked
    again, and made, before its next event."""
    creator = FakeCreator(TopicSpec())
    topics = Topics(creator)
    assert topics.collision("p.order", listing("p.order")[0]) is None
    assert topics.missing("p.order", KafkaError(code))
    assert "p.order" not in topics.checked
    with pytest.raises(NotYet):
        topics.collision("p.order", listing()[0])
    assert [topic for topic, _ in creator.asked] == ["p.order"]


def test_a_missing_topic_is_the_event_s_refusal_without_create_topics() -> None:
    """Without --create-topics the missing topic is the user's to make: the event's refusal
    (the relay stops, or dead-letters it), and no other error counts as a missing topic."""
    topics = Topics()
    assert topics.collision("p.order", listing("p.order")[0]) is None
    assert not topics.missing("p.order", KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART))
    assert "p.order" in topics.checked
    made = Topics(FakeCreator(TopicSpec()))
    assert made.collision("p.order", listing("p.order")[0]) is None
    assert not made.missing("p.order", KafkaError(KafkaError.MSG_SIZE_TOO_LARGE))
    assert "p.order" in made.checked


def test_a_topic_another_relay_made_meanwhile_is_success() -> None:
    creator = FakeCreator(TopicSpec())
    topics = Topics(creator)
    kafka, _ = listing()
    with pytest.raises(NotYet):
        topics.collision("p.order", kafka)
    refused(creator.asked[0][1], KafkaError.TOPIC_ALREADY_EXISTS)
    assert topics.collision("p.order", kafka) is None
    assert "p.order" in topics.checked


@pytest.mark.parametrize(
    ("code", "remedy"),
    [
        (KafkaError.TOPIC_AUTHORIZATION_FAILED, "grant the relay's principal CREATE"),
        (KafkaError.CLUSTER_AUTHORIZATION_FAILED, "grant the relay's principal CREATE"),
        (KafkaError.INVALID_REPLICATION_FACTOR, "fix --topic-partitions"),
        (KafkaError.INVALID_CONFIG, "fix --topic-partitions"),
        (KafkaError.POLICY_VIOLATION, "fix --topic-partitions"),
    ],
)
def test_a_refused_creation_stops_the_relay_in_one_line(code: int, remedy: str) -> None:
    creator = FakeCreator(TopicSpec(3, 5))
    topics = Topics(creator)
    kafka, _ = listing()
    with pytest.raises(NotYet):
        topics.collision("p.order", kafka)
    refused(creator.asked[0][1], code)
    with pytest.raises(TopicNotCreated) as raised:
        topics.collision("p.order", kafka)
    text = str(raised.value)
    assert "\n" not in text
    assert "topic p.order" in text
    assert remedy in text
    assert "nothing from its first event on was confirmed" in text
    assert "p.order" not in topics.checked


def test_a_creation_kafka_did_not_answer_is_asked_again_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [1000.0]
    monkeypatch.setattr(topics_module.time, "monotonic", lambda: now[0])
    creator = FakeCreator(TopicSpec())
    topics = Topics(creator)
    kafka, _ = listing()
    with pytest.raises(NotYet):
        topics.collision("p.order", kafka)
    refused(creator.asked[0][1], KafkaError.REQUEST_TIMED_OUT)
    with pytest.raises(NotYet):
        topics.collision("p.order", kafka)
    with pytest.raises(NotYet):  # not asked again at once
        topics.collision("p.order", kafka)
    assert len(creator.asked) == 1
    now[0] += 6
    with pytest.raises(NotYet):
        topics.collision("p.order", kafka)
    assert len(creator.asked) == 2


def test_with_creation_an_event_waits_while_kafka_does_not_list_its_topics() -> None:
    """Without an answer the relay cannot tell whether the topic exists: the event waits
    rather than go to a topic the broker will not create on demand."""
    creator = FakeCreator(TopicSpec())
    topics = Topics(creator)
    with pytest.raises(NotYet):
        topics.collision("p.order", lambda: None)
    assert creator.asked == []


def test_a_colliding_topic_is_refused_not_created() -> None:
    creator = FakeCreator(TopicSpec())
    topics = Topics(creator)
    kafka, _ = listing("p.order_line")
    assert topics.collision("p.order.line", kafka) == "p.order_line"
    assert creator.asked == []


def test_an_existing_topic_with_another_partition_count_is_used_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    creator = FakeCreator(TopicSpec(6, partitions_for={"p.big": 12}))
    topics = Topics(creator)
    kafka, _ = listing("p.order", "p.big", "p.same", partitions=3)
    same, _ = listing("p.same", partitions=6)
    with caplog.at_level(logging.WARNING, logger="cdc_relay.kafka.topics"):
        assert topics.collision("p.order", kafka) is None
        assert topics.collision("p.big", kafka) is None
        topics.forget("p.order")  # checked again: no second warning
        assert topics.collision("p.order", kafka) is None
        assert Topics(creator).collision("p.same", same) is None
    assert creator.asked == []
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "p.order exists with 3 partitions, not the 6 asked" in lines[0]
    assert "p.big exists with 3 partitions, not the 12 asked" in lines[1]


def test_the_broker_s_partition_count_asked_for_warns_of_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    topics = Topics(FakeCreator(TopicSpec()))
    kafka, _ = listing("p.order", partitions=1)
    with caplog.at_level(logging.WARNING, logger="cdc_relay.kafka.topics"):
        assert topics.collision("p.order", kafka) is None
    assert not caplog.records


def test_the_checkpoint_topic_is_compacted_with_one_partition_whatever_is_asked() -> None:
    spec = TopicSpec(12, 3, {"cleanup.policy": "delete", "min.insync.replicas": "2"})
    made = spec.checkpoints().new_topic("cdc-relay-checkpoints")
    assert made.num_partitions == 1
    assert made.replication_factor == 3
    assert made.config == {"cleanup.policy": "compact", "min.insync.replicas": "2"}
    assert TopicSpec().checkpoints().new_topic("c").replication_factor == -1


# -- what an adversarial review found ------------------------------------------------------------


def test_a_topic_being_created_counts_for_the_collision_of_another() -> None:
    """Two workers of one poll relay (one Topics): the first event's topic is being made when
    the second's, which collides with it, comes. Kafka would create the one it hears first and
    refuse the other with "collides with existing topic", a stop that a restart turns into the
    event's refusal; the relay refuses the second at once, as when the first was checked."""
    creator = FakeCreator(TopicSpec())
    topics = Topics(creator)
    kafka, _ = listing()
    with pytest.raises(NotYet):
        topics.collision("p.order.line", kafka)
    assert topics.collision("p.order_line", kafka) == "p.order.line"
    assert [topic for topic, _ in creator.asked] == ["p.order.line"]


def test_a_creation_kafka_refuses_as_colliding_is_the_event_s_refusal_not_a_stop() -> None:
    """Another relay made ``p.order_line`` after this one listed Kafka's topics: Kafka refuses
    to make ``p.order.line`` (INVALID_TOPIC_EXCEPTION, "collides with existing topic"). That is
    what the listing would have said: the event is refused as colliding (the refusal policy's
    to decide, as on every other path), not a stop telling the user to create a topic Kafka
    cannot have."""
    creator = FakeCreator(TopicSpec())
    topics = Topics(creator)
    before, _ = listing("p.customer")
    with pytest.raises(NotYet):
        topics.collision("p.order.line", before)
    creator.asked[0][1].set_exception(
        KafkaException(
            KafkaError(
                KafkaError.TOPIC_EXCEPTION,
                "Topic 'p.order.line' collides with existing topic: p.order_line",
            )
        )
    )
    after, _ = listing("p.customer", "p.order_line")
    assert topics.collision("p.order.line", after) == "p.order_line"
    assert "p.order.line" not in topics.checked
    assert len(creator.asked) == 1


@pytest.mark.parametrize("name", ["__consumer_offsets", "__transaction_state", "__anything"])
def test_kafka_s_internal_topic_names_are_never_created(name: str) -> None:
    """With --topic-template '{aggregate_type}', a writer's aggregate type names the topic. A
    broker that has not made __consumer_offsets yet (no consumer group used it) creates it on
    request, with the relay's partitions and settings (not compacted: the groups' offsets are
    then deleted at retention.ms), and __transaction_state likewise. The relay makes no topic
    whose name starts with ``__`` (Kafka's own); the event is refused as the broker refuses a
    write to an internal topic, and one that exists is used as it is."""
    creator = FakeCreator(TopicSpec(3, 1, {"cleanup.policy": "delete"}))
    topics = Topics(creator)
    kafka, _ = listing()
    with pytest.raises(Exception) as raised:  # which one: below
        topics.collision(name, kafka)
    assert creator.asked == []
    assert type(raised.value).__name__ == "Unmade"  # topics.Unmade: the event's refusal
    assert name not in topics.checked
    text = str(raised.value)
    assert "\n" not in text
    assert f"topic {name}" in text
    assert "internal" in text
    existing, _ = listing(name)
    assert topics.collision(name, existing) is None  # the user made it: used as it is


def test_a_name_kafka_refuses_with_no_colliding_topic_listed_stops_in_one_line() -> None:
    """INVALID_TOPIC_EXCEPTION, and the listing shows nothing the name collides with: the name
    itself is what Kafka refuses; the relay stops rather than ask again and again."""
    creator = FakeCreator(TopicSpec())
    topics = Topics(creator)
    kafka, _ = listing()
    with pytest.raises(NotYet):
        topics.collision("p.order", kafka)
    refused(creator.asked[0][1], KafkaError.TOPIC_EXCEPTION)
    with pytest.raises(TopicNotCreated) as raised:
        topics.collision("p.order", kafka)
    assert "\n" not in str(raised.value)
    assert "the broker's words" in str(raised.value)
    assert len(creator.asked) == 1
