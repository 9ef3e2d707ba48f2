"""``Pipeline`` itself (cdc_relay.relay.pipeline) on in-memory stages: no database, no broker.

The relays' configurations are tested elsewhere (test_stream_loop, test_poll_loop,
test_batch); these prove the loop's own contract with any stages: events reach the sink in
publish order and each acknowledgement reaches the checkpointer with its own token; a full
queue makes ``publish`` wait (serving reports, ticking) and offer again, dropping nothing;
each kind of refusal reaches the policy method that owns it, and only once what must be
settled is settled; the hooks run around a lone offer; and ``run`` recovers, rewinds, stops
and always shuts the feed down exactly once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from confluent_kafka import KafkaError
from test_stream_loop import Sink, event_id

from cdc_relay.errors import RelayError
from cdc_relay.events import OutboxEvent
from cdc_relay.kafka.refusals import is_culprit
from cdc_relay.kafka.routing import Message, Router
from cdc_relay.postgres.replication import ConnectionLost
from cdc_relay.relay.pipeline import Pipeline, Rewind, Stopping

TOO_LARGE = KafkaError.MSG_SIZE_TOO_LARGE  # about the message itself
TIMED_OUT = KafkaError._MSG_TIMED_OUT  # about the broker, not the message
PATIENCE = 200  # waits before give_up says yes: a mutant that waits forever fails fast


def event(number: int, payload: bytes | None = b"{}") -> OutboxEvent:
    return OutboxEvent(
        id=f"e{number}",
        aggregate_type="order",
        aggregate_id=f"a{number % 2}",
        event_type="created",
        payload=payload,
        commit_lsn=100 + number,
        xid=1,
        commit_time_us=0,
    )


class ClientRefuses(Sink):
    """Refuses the events of ``refuse`` in ``offer``, as the client does one larger than its
    message.max.bytes (the report comes before ``offer`` returns True)."""

    refuse: frozenset[str] = frozenset()

    def __init__(
        self, on_ack: Callable[[Any], None], on_refused: Callable[..., None], log: list[str]
    ) -> None:
        super().__init__(on_ack, on_refused)
        self.log = log  # the stages' log: offers and polls among the reports

    def offer(self, message: Message, token: Any) -> bool:
        self.log.append(f"offer {event_id(message)}")
        if event_id(message) in self.refuse:
            self.on_refused(token, KafkaError(TOO_LARGE))
            return True
        return super().offer(message, token)

    def poll(self, timeout: float) -> None:
        self.log.append("poll")
        super().poll(timeout)


class Stages:
    """The checkpointer and the refusal policy at once, recording every call in one log
    with the sink's (offers, polls) and the hooks', so a test can assert on their order."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.ticks = 0
        self.stop = False  # a stop was asked for: give_up() is true (as after PATIENCE ticks)
        self.in_flight_at: dict[str, int] = {}  # what the sink held at each verdict
        self.pipeline = Pipeline(
            Router("outbox.{aggregate_type}", False, None),
            self._open_sink,
            self,
            self,
            tick=self._tick,
            give_up=lambda: self.stop or self.ticks > PATIENCE,
            before_alone=lambda: self._note("before_alone"),
            after_alone=lambda: self._note("after_alone"),
        )
        sink = self.pipeline.sink
        assert isinstance(sink, ClientRefuses)
        self.sink = sink

    def _open_sink(self, on_ack: Callable[[Any], None], on_refused: Callable[..., None]) -> Sink:
        return ClientRefuses(on_ack, on_refused, self.log)

    def _tick(self) -> None:
        self.ticks += 1

    def _note(self, entry: str) -> None:
        self.log.append(entry)
        self.in_flight_at[entry] = self.sink.in_flight()

    def acked(self, token: Any) -> None:
        self.log.append(f"acked {token}")

    def refused(self, token: Any, err: KafkaError) -> None:
        self.log.append(f"refused {token} {err.code()}")

    def served(self) -> None:
        self.log.append("served")

    def culprit(self, message: Message, token: Any, err: KafkaError) -> None:
        assert event_id(message) == token  # the refused event's own message
        self._note(f"culprit {token} {err.code()}")

    def retry(self, token: Any, err: KafkaError) -> None:
        self._note(f"retry {token} {err.code()}")

    def cleared(self, token: Any) -> None:
        self._note(f"cleared {token}")

    def unroutable(self, token: Any, exc: RelayError) -> None:
        self._note(f"unroutable {token} {type(exc).__name__}")

    def publish(self, number: int, alone: bool = False, payload: bytes | None = b"{}") -> None:
        # The token is the event id: each report names the event it is about.
        self.pipeline.publish(event(number, payload), f"e{number}", alone)

    def of(self, kind: str) -> list[str]:
        return [entry for entry in self.log if entry.startswith(kind)]


