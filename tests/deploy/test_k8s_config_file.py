"""The ConfigMap is one TOML file, cdc-relay.toml, that the setup Job and the stream pods
mount and name in CDC_RELAY_CONFIG: each command takes what it has options for, so a setting
of the stream does not make the Job exit 2 (docs/configuration.md, "The configuration file")."""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath
from typing import Any

import click
import pytest
from click.testing import CliRunner
from deploytools import (
    BASE,
    CONFIG_FILE,
    OVERLAY,
    config_file,
    expanded_env,
    named,
    objects_of,
    pod_templates,
    resource_files,
)

from cdc_relay.commands.cli import cli
from cdc_relay.errors import RelayError, UsageError

pytestmark = pytest.mark.deploy

Objects = list[dict[str, Any]]
NO_DATABASE = "host=127.0.0.1 port=1 dbname=shop connect_timeout=1"


def the_container(template: dict[str, Any]) -> dict[str, Any]:
    (container,) = template["spec"]["containers"]
    return container


def mounted_config(template: dict[str, Any]) -> str:
    """Where the pod finds the file: CDC_RELAY_CONFIG, checked against the ConfigMap's
    volume and its mount."""
    container = the_container(template)
    env = {v["name"]: v for v in container.get("env", [])}
    path = PurePosixPath(env["CDC_RELAY_CONFIG"]["value"])
    assert path.name == CONFIG_FILE
    volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
    mounts = [m for m in container.get("volumeMounts", []) if m["mountPath"] == str(path.parent)]
    assert len(mounts) == 1, f"nothing mounted at {path.parent}"
    (mount,) = mounts
    assert mount.get("readOnly") is True
    assert "subPath" not in mount, "a subPath mount never sees the ConfigMap change"
    volume = volumes[mount["name"]]
    assert volume["configMap"]["name"] == "cdc-relay"
    assert "items" not in volume["configMap"]
    return str(path)


def test_every_pod_reads_the_file_and_no_pod_takes_the_configmap_as_variables(
    overlay_objects: Objects,
) -> None:
    config_file(overlay_objects)  # the one key, TOML
    templates = pod_templates(overlay_objects)
    assert templates
    for workload, template in templates:
        container = the_container(template)
        assert not [
            source for source in container.get("envFrom", []) if "configMapRef" in source
        ], f"{workload['metadata']['name']}: the ConfigMap holds a file, not variables"
        mounted_config(template)


def parse_as_the_pod(
    template: dict[str, Any], path: Path, monkeypatch: pytest.MonkeyPatch
) -> click.Context:
    """The options of the pod's command as it parses them: its args, its plain variables
    (pod 0's, for a StatefulSet) and the ConfigMap's file, nothing run."""
    container = the_container(template)
    monkeypatch.setenv("CDC_RELAY_CONFIG", str(path))
    for name, value in expanded_env(container, {"POD_INDEX": "0"}).items():
        if name == "CDC_RELAY_KAFKA_CONFIG_FILE":  # a Secret's file (test_production_overlays)
            properties = path.with_name("client.properties")
            properties.touch()
            monkeypatch.setenv(name, str(properties))
        elif name != "CDC_RELAY_CONFIG":
            monkeypatch.setenv(name, value)
    parent = click.Context(cli, info_name="cdc-relay")
    command: click.Command = cli
    args = list(container["args"])
    while isinstance(command, click.Group):  # schema apply poller: a group's command
        name = args.pop(0)
        command = command.commands[name]
        if isinstance(command, click.Group):
            parent = click.Context(command, info_name=name, parent=parent)
    return command.make_context(name, args, parent=parent)


def test_each_workloads_command_parses_the_file_it_mounts(
    overlay_objects: Objects, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / CONFIG_FILE
    config = named(overlay_objects, "ConfigMap", "cdc-relay")
    assert config is not None
    path.write_text(config["data"][CONFIG_FILE])
    settings = config_file(overlay_objects)
    for _, template in pod_templates(overlay_objects):
        with monkeypatch.context() as env:
            context = parse_as_the_pod(template, path, env)
        assert context.params["dsn"] == settings["dsn"]
        if "slot" in context.params and context.command.name != "prune":
            assert context.params["slot"] == settings["slot"]


@pytest.mark.parametrize("command", ["setup-slot", "stream"])
@pytest.mark.parametrize("folder", [BASE, OVERLAY], ids=["base", "example"])
def test_config_show_of_the_job_and_the_stream(command: str, folder: Path, tmp_path: Path) -> None:
    config = named(objects_of(resource_files(folder)), "ConfigMap", "cdc-relay")
    assert config is not None
    path = tmp_path / CONFIG_FILE
    path.write_text(config["data"][CONFIG_FILE])
    result = CliRunner().invoke(
        cli, ["config", "show", command, "--json"], env={"CDC_RELAY_CONFIG": str(path)}
    )
    assert result.exit_code == 0, (result.output, result.exception)
    settings = json.loads(result.output)["settings"]
    assert settings["dsn"]["source"] == f"file:{path} top level"
    assert settings["kafka-bootstrap"]["source"] == f"file:{path} top level"
    if command == "setup-slot":
        assert settings["create-table"] == {"value": False, "source": f"file:{path} [setup-slot]"}
    else:
        assert settings["status-interval"]["source"] == f"file:{path} [stream]"
        assert settings["metrics-port"]["value"] == 9464


def test_a_setting_of_the_stream_at_the_top_level_leaves_the_job_alone(tmp_path: Path) -> None:
    """Issue 27's case: CDC_RELAY_HEADER_COLUMN in the ConfigMap the Job shared with the stream
    made setup-slot exit 2. In the file, at the top level, the Job runs on: it reaches the
    database (none here), past every check of its options."""
    config = named(objects_of(resource_files(BASE)), "ConfigMap", "cdc-relay")
    assert config is not None
    path = tmp_path / CONFIG_FILE
    text = config["data"][CONFIG_FILE]
    path.write_text('header-column = ["traceparent"]\ningore-messages = true\n' + text)
    result = CliRunner().invoke(cli, ["setup-slot"], env={"CDC_RELAY_CONFIG": str(path)})
    assert isinstance(result.exception, UsageError)  # a typo stops both
    assert "ingore-messages (top level): no command has an option" in str(result.exception)
    path.write_text('header-column = ["traceparent"]\n' + text)
    result = CliRunner().invoke(
        cli,
        ["setup-slot"],
        env={"CDC_RELAY_CONFIG": str(path), "CDC_RELAY_DSN": NO_DATABASE},
    )
    assert isinstance(result.exception, RelayError), result.output
    assert not isinstance(result.exception, UsageError), result.exception
    assert str(result.exception).startswith("cannot connect to PostgreSQL")
