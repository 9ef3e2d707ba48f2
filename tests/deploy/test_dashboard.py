"""The Grafana dashboard queries cdc-relay's metrics, all of them, and nothing else."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from deploytools import (
    DEPLOY,
    METRIC_LABELS,
    METRICS,
    selected_names,
    series_names,
    without_grafana_variables,
)

pytestmark = pytest.mark.deploy

DASHBOARD = DEPLOY / "grafana" / "cdc-relay.json"
GRID_WIDTH = 24


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    document: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return document


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable."""
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            yield panel["title"], without_grafana_variables(target["expr"])
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"]
            match = re.fullmatch(r"label_values\((.+), *(\w+)\)", query)
            assert match, f"${variable['name']}: {query}"
            yield f"${variable['name']}", without_grafana_variables(match.group(1))


def test_every_query_parses_and_uses_only_cdc_relay_metrics(dashboard: dict[str, Any]) -> None:
    allowed = series_names()
    for where, expr in queries(dashboard):
        try:
            used = selected_names(expr)
        except ValueError as exc:
            pytest.fail(f"{where}: {exc}: {expr}")
        assert used and used <= allowed, f"{where}: {used - allowed or 'no metric'}"


def test_every_metric_is_on_the_dashboard(dashboard: dict[str, Any]) -> None:
    used = {name for _, expr in queries(dashboard) for name in selected_names(expr)}
    shown = {name.removesuffix("_bucket") for name in used}
    assert set(METRICS) <= shown, set(METRICS) - shown


def test_histograms_show_quantiles_and_counters_rates(dashboard: dict[str, Any]) -> None:
    for where, expr in queries(dashboard):
        for name, kind in METRICS.items():
            if re.search(rf"\b{name}(_bucket)?\b", expr):
                if kind == "histogram":
                    assert "histogram_quantile(" in expr and f"{name}_bucket" in expr, where
                    assert re.search(r"by \([^)]*\ble\b", expr), where
                if kind == "counter":
                    assert re.search(rf"(rate|increase)\({name}", expr), where


def test_grouping_uses_labels_the_series_have(dashboard: dict[str, Any]) -> None:
    target_labels = {"namespace", "pod", "le"}
    for where, expr in queries(dashboard):
        own = set().union(*(METRIC_LABELS.get(name, set()) for name in selected_names(expr)))
        for group in re.findall(r"by \(([^)]*)\)", expr):
            labels = {label.strip() for label in group.split(",")}
            assert labels <= own | target_labels, f"{where}: {labels - own - target_labels}"


def test_layout_ids_and_data_source(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] == "cdc-relay"
    ids = [panel["id"] for panel in panels(dashboard)]
    assert len(ids) == len(set(ids))
    variables = {variable["name"] for variable in dashboard["templating"]["list"]}
    assert "datasource" in variables
    occupied: set[tuple[int, int]] = set()
    for panel in panels(dashboard):
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= GRID_WIDTH, panel["title"]
        cells = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not cells & occupied, f"{panel['title']} overlaps another panel"
        occupied |= cells
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            for target in panel["targets"]:
                assert target["datasource"]["uid"] == "${datasource}", panel["title"]