def test_events_reach_the_sink_in_order_and_each_ack_carries_its_own_token() -> None:
    stages = Stages()
    for number in range(6):
        stages.publish(number)
    stages.pipeline.settle()

    assert [event_id for event_id, _ in stages.sink.offered] == [f"e{n}" for n in range(6)]
    assert stages.of("acked") == [f"acked e{n}" for n in range(6)]
    assert [m.topic for m in stages.sink.acked] == ["outbox.order"] * 6  # the real router's


def test_a_full_queue_makes_publish_wait_and_offer_again_dropping_nothing() -> None:
    stages = Stages()
    stages.sink.capacity = 2
    for number in range(7):
        stages.publish(number)
    stages.pipeline.settle()

    assert stages.sink.full > 0  # the queue was full: the test proves the wait
    assert stages.ticks > 0  # the feed ticked on while it waited (the stream's status)
    # Every event offered once accepted, in order, never more than the queue holds beside it.
    assert [event_id for event_id, _ in stages.sink.offered] == [f"e{n}" for n in range(7)]
    assert all(beside < 2 for _, beside in stages.sink.offered)
    assert stages.of("acked") == [f"acked e{n}" for n in range(7)]
    # Reports were served while waiting: an ack came before the later events were offered.
    assert stages.log.index("acked e0") < stages.log.index("offer e6")


def test_a_refusal_among_others_goes_to_refused_then_served_after_each_poll() -> None:
    stages = Stages()
    stages.sink.poison["e1"] = TOO_LARGE  # Kafka refuses the batch holding it: both
    stages.publish(0)
    stages.publish(1)
    stages.pipeline.settle()

    assert stages.of("refused") == [f"refused e0 {TOO_LARGE}", f"refused e1 {TOO_LARGE}"]
    # Among others, nobody knows whose fault it is: a suspect, never a verdict here.
    assert not stages.of("culprit") and not stages.of("acked")
    polls_then_served = [e for e in stages.log if e in ("poll", "served")]
    assert polls_then_served == ["poll", "served"] * stages.log.count("poll")
    assert stages.log.index("refused e1 " + str(TOO_LARGE)) < stages.log.index("served")


def test_the_clients_refusal_in_offer_is_the_culprit_after_all_in_flight_settled() -> None:
    stages = Stages()
    stages.sink.refuse = frozenset({"e1"})
    stages.sink.hold = {"e0"}  # in flight when e1 is refused, reported at the next poll
    stages.sink.on_poll = stages.sink.hold.clear
    stages.publish(0)
    stages.publish(1)
    stages.publish(2)
    stages.pipeline.settle()

    assert stages.of("culprit") == [f"culprit e1 {TOO_LARGE}"]
    assert stages.in_flight_at[f"culprit e1 {TOO_LARGE}"] == 0
    # Settled first: e0's report reached the checkpointer before the verdict on e1.
    assert stages.log.index("acked e0") < stages.log.index(f"culprit e1 {TOO_LARGE}")
    assert not stages.of("refused")
    assert stages.log.count("offer e1") == 1  # refused is final: not offered again
    assert stages.of("acked") == ["acked e0", "acked e2"]


