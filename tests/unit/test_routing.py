from __future__ import annotations

import threading
from dataclasses import replace

import pytest
from capture import pgoutput_messages

from cdc_relay.errors import UsageError
from cdc_relay.events import Begin, Insert, OutboxEvent, Relation, RowMapper, SchemaError
from cdc_relay.kafka.routing import Router, TopicTaken, check_template, fill_table, legal_topic
from cdc_relay.postgres import pgoutput


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


@pytest.mark.parametrize(
    "template",
    [
        "x.{tenant}",
        "x.{aggregate_type",
        "x.{0}",
        "outbox.{}",
        "{aggregate_type:d}",
        "{aggregate_type:{w}}",
        "{aggregate_type!r}",
        "{aggregate_type!s}",
        "{aggregate_type.x}",
        "{aggregate_type[0]}",
        "{0}",
        "x.}",
    ],
)
def test_bad_templates_are_usage_errors(template: str) -> None:
    with pytest.raises(UsageError, match=r"may use \{aggregate_type\} and \{event_type\}"):
        check_template(template)
    with pytest.raises(UsageError):
        Router(template)


@pytest.mark.parametrize(
    "template",
    [
        "",  # an empty topic for every event
        "..",
        "outbox events",  # no field: always the same illegal name
        "{{literal}}",
        "t" * 250,
        "x" * 250 + ".{aggregate_type}",  # cut, whatever the event
    ],
)
def test_templates_that_only_make_illegal_topics_are_refused(template: str) -> None:
    with pytest.raises(UsageError, match="249"):
        check_template(template)


@pytest.mark.parametrize(
    ("template", "topic"),
    [
        ("outbox", "outbox"),  # one topic for all
        ("{aggregate_type}", "order"),
        ("{{x}}.{event_type}", "_x_.order.created"),  # literal braces, made legal as before
        ("t" * 249, "t" * 249),
    ],
)
def test_good_templates_pass_the_check_and_route(template: str, topic: str) -> None:
    assert check_template(template) == template
    assert Router(template).route(captured_event()).topic == topic


@pytest.mark.parametrize(
    ("aggregate_type", "topic"),
    [
        ("order lines", "outbox.event.order_lines"),
        ("Ünïcode/ok", "outbox.event._n_code_ok"),
    ],
)
def test_illegal_topic_names_map_to_legal_ones(aggregate_type: str, topic: str) -> None:
    event = replace(captured_event(), aggregate_type=aggregate_type)
    assert Router().route(event).topic == topic


def test_long_topic_names_are_cut_and_kept_apart_by_a_digest() -> None:
    event = replace(captured_event(), aggregate_type="a" * 300)
    routed = Router().route(event).topic
    assert len(routed) == 249
    assert routed.startswith("outbox.event." + "a" * 227 + "-")
    assert routed != Router().route(replace(event, aggregate_type="a" * 301)).topic


def test_legal_topic_leaves_legal_names_alone() -> None:
    assert legal_topic("outbox.event.order-v2_x") == "outbox.event.order-v2_x"
    assert legal_topic("..") == "__"


def test_null_aggregate_id_gives_a_null_key() -> None:
    assert Router().route(replace(captured_event(), aggregate_id=None)).key is None


def test_null_payload_stops_unless_tombstones_are_asked_for() -> None:
    event = replace(captured_event(), payload=None)
    with pytest.raises(SchemaError, match="--tombstone-on-empty-payload"):
        Router().route(event)
    assert Router(tombstone_on_empty=True).route(event).value is None
    empty = replace(captured_event(), payload=b"")
    assert Router().route(empty).value == b""
    assert Router(tombstone_on_empty=True).route(empty).value is None


def test_header_columns_follow_the_standard_headers() -> None:
    event = replace(captured_event(), headers=(("tenant", b"t-1"),))
    assert Router().route(event).headers[-1] == ("tenant", b"t-1")


