"""docker-compose.yml: valid Compose, and `docker compose up` starts things in the right order."""

from __future__ import annotations

import re
import shutil
import subprocess
from typing import Any

import pytest
import yaml
from deploytools import METRICS_PORT, ROOT, relay_settings, tool

pytestmark = pytest.mark.deploy

COMPOSE_FILE = ROOT / "docker-compose.yml"
# Services whose image has a HEALTHCHECK of its own (the Dockerfile they are built from).
IMAGE_HEALTHCHECKS = {"Dockerfile", "postgres.Dockerfile"}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(COMPOSE_FILE.read_text())
    return document


def compose_cli() -> list[str] | None:
    """`docker compose` (the plugin) or a standalone `docker-compose` v2."""
    docker = shutil.which("docker")
    if docker:
        probe = subprocess.run(
            [docker, "compose", "version"], capture_output=True, text=True, check=False
        )
        if probe.returncode == 0:
            return [docker, "compose"]
    standalone = shutil.which("docker-compose")
    return [standalone] if standalone else None


def test_docker_compose_config_accepts_the_file() -> None:
    command = compose_cli()
    if command is None:
        pytest.skip(
            "no Docker Compose: the docker client here has no compose plugin and there is no "
            "docker-compose; the compose-spec schema test below still checks the file"
        )
    result = subprocess.run(
        [*command, "--file", str(COMPOSE_FILE), "config", "--quiet"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


def test_the_file_follows_the_compose_specification() -> None:
    checker = tool("check-jsonschema")
    assert checker, "check-jsonschema comes with the dev extra"
    result = subprocess.run(
        [checker, "--builtin-schema", "vendor.compose-spec", str(COMPOSE_FILE)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def healthchecked(service: dict[str, Any]) -> bool:
    check = service.get("healthcheck")
    if check is not None:
        return not check.get("disable", False)
    build = service.get("build")
    if isinstance(build, str):
        build = {"context": build}
    return bool(build) and build.get("dockerfile", "Dockerfile") in IMAGE_HEALTHCHECKS


def test_dependencies_exist_and_their_conditions_can_be_met(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name, service in services.items():
        for dependency, spec in service.get("depends_on", {}).items():
            assert dependency in services, f"{name} depends on unknown {dependency}"
            condition = spec["condition"]
            if condition == "service_healthy":
                assert healthchecked(services[dependency]), f"{dependency} has no healthcheck"
            elif condition == "service_completed_successfully":
                assert services[dependency].get("restart", "no") == "no", dependency
            else:
                pytest.fail(f"{name} -> {dependency}: {condition} does not wait for readiness")


def test_the_relay_starts_after_the_slot_exists_and_kafka_is_up(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert services["setup-slot"]["command"] == ["setup-slot"]
    assert services["setup-slot"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    relay = services["relay"]
    assert relay["command"] == ["stream"]
    assert relay["depends_on"] == {
        "setup-slot": {"condition": "service_completed_successfully"},
        "kafka": {"condition": "service_healthy"},
    }
    assert relay["environment"]["CDC_RELAY_METRICS_PORT"] == str(METRICS_PORT)
    assert any(port.endswith(f":{METRICS_PORT}") for port in relay["ports"])
    # the writer starts after the slot exists, so the slot sees its first order
    writer = services["order-writer"]
    assert writer["depends_on"]["setup-slot"]["condition"] == "service_completed_successfully"
    assert writer["entrypoint"][-1] == "/opt/demo/order_writer.py"
    assert (ROOT / "demo" / "order_writer.py").is_file()


def test_postgres_has_logical_decoding_wal2json_and_the_outbox(compose: dict[str, Any]) -> None:
    postgres = compose["services"]["postgres"]
    assert "wal_level=logical" in postgres["command"]
    dockerfile = ROOT / postgres["build"]["context"] / postgres["build"]["dockerfile"]
    assert "wal2json" in dockerfile.read_text()
    mounts = dict(volume.split(":")[:2] for volume in postgres["volumes"])
    assert mounts["./cdc_relay/sql/outbox.sql"].startswith("/docker-entrypoint-initdb.d/")
    for source in mounts:
        assert (ROOT / source).exists(), source
    # the outbox table before the demo's: the init scripts run in name order
    assert sorted(mounts.values())[0] == mounts["./cdc_relay/sql/outbox.sql"]


def test_kafka_is_one_kraft_node_from_the_official_image(compose: dict[str, Any]) -> None:
    kafka = compose["services"]["kafka"]
    assert re.fullmatch(r"apache/kafka:\d+\.\d+\.\d+", kafka["image"])
    environment = kafka["environment"]
    assert environment["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert "ZOOKEEPER" not in " ".join(environment)
    assert environment["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"] == "1"


def test_kafka_creates_no_topic_on_demand_and_the_relay_makes_its_topics(
    compose: dict[str, Any],
) -> None:
    """As production brokers run: automatic creation on would hide a relay that cannot make
    its topics."""
    assert compose["services"]["kafka"]["environment"]["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"
    for name in ("setup-slot", "relay"):
        environment = compose["services"][name]["environment"]
        assert environment["CDC_RELAY_CREATE_TOPICS"] == "true", name


def test_no_password_in_a_dsn_and_none_written_out(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        environment = service.get("environment", {})
        dsn = environment.get("CDC_RELAY_DSN", "")
        assert not re.search(r"password|://[^/@]*:[^/@]*@", dsn, re.IGNORECASE), name
        for key in ("PGPASSWORD", "POSTGRES_PASSWORD"):
            if key in environment:
                assert re.fullmatch(r"\$\{POSTGRES_PASSWORD(:?-[^}]*)?\}", environment[key]), (
                    f"{name}: {key} should come from the POSTGRES_PASSWORD variable"
                )


def test_the_relay_services_set_only_settings_the_relay_reads(compose: dict[str, Any]) -> None:
    known = relay_settings("stream", "setup-slot")
    for name, service in compose["services"].items():
        settings = {key for key in service.get("environment", {}) if key.startswith("CDC_RELAY_")}
        assert settings <= known, f"{name}: {settings - known}"
