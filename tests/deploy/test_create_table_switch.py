"""The setup Job creates a missing outbox table only when the ConfigMap's file turns it on."""

from __future__ import annotations

from pathlib import Path

import click
import pytest
from deploytools import BASE, CONFIG_FILE, named, objects_of, resource_files

from cdc_relay.commands.cli import cli

pytestmark = pytest.mark.deploy


def test_the_setup_job_creates_the_table_when_the_configmap_says_true(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    objects = objects_of(resource_files(BASE))
    config = named(objects, "ConfigMap", "cdc-relay")
    job = named(objects, "Job", "cdc-relay-setup-slot")
    assert config is not None and job is not None
    text = config["data"][CONFIG_FILE]
    assert "\ncreate-table = false\n" in text  # off unless an overlay says so
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["args"][0] == "setup-slot"
    setup = cli.commands["setup-slot"]
    option = next(p for p in setup.params if p.name == "create_table")
    assert option.envvar == "CDC_RELAY_CREATE_TABLE"
    # The stream pods read the same file: the setting, in [setup-slot], is nothing to them.
    assert "create_table" not in {p.name for p in cli.commands["stream"].params}
    for value, expected in (("false", False), ("true", True)):
        path = tmp_path / CONFIG_FILE
        path.write_text(text.replace("create-table = false", f"create-table = {value}"))
        monkeypatch.setenv("CDC_RELAY_CONFIG", str(path))
        parent = click.Context(cli, info_name="cdc-relay")
        context = setup.make_context("setup-slot", [], parent=parent)
        assert context.params["create_table"] is expected