def test_schema_and_table_name_each_rows_outbox_table() -> None:
    router = Router("{schema}.{table}.{aggregate_type}", by_table=True)
    event = captured_event()
    tenant_a = replace(event, source=("tenant_a", "outbox_events"))
    tenant_b = replace(event, source=("tenant_b", "outbox_events"))
    assert router.route(tenant_a).topic == "tenant_a.outbox_events.order"
    assert router.route(tenant_b).topic == "tenant_b.outbox_events.order"
    # The cache keeps the tables apart: the same types, another table, another topic.
    assert router.route(tenant_a).topic == "tenant_a.outbox_events.order"


def test_table_fields_are_made_legal_like_the_others() -> None:
    router = Router("outbox.{schema}.{event_type}", by_table=True)
    event = replace(captured_event(), source=("Tenant A", "outbox"))
    assert router.route(event).topic == "outbox.Tenant_A.order.created"


def test_mapper_gives_its_events_the_source() -> None:
    begin, relation, insert, _ = (pgoutput.decode(m) for m in pgoutput_messages("single insert"))
    assert isinstance(begin, Begin) and isinstance(relation, Relation)
    assert isinstance(insert, Insert)
    mapper = RowMapper.for_relation(relation, source=("tenant_b", "outbox_events"))
    event = mapper.event(insert, begin)
    assert event.source == ("tenant_b", "outbox_events")
    assert Router("{table}-{schema}", by_table=True).route(event).topic == (
        "outbox_events-tenant_b"
    )


def test_a_template_without_table_fields_ignores_the_source() -> None:
    event = captured_event()
    assert event.source is None
    sourced = replace(event, source=("tenant_a", "outbox_events"))
    for by_table in (False, True):
        router = Router(by_table=by_table)
        assert router.route(event) == router.route(sourced) == Router().route(event)


@pytest.mark.parametrize("template", ["{schema}", "x.{table}", "{schema}.{table}"])
def test_table_fields_are_refused_where_events_carry_no_table(template: str) -> None:
    assert check_template(template) == template  # the option itself is fine
    with pytest.raises(UsageError, match="only cdc-relay stream tells apart"):
        Router(template)  # as poll makes it


def test_a_message_event_cannot_be_routed_by_table() -> None:
    event = captured_event()  # as from a logical decoding message: no source
    with pytest.raises(SchemaError, match="belongs to no table"):
        Router("{schema}.{aggregate_type}", by_table=True).route(event)


@pytest.mark.parametrize("template", ["{schema!r}", "{table:>9}", "{table.x}", "{schema[0]}"])
def test_table_fields_take_no_conversion_or_spec(template: str) -> None:
    with pytest.raises(UsageError, match=r"\{schema\} and \{table\}"):
        check_template(template)


def test_fill_table_names_the_one_table_and_leaves_the_other_fields() -> None:
    assert fill_table("{{x}}.{schema}.{table}.{aggregate_type}", "a{b}", "t") == (
        "{{x}}.a{{b}}.t.{aggregate_type}"
    )
    template = fill_table("{schema}.{aggregate_type}", "tenant_b", "outbox_events")
    assert Router(template).route(captured_event()).topic == "tenant_b.order"


def typed(aggregate_type: str, number: int = 1) -> OutboxEvent:
    """The captured event with another aggregate type and its own id."""
    return replace(
        captured_event(),
        aggregate_type=aggregate_type,
        id=f"00000000-0000-0000-0000-{number:012d}",
        aggregate_id=f"k{number}",
    )


@pytest.mark.parametrize(
    ("first", "second"), [("order/line", "order_line"), ("order_line", "order/line")]
)
def test_the_second_aggregate_type_made_into_a_topic_already_made_is_refused(
    first: str, second: str
) -> None:
    router = Router()
    assert router.route(typed(first, 1)).topic == "outbox.event.order_line"
    refused = typed(second, 2)
    with pytest.raises(TopicTaken) as taken:
        router.route(refused)
    text = str(taken.value)
    assert "\n" not in text
    assert text.startswith(
        f"aggregate types '{second}' and '{first}' both make topic outbox.event.order_line "
    ), text
    assert f"event {refused.id} ({refused.event_type}, aggregate k2)" in text, text
    assert "characters Kafka does not allow in a topic name become _" in text, text
    # Where it would have gone, for the dead letters: the message as the router makes it.
    message = taken.value.message
    assert (message.topic, message.key, message.value) == (
        "outbox.event.order_line",
        b"k2",
        refused.payload,
    )
    assert message.headers[:3] == [
        ("id", refused.id.encode()),
        ("event_type", refused.event_type.encode()),
        ("aggregate_type", second.encode()),
    ]
    # The first keeps its topic, the second stays refused, whatever else comes between.
    assert router.route(typed("order", 3)).topic == "outbox.event.order"
    assert router.route(typed(first, 4)).topic == "outbox.event.order_line"
    with pytest.raises(TopicTaken):
        router.route(typed(second, 5))


