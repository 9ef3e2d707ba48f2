"""The metrics the alert rules and the dashboard rely on are the ones cdc-relay defines."""

from __future__ import annotations

import pytest
from deploytools import METRIC_LABELS, METRICS
from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

from cdc_relay import metrics

pytestmark = pytest.mark.deploy


def exported() -> dict[str, tuple[str, set[str]]]:
    """name as Prometheus stores it -> (type, label names), for every metric of the module."""
    found = {}
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase):
            kind = {Counter: "counter", Gauge: "gauge", Histogram: "histogram"}[type(value)]
            name = value._name + ("_total" if kind == "counter" else "")
            found[name] = (kind, set(value._labelnames))
    return found


def test_the_code_defines_every_metric_deploy_relies_on() -> None:
    code = exported()
    assert set(METRICS) <= set(code), set(METRICS) - set(code)
    for name, kind in METRICS.items():
        assert code[name] == (kind, METRIC_LABELS.get(name, set())), name