class ServesInOffer(ClientRefuses):
    """Serves the reports it holds at the start of ``offer``, as a sink may (polling before it
    produces): a refusal served then is of another message than the one offered."""

    def offer(self, message: Message, token: Any) -> bool:
        self._report()
        return super().offer(message, token)


def test_a_refusal_of_another_message_served_inside_offer_stays_that_messages() -> None:
    stages = Stages()
    sink = ServesInOffer(stages.pipeline._acked, stages.pipeline._refused, stages.log)
    stages.pipeline.sink = stages.sink = sink
    sink.poison["e0"] = TOO_LARGE
    stages.publish(0)
    stages.publish(1)  # e0's refusal is served inside this offer
    stages.pipeline.settle()

    assert stages.of("refused") == [f"refused e0 {TOO_LARGE}"]  # a suspect, e0's
    assert not stages.of("culprit")  # e1 was never refused


def one_then_one_alone() -> Stages:
    """e0 published and held until the next poll, then e1 alone."""
    stages = Stages()
    stages.sink.hold = {"e0"}
    stages.sink.on_poll = stages.sink.hold.clear
    stages.publish(0)
    stages.publish(1, alone=True)
    return stages


def test_alone_settles_first_then_offers_with_nothing_beside_it_and_clears_on_ack() -> None:
    stages = one_then_one_alone()

    assert stages.sink.offered == [("e0", 0), ("e1", 0)]  # e0 reported before e1 went
    assert stages.of("acked") == ["acked e0", "acked e1"]
    assert stages.of("cleared") == ["cleared e1"]
    assert stages.log.index("acked e1") < stages.log.index("cleared e1")
    assert not stages.of("culprit") and not stages.of("retry") and not stages.of("refused")


@pytest.mark.parametrize(
    ("code", "verdict"),
    [(TOO_LARGE, "culprit"), (KafkaError.UNKNOWN_TOPIC_OR_PART, "culprit"), (TIMED_OUT, "retry")],
)
def test_alone_a_refusal_about_the_message_is_the_culprit_any_other_a_retry(
    code: int, verdict: str
) -> None:
    assert is_culprit(KafkaError(code)) is (verdict == "culprit")  # the premise, refusals'
    stages = Stages()
    stages.sink.poison["e0"] = code
    stages.publish(0, alone=True)

    assert stages.of(verdict) == [f"{verdict} e0 {code}"]
    # Alone, the report is the message's own: never a suspect, never cleared.
    assert not stages.of("refused") and not stages.of("cleared") and not stages.of("acked")
    assert stages.sink.in_flight() == 0


def test_the_clients_refusal_of_a_lone_message_is_the_culprit() -> None:
    stages = Stages()
    stages.sink.refuse = frozenset({"e0"})
    stages.publish(0, alone=True)

    assert stages.of("culprit") == [f"culprit e0 {TOO_LARGE}"]
    assert not stages.of("refused") and not stages.of("cleared")


@pytest.mark.parametrize("alone", [False, True])
def test_an_event_the_router_refuses_is_unroutable_and_never_offered(alone: bool) -> None:
    stages = Stages()
    stages.publish(0, alone, payload=None)  # NULL payload, without --tombstone-on-empty-payload
    stages.publish(1, alone)

    assert stages.of("unroutable") == ["unroutable e0 SchemaError"]
    assert [event_id for event_id, _ in stages.sink.offered] == ["e1"]  # the next goes on
    # Refused before any of the lone path: its hooks ran for e1 only.
    assert stages.log.count("before_alone") == (1 if alone else 0)