def test_names_kafka_refuses_alike_are_kept_apart_and_the_same_name_is_no_collision() -> None:
    router = Router()
    assert router.route(typed("gr\u00f6\u00dfe")).topic == "outbox.event.gr__e"
    assert router.route(typed("gr\u00f6\u00dfe", 2)).topic == "outbox.event.gr__e"
    with pytest.raises(TopicTaken, match="'gr\u0153\u00dfe' and 'gr\u00f6\u00dfe' both make"):
        router.route(typed("gr\u0153\u00dfe", 3))
    # Other event types of one aggregate type make one name: the template has no event_type.
    assert router.route(replace(typed("gr\u00f6\u00dfe", 4), event_type="other")).topic == (
        "outbox.event.gr__e"
    )
    # Names cut to 249 characters stay apart by their digest.
    assert router.route(typed("a" * 300)).topic != router.route(typed("a" * 301)).topic


def test_with_other_fields_in_the_template_the_names_it_made_are_told() -> None:
    router = Router("outbox.{aggregate_type}.{event_type}")
    router.route(replace(typed("order"), event_type="line/added"))
    with pytest.raises(TopicTaken) as taken:
        router.route(replace(typed("order", 2), event_type="line_added"))
    assert str(taken.value).startswith(
        "--topic-template 'outbox.{aggregate_type}.{event_type}' makes topic "
        "outbox.order.line_added of 'outbox.order.line_added' and of 'outbox.order.line/added' "
    ), str(taken.value)


def test_threads_sharing_a_router_agree_on_which_name_a_topic_is_of() -> None:
    router = Router()
    start = threading.Barrier(8)
    outcomes: list[str] = []

    def route(n: int) -> None:
        start.wait()
        try:
            router.route(typed(("order/line", "order_line")[n % 2], n))
        except TopicTaken:
            outcomes.append("refused")
        else:
            outcomes.append("routed")

    threads = [threading.Thread(target=route, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["refused"] * 4 + ["routed"] * 4


@pytest.mark.xfail(
    strict=True,
    reason="open: which aggregate type a topic is for lasts one run; a restart may meet the "
    "other first",
)
def test_a_restart_that_meets_the_refused_aggregate_type_first_lets_both_into_one_topic() -> None:
    """Adversarial review: the refusal of a second aggregate type making a topic already made
    is held in one router's memory only. The relay stops at the refused event (no dead-letter
    topic) and resumes from the slot, whose first event is now that refused one: a new router
    meets it first and routes it, and refuses the first type instead. Across one restart the
    topic holds both types' events, the mix the refusal exists to prevent, and the operator saw
    a stop that a restart 'healed'. (Poll with --max-attempts, and shards that meet the two in
    different orders, do the same.)"""
    into: dict[str, set[str]] = {}
    before = Router()  # the run before the stop
    message = before.route(typed("order_line", 1))
    into.setdefault(message.topic, set()).add("order_line")
    with pytest.raises(TopicTaken):
        before.route(typed("order/line", 2))  # the relay stops here; nothing after confirmed
    after = Router()  # the same relay started again: the slot replays from event 2
    try:
        message = after.route(typed("order/line", 2))
    except TopicTaken:
        pass
    else:
        into.setdefault(message.topic, set()).add("order/line")
    assert into == {"outbox.event.order_line": {"order_line"}}, (
        "both aggregate types were routed into one topic across a restart"
    )
