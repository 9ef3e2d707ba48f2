"""The setup Job creates a missing outbox table only when the ConfigMap turns it on."""

from __future__ import annotations

import pytest
from deploytools import BASE, named, objects_of, resource_files

from cdc_relay.commands.cli import cli

pytestmark = pytest.mark.deploy


def test_the_setup_job_creates_the_table_when_the_configmap_says_true(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    objects = objects_of(resource_files(BASE))
    config = named(objects, "ConfigMap", "cdc-relay")
    job = named(objects, "Job", "cdc-relay-setup-slot")
    assert config is not None and job is not None
    assert config["data"]["CDC_RELAY_CREATE_TABLE"] == "false"  # off unless an overlay says so
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["args"][0] == "setup-slot"
    assert {"configMapRef": {"name": "cdc-relay"}} in container["envFrom"]
    setup = cli.commands["setup-slot"]
    option = next(p for p in setup.params if p.name == "create_table")
    assert option.envvar == "CDC_RELAY_CREATE_TABLE"
    # The stream pods read the same ConfigMap: the setting means nothing to them.
    assert "create_table" not in {p.name for p in cli.commands["stream"].params}
    for value, expected in (("false", False), ("true", True)):
        monkeypatch.setenv("CDC_RELAY_CREATE_TABLE", value)
        context = setup.make_context("setup-slot", ["--dsn", "dbname=shop"])
        assert context.params["create_table"] is expected