def test_before_alone_and_after_alone_run_around_the_lone_offer_in_that_order() -> None:
    stages = one_then_one_alone()

    lone = stages.log[stages.log.index("before_alone") :]
    # Before: after the settle, nothing in flight (the transaction committed before it);
    # after: it is offered and not yet reported (its own transaction, then its report).
    assert lone[:3] == ["before_alone", "offer e1", "after_alone"]
    assert stages.in_flight_at == {"before_alone": 0, "after_alone": 1, "cleared e1": 0}
    assert lone.index("after_alone") < lone.index("acked e1") < lone.index("cleared e1")
    assert stages.log.index("acked e0") < stages.log.index("before_alone")


class Feed:
    """A scripted feed (cdc_relay.relay.stages.Feed): each pump runs the next step of the script."""

    def __init__(self, stages: Stages, *steps: Callable[[Feed], None]) -> None:
        self.stages = stages
        self.steps = list(steps)
        self.calls: list[str] = []
        self.stopped = False
        self.recovered: list[ConnectionLost] = []

    def pump(self) -> None:
        self.calls.append("pump")
        assert self.steps, "pumped again after the script ended"
        self.steps.pop(0)(self)

    def recover(self, exc: ConnectionLost) -> None:
        self.calls.append("recover")
        self.recovered.append(exc)

    def rewind(self) -> None:
        self.calls.append("rewind")

    def shutdown(self) -> None:
        self.calls.append("shutdown")


LOST = ConnectionLost("the walsender went away")


def lose(feed: Feed) -> None:
    raise LOST


def refuse(feed: Feed) -> None:
    raise Rewind


def publish_and_stop(feed: Feed) -> None:
    feed.stages.publish(0)
    feed.stopped = True


def test_run_recovers_a_lost_connection_and_rewinds_then_pumps_again() -> None:
    stages = Stages()
    feed = Feed(stages, lose, refuse, lose, publish_and_stop)
    stages.pipeline.run(feed)

    pumps = ["pump", "recover", "pump", "rewind", "pump", "recover", "pump"]
    assert feed.calls == [*pumps, "shutdown"]
    assert feed.recovered == [LOST, LOST]  # the exception itself, for its message
    assert [event_id for event_id, _ in stages.sink.offered] == ["e0"]


def test_stopping_from_a_wait_for_kafka_ends_the_loop_with_one_shutdown() -> None:
    def wait_forever(feed: Feed) -> None:
        feed.stages.sink.hold = {"e0"}  # never reported: only the stop ends the wait
        feed.stages.publish(0)
        feed.stages.stop = True  # give_up() is true: the next wait raises Stopping
        feed.stages.pipeline.settle()

    stages = Stages()
    feed = Feed(stages, wait_forever, publish_and_stop)
    stages.pipeline.run(feed)  # Stopping does not propagate

    assert not feed.stopped  # the loop ended by Stopping, not by the feed's own stop
    assert feed.calls == ["pump", "shutdown"]


def test_a_wait_for_kafka_serves_ticks_and_raises_stopping_only_once_give_up_says_so() -> None:
    stages = Stages()
    stages.pipeline.wait_for_kafka()  # give_up() is false: it returns
    stages.stop = True
    with pytest.raises(Stopping):
        stages.pipeline.wait_for_kafka()
    assert stages.ticks == 2
    assert stages.log == ["poll", "served", "poll", "served"]


def test_another_error_from_pump_propagates_after_one_shutdown() -> None:
    def broken(feed: Feed) -> None:
        raise ValueError("a bug in the feed")

    stages = Stages()
    feed = Feed(stages, lose, broken)
    with pytest.raises(ValueError, match="a bug in the feed"):
        stages.pipeline.run(feed)
    assert feed.calls == ["pump", "recover", "pump", "shutdown"]


def test_a_feed_already_stopped_is_only_shut_down() -> None:
    stages = Stages()
    feed = Feed(stages)
    feed.stopped = True
    stages.pipeline.run(feed)
    assert feed.calls == ["shutdown"]
