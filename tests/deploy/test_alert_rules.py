"""The alert rules: one copy (the PrometheusRule), a valid Prometheus rules file when extracted,
every expression valid PromQL over cdc-relay's own metrics, every template label kept."""

from __future__ import annotations

import re
from typing import Any

import jsonschema
import promql_parser
import pytest
import yaml
from crd_schemas import RULE_GROUPS
from deploytools import BASE, DEPLOY, METRICS, load_docs, selected_names, series_names

pytestmark = pytest.mark.deploy

RULES_FILE = BASE / "prometheusrule.yaml"
GiB = 1024**3

# alert -> (a piece of its expression, its `for`): the thresholds cdc-relay promises.
EXPECTED = {
    "OutboxEventsPendingHigh": ("(outbox_events_pending) > 1000", "2m"),
    "OutboxEventsPendingGrowing": ("deriv(outbox_events_pending[10m]) > 0", "10m"),
    "OutboxDeadLetters": ("(outbox_dead_letters) > 0", None),
    "OutboxEventsFailing": ("increase(outbox_events_failed_total[5m])", None),
    "OutboxBatchSlow": ("histogram_quantile(0.95,", "5m"),
    "CdcRelayMetricsAbsent": ("absent(outbox_events_pending)", "10m"),
    "CdcRelayWalRetainedHigh": (f"(cdc_relay_slot_wal_retained_bytes) > {GiB}", "5m"),
    "CdcRelaySlotNearInvalidation": ("cdc_relay_slot_safe_wal_bytes)) > 0.8", "5m"),
    "CdcRelaySlotInvalidated": ("max_over_time(cdc_relay_slot_invalidated[1h])) > 0", None),
    "CdcRelayFailoverNotReady": ("(cdc_relay_slot_failover_ready) == 0", "5m"),
    "CdcRelayDisconnected": ("(cdc_relay_connected) == 0 unless on (namespace, pod)", "2m"),
    "CdcRelayStandbyDisconnected": ("(cdc_relay_connected) == 0 and on (namespace, pod)", "2m"),
    "CdcRelayNoneStreaming": ("min by (namespace) (cdc_relay_standby) == 1", "5m"),
    "CdcRelayLatencyHigh": ("histogram_quantile(0.99,", "5m"),
}


@pytest.fixture(scope="module")
def rules_file() -> dict[str, Any]:
    """What a Prometheus without the Operator loads: the PrometheusRule's spec."""
    (rule,) = load_docs(RULES_FILE)
    spec: dict[str, Any] = rule["spec"]
    # The same round trip as `yq '.spec'`: plain YAML, nothing Kubernetes-specific left.
    extracted: dict[str, Any] = yaml.safe_load(yaml.safe_dump(spec))
    return extracted


@pytest.fixture(scope="module")
def alerts(rules_file: dict[str, Any]) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for group in rules_file["groups"]:
        for rule in group["rules"]:
            assert rule["alert"] not in found, f"{rule['alert']} twice"
            found[rule["alert"]] = rule
    return found


def test_the_prometheus_rule_is_the_only_copy_of_the_rules() -> None:
    holders = [
        path
        for path in DEPLOY.rglob("*.y*ml")
        if any("groups" in doc or "groups" in doc.get("spec", {}) for doc in load_docs(path))
    ]
    assert holders == [RULES_FILE]


def test_extracted_it_is_a_prometheus_rules_file(rules_file: dict[str, Any]) -> None:
    jsonschema.Draft202012Validator(RULE_GROUPS).validate(rules_file)
    names = [group["name"] for group in rules_file["groups"]]
    assert len(names) == len(set(names))


def test_the_promised_alerts_and_thresholds(alerts: dict[str, dict[str, Any]]) -> None:
    assert set(alerts) == set(EXPECTED)
    for name, (piece, duration) in EXPECTED.items():
        rule = alerts[name]
        assert piece in " ".join(rule["expr"].split()), f"{name}: {rule['expr']}"
        assert rule.get("for") == duration, name
        assert re.search(r"> 5$", rule["expr"].strip()) or "histogram" not in rule["expr"], name


def test_every_expression_parses_and_uses_only_cdc_relay_metrics(
    alerts: dict[str, dict[str, Any]],
) -> None:
    allowed = series_names()
    for name, rule in alerts.items():
        try:
            used = selected_names(rule["expr"])
        except ValueError as exc:
            pytest.fail(f"{name}: {exc}: {rule['expr']}")
        assert used, name
        assert used <= allowed, f"{name}: not cdc-relay's: {used - allowed}"


