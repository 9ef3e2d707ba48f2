"""deploy/overlays/standby: two pods on one slot, the second a hot standby."""

from __future__ import annotations

import pytest
from deploytools import STANDBY, kustomize_command, named, render

from cdc_relay.commands.cli import cli

pytestmark = pytest.mark.deploy


@pytest.mark.skipif(kustomize_command() is None, reason="neither kustomize nor kubectl here")
def test_standby_overlay_runs_two_replicas_with_standby_and_rolling_updates() -> None:
    objects = render(STANDBY)
    deployment = named(objects, "Deployment", "cdc-relay")
    assert deployment is not None
    spec = deployment["spec"]
    assert spec["replicas"] == 2
    assert spec["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    (container,) = spec["template"]["spec"]["containers"]
    assert container["args"] == ["stream"]
    assert {"name": "CDC_RELAY_STANDBY", "value": "true"} in container["env"]
    standby = next(p for p in cli.commands["stream"].params if p.name == "standby")
    assert standby.envvar == "CDC_RELAY_STANDBY"
    context = cli.commands["stream"].make_context(
        "stream", ["--dsn", "dbname=shop", "--kafka-bootstrap", "k:9092"]
    )
    assert context.params["standby"] is False, "the variable unset, no standby"
