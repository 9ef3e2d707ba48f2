"""Kafka's rule on topic names, checked before a topic's first event (cdc_relay.kafka.topics)."""

from __future__ import annotations

from collections.abc import Callable, Collection

from cdc_relay.kafka.topics import Topics, collides


def listing(*topics: str) -> tuple[Callable[[], Collection[str] | None], list[int]]:
    """A listing of Kafka's topics, and how many times it was asked for."""
    calls: list[int] = []

    def list_topics() -> Collection[str]:
        calls.append(1)
        return set(topics)

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