def test_histograms_are_read_through_their_buckets_by_le(alerts: dict[str, dict[str, Any]]) -> None:
    for name, rule in alerts.items():
        expr = " ".join(rule["expr"].split())
        for histogram in (m for m, kind in METRICS.items() if kind == "histogram"):
            if histogram in expr:
                assert f"{histogram}_bucket" in expr and "histogram_quantile(" in expr, name
                assert re.search(r"by \([^)]*\ble\b", expr), f"{name}: aggregate keeping le"


def output_labels(node: Any) -> set[str] | None:
    """The labels an expression's result keeps; None when it keeps the selected series' own."""
    if isinstance(node, promql_parser.ParenExpr):
        return output_labels(node.expr)
    if isinstance(node, promql_parser.BinaryExpr):
        if isinstance(node.lhs, promql_parser.NumberLiteral):
            return output_labels(node.rhs)
        return output_labels(node.lhs)
    if isinstance(node, promql_parser.AggregateExpr):
        modifier = node.modifier
        if modifier is None:
            return set()
        assert modifier.type == promql_parser.AggModifierType.By, "aggregate `by`, not `without`"
        return set(modifier.labels)
    if isinstance(node, promql_parser.Call):
        if node.func.name == "absent":
            return set()
        if node.func.name == "histogram_quantile":
            inner = output_labels(node.args[1])
            return None if inner is None else inner - {"le"}
        return output_labels(node.args[0])
    if isinstance(node, promql_parser.MatrixSelector):
        return None
    return None


def test_annotations_name_only_labels_the_alert_has(alerts: dict[str, dict[str, Any]]) -> None:
    for name, rule in alerts.items():
        kept = output_labels(promql_parser.parse(rule["expr"]))
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert {"summary", "description"} <= set(rule["annotations"]), name
        for text in rule["annotations"].values():
            assert text.count("{{") == text.count("}}"), f"{name}: {text}"
            for label in re.findall(r"\$labels\.(\w+)", text):
                assert kept is None or label in kept, f"{name}: {label} is aggregated away"


# -- what the rules say of a standby, evaluated ---------------------------------------------

Series = list[tuple[dict[str, str], float]]
COMPARISONS = {
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
    ">": lambda a, b: a > b,
    "<": lambda a, b: a < b,
    ">=": lambda a, b: a >= b,
    "<=": lambda a, b: a <= b,
}
AGGREGATIONS = {"max": max, "min": min, "sum": sum, "count": len}


def evaluate(node: Any, series: Series) -> Series:
    """An instant query over ``series`` (labels with __name__, value), as Prometheus answers
    it, for what the rules of a relay's connection and role use: selectors with = matchers,
    max/min/sum/count by, comparisons with a number (filters), and/unless on(...). Anything
    else fails the test rather than being guessed at."""
    if isinstance(node, promql_parser.ParenExpr):
        return evaluate(node.expr, series)
    if isinstance(node, promql_parser.VectorSelector):
        wanted = {"__name__": node.name} if node.name else {}
        for matcher in node.matchers.matchers:
            assert str(matcher.op) == str(promql_parser.MatchOp.Equal), matcher
            wanted[matcher.name] = matcher.value
        return [(labels, value) for labels, value in series if wanted.items() <= labels.items()]
    if isinstance(node, promql_parser.AggregateExpr):
        assert node.modifier is not None and node.modifier.type == promql_parser.AggModifierType.By
        keep = list(node.modifier.labels)
        groups: dict[tuple[str, ...], list[float]] = {}
        for labels, value in evaluate(node.expr, series):
            groups.setdefault(tuple(labels.get(k, "") for k in keep), []).append(value)
        return [
            ({k: v for k, v in zip(keep, key, strict=True) if v}, AGGREGATIONS[str(node.op)](vs))
            for key, vs in groups.items()
        ]
    assert isinstance(node, promql_parser.BinaryExpr), f"not evaluated here: {node}"
    op = str(node.op)
    if op in COMPARISONS:
        assert isinstance(node.rhs, promql_parser.NumberLiteral), "a filter by a number"
        assert not (node.modifier and node.modifier.return_bool), "no bool modifier"
        compare, number = COMPARISONS[op], node.rhs.val
        return [(labels, v) for labels, v in evaluate(node.lhs, series) if compare(v, number)]
    assert op in ("and", "unless"), op
    matching = node.modifier.matching if node.modifier else None
    assert matching is not None and matching.type == promql_parser.LabelModifierType.Include

    def key(labels: dict[str, str]) -> tuple[str, ...]:
        return tuple(labels.get(name, "") for name in matching.labels)

    right = {key(labels) for labels, _ in evaluate(node.rhs, series)}
    left = evaluate(node.lhs, series)
    return [(labels, v) for labels, v in left if (key(labels) in right) == (op == "and")]


