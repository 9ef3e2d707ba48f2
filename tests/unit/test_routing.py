from __future__ import annotations

import pytest
from capture import pgoutput_messages

from cdc_relay import pgoutput
from cdc_relay.errors import DeliveryError, UsageError
from cdc_relay.events import Begin, Insert, OutboxEvent, Relation, RowMapper
from cdc_relay.routing import Router


def captured_event() -> OutboxEvent:
    begin, relation, insert, _ = (pgoutput.decode(m) for m in pgoutput_messages("single insert"))
    assert isinstance(begin, Begin) and isinstance(relation, Relation)
    assert isinstance(insert, Insert)
    return RowMapper.for_relation(relation).event(insert, begin)


def test_default_route_matches_the_outbox_event_router_convention() -> None:
    message = Router().route(captured_event())
    assert message.topic == "outbox.event.order"
    assert message.key == b"o-1"
    assert message.value == b'{"items": [1, 2], "total": 42}'
    assert message.headers == [
        ("id", b"6f1c1b7e-2a51-4c43-9d0e-3f5d2b8a9c01"),
        ("event_type", b"order.created"),
        ("aggregate_type", b"order"),
    ]


def test_template_may_use_event_type() -> None:
    router = Router("events.{aggregate_type}.{event_type}")
    assert router.route(captured_event()).topic == "events.order.order.created"


@pytest.mark.parametrize("template", ["x.{tenant}", "x.{aggregate_type", "x.{0}"])
def test_bad_templates_are_usage_errors(template: str) -> None:
    with pytest.raises(UsageError):
        Router(template)


def test_illegal_topic_names_stop_with_the_event_named() -> None:
    event = captured_event()
    bad = OutboxEvent(**{**_fields(event), "aggregate_type": "order lines"})
    with pytest.raises(DeliveryError, match=event.id):
        Router().route(bad)


def _fields(event: OutboxEvent) -> dict[str, object]:
    return {name: getattr(event, name) for name in OutboxEvent.__slots__}