def firing(alerts: dict[str, dict[str, Any]], series: Series) -> set[tuple[str, str]]:
    """(alert, pod or namespace) of every rule about connections and roles whose expression
    returns something: what fires once ``for`` has passed with these values."""
    fired = set()
    for name in ("CdcRelayDisconnected", "CdcRelayStandbyDisconnected", "CdcRelayNoneStreaming"):
        for labels, _ in evaluate(promql_parser.parse(alerts[name]["expr"]), series):
            where = labels.get("pod", labels["namespace"])
            fired.add((name, f"{where}/{labels['service']}" if "service" in labels else where))
    return fired


def relay(pod: str, postgres: int, kafka: int, standby: int, namespace: str = "cdc") -> Series:
    """A relay's gauges as Prometheus stores them, with the labels of its target."""
    target = {"namespace": namespace, "pod": pod, "job": "cdc-relay"}
    return [
        ({"__name__": "cdc_relay_connected", "service": "postgres", **target}, postgres),
        ({"__name__": "cdc_relay_connected", "service": "kafka", **target}, kafka),
        ({"__name__": "cdc_relay_standby", **target}, standby),
    ]


def test_the_evaluator_answers_as_prometheus_does(alerts: dict[str, dict[str, Any]]) -> None:
    """The piece of PromQL the evaluation below rests on, on the rule as it was: the waiting
    standby of the issue (connected to postgres 0) fired the critical alert."""
    old = promql_parser.parse("max by (namespace, pod, service) (cdc_relay_connected) == 0")
    series = relay("a", 1, 1, 0) + relay("b", 0, 1, 1)
    assert evaluate(old, series) == [({"namespace": "cdc", "pod": "b", "service": "postgres"}, 0)]
    both = promql_parser.parse("max by (namespace) (cdc_relay_standby) == 1")
    assert evaluate(both, series) == [({"namespace": "cdc"}, 1)]
    with pytest.raises(AssertionError):
        evaluate(promql_parser.parse("rate(cdc_relay_standby[5m])"), series)


@pytest.mark.parametrize(
    ("series", "expected"),
    [
        pytest.param(relay("a", 1, 1, 0), set(), id="one relay streaming"),
        pytest.param(
            relay("a", 1, 1, 0) + relay("b", 1, 1, 1),
            set(),
            id="a pair: one streams, the other waits (PostgreSQL answers it)",
        ),
        pytest.param(
            relay("a", 0, 1, 0) + relay("b", 1, 1, 1),
            {("CdcRelayDisconnected", "a/postgres")},
            id="the streaming relay lost PostgreSQL",
        ),
        pytest.param(
            relay("a", 1, 0, 0) + relay("b", 1, 1, 1),
            {("CdcRelayDisconnected", "a/kafka")},
            id="the streaming relay lost Kafka",
        ),
        pytest.param(
            relay("a", 1, 1, 0) + relay("b", 0, 1, 1),
            {("CdcRelayStandbyDisconnected", "b/postgres")},
            id="the standby cannot reach PostgreSQL to wait",
        ),
        pytest.param(
            relay("a", 1, 1, 0) + relay("b", 1, 0, 1),
            {("CdcRelayStandbyDisconnected", "b/kafka")},
            id="the standby cannot reach Kafka",
        ),
        pytest.param(
            relay("a", 1, 1, 1) + relay("b", 1, 1, 1),
            {("CdcRelayNoneStreaming", "cdc")},
            id="both wait: something else holds the slot",
        ),
        pytest.param(
            relay("a", 1, 1, 1) + relay("b", 1, 1, 0, namespace="other"),
            {("CdcRelayNoneStreaming", "cdc")},
            id="per namespace",
        ),
    ],
)
def test_a_waiting_standby_is_left_alone_and_what_cannot_take_over_is_not(
    alerts: dict[str, dict[str, Any]], series: Series, expected: set[tuple[str, str]]
) -> None:
    assert firing(alerts, series) == expected
