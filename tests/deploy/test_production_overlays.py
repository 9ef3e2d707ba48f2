"""The production overlays (standby, sharded, reshard, poll): built on the base, not on the
example; no Secret (applying them leaves the ones the user made alone) and nothing of the
example (hosts, addresses, image); the site's placeholders cannot reach anything; the relays'
pods prefer different nodes; the Kafka client's settings come from a Secret as a properties
file; the nightly prune runs by the stream's slot (by none in poll, not at all in shards);
poll runs the polling relay as the poller's role."""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Any

import click
import pytest
from deploytools import (
    BASE,
    CONFIG_FILE,
    DEPLOY,
    OVERLAY,
    POLL,
    PRODUCTION,
    ROOT,
    command_of,
    config_file,
    kustomization,
    kustomize_command,
    named,
    of_kind,
    pod_templates,
    relay_workloads,
    render,
    resource_files,
    selects,
    stream_workloads,
)
from psycopg.conninfo import conninfo_to_dict

from cdc_relay.commands.cli import cli
from cdc_relay.config import DEFAULT_SLOT

pytestmark = [
    pytest.mark.deploy,
    pytest.mark.skipif(kustomize_command() is None, reason="neither kustomize nor kubectl here"),
]

Objects = list[dict[str, Any]]
KAFKA_SECRET = "cdc-relay-kafka"  # noqa: S105 - a Secret's name
NEVER_ROUTED = [ipaddress.ip_network(n) for n in ("192.0.2.0/24", "198.51.100.0/24")]


def production_ids(folder: Any) -> str:
    return str(folder.name)


@pytest.fixture(scope="module", params=PRODUCTION, ids=production_ids)
def production(request: pytest.FixtureRequest) -> Objects:
    return render(request.param)


def example_values() -> set[str]:
    """What the example overlay names of its site: hosts, addresses, image, passwords."""
    objects = render(OVERLAY)
    settings = config_file(objects)
    values = {conninfo_to_dict(settings["dsn"])["host"]}
    brokers = settings["kafka-bootstrap"].split(",")
    values |= {server.rsplit(":", 1)[0] for server in brokers}
    policy = named(objects, "NetworkPolicy", "cdc-relay")
    assert policy is not None
    values |= {
        peer["ipBlock"]["cidr"]
        for rule in policy["spec"]["egress"]
        for peer in rule.get("to", [])
        if "ipBlock" in peer
    }
    for secret in of_kind(objects, "Secret"):
        values.add(secret["stringData"]["password"])
    (image,) = kustomization(OVERLAY)["images"]
    values.add(image["newName"])
    return values


def test_building_on_the_base_with_the_sites_component_not_on_the_example() -> None:
    for folder in PRODUCTION:
        spec = kustomization(folder)
        assert "secretGenerator" not in spec, folder.name
        assert not any("example" in entry for entry in spec.get("resources", [])), folder.name
        files = list(resource_files(folder))
        assert all(path.is_relative_to(BASE) for path in files), folder.name
        if folder.name != "reshard":  # the sharded overlay's, with its patches
            components = {(folder / c).resolve().name for c in spec["components"]}
            assert components == {"site", "kafka-sasl"}, folder.name


def test_no_secret_and_nothing_of_the_example(production: Objects) -> None:
    """Applying the overlay as docs/kubernetes.md says leaves the Secrets made by hand as they
    are."""
    assert not of_kind(production, "Secret")
    text = "\n".join(str(obj) for obj in production)
    found = {value for value in example_values() if value in text}
    assert not found, f"the example's: {found}"
    assert "example" not in text.lower()


def test_the_sites_placeholders_reach_nothing(production: Objects) -> None:
    data = config_file(production)
    hosts = [conninfo_to_dict(data["dsn"])["host"]]
    hosts += [server.rsplit(":", 1)[0] for server in data["kafka-bootstrap"].split(",")]
    for _, template in pod_templates(production):
        for container in template["spec"]["containers"]:
            hosts.append(container["image"].split("/", 1)[0])
    assert hosts and all(host.endswith(".invalid") for host in hosts), hosts
    policy = named(production, "NetworkPolicy", "cdc-relay")
    assert policy is not None
    for rule in policy["spec"]["egress"]:
        for peer in rule.get("to", []):
            if "ipBlock" in peer:
                network = ipaddress.ip_network(peer["ipBlock"]["cidr"])
                assert any(network.subnet_of(n) for n in NEVER_ROUTED), network


def test_the_docs_have_the_user_make_every_secret_the_pods_name(production: Objects) -> None:
    page = (ROOT / "docs" / "kubernetes.md").read_text()
    made = set(re.findall(r"kubectl -n cdc-relay create secret generic (\S+)", page))
    named_by_pods = {
        ref["name"]
        for _, template in pod_templates(production)
        for container in template["spec"]["containers"]
        for variable in container.get("env", [])
        if (ref := variable.get("valueFrom", {}).get("secretKeyRef"))
    }
    named_by_pods |= {
        volume["secret"]["secretName"]
        for _, template in pod_templates(production)
        for volume in template["spec"].get("volumes", [])
        if "secret" in volume
    }
    assert named_by_pods <= made, named_by_pods - made


# -- anti-affinity ---------------------------------------------------------------------------


def test_relay_pods_prefer_other_nodes_and_zones_than_their_peers() -> None:
    """Every overlay's relays (the standby pair, the shards, the pollers, the new shards of
    a reshard beside the old): preferred, so that a rolling update's extra pod and a drained
    node's pod can still be placed on a small cluster."""
    for folder in (OVERLAY, *PRODUCTION):
        objects = render(folder)
        relays = relay_workloads(objects)
        assert relays, folder.name
        for workload, template in relays:
            affinity = template["spec"]["affinity"]
            assert set(affinity) == {"podAntiAffinity"}, "preferred, not required"
            terms = affinity["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
            by_key = {t["podAffinityTerm"]["topologyKey"]: t for t in terms}
            assert set(by_key) == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}
            assert (
                by_key["kubernetes.io/hostname"]["weight"]
                > by_key["topology.kubernetes.io/zone"]["weight"]
            ), "a node before a zone"
            for term in terms:
                selector = term["podAffinityTerm"]["labelSelector"]
                for _, peer in relays:  # its own pods, and those of every relay beside it
                    assert selects(selector, peer["metadata"]["labels"]), folder.name
                for job in of_kind(objects, "Job"):
                    labels = job["spec"]["template"]["metadata"]["labels"]
                    assert not selects(selector, labels), "the Jobs' pods are no peers"
            name = workload["metadata"]["name"]
            replicas = workload["spec"]["replicas"]
            assert replicas == 1 or folder in PRODUCTION, f"{name}: {replicas} replicas"


# -- the Kafka client's settings from a Secret ----------------------------------------------


def test_the_relays_read_the_kafka_client_properties_from_the_secret(production: Objects) -> None:
    for workload, template in relay_workloads(production):
        spec = template["spec"]
        (container,) = spec["containers"]
        (volume,) = [v for v in spec["volumes"] if "secret" in v]
        secret = volume["secret"]
        assert secret["secretName"] == KAFKA_SECRET
        assert secret.get("optional") is not True, "a missing Secret stops the pod, visibly"
        (item,) = secret["items"]
        assert item["key"] == "client.properties"
        assert secret["defaultMode"] & 0o007 == 0, "no other user reads the password"
        assert spec["securityContext"]["fsGroup"] == spec["securityContext"]["runAsGroup"]
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
        assert mount["readOnly"] is True
        env = {v["name"]: v.get("value") for v in container["env"]}
        path = env["CDC_RELAY_KAFKA_CONFIG_FILE"]
        assert path == f"{mount['mountPath']}/{item['path']}", workload["metadata"]["name"]
        command = cli.commands[command_of(template)]
        option = next(p for p in command.params if p.name == "kafka_config_file")
        assert option.envvar == "CDC_RELAY_KAFKA_CONFIG_FILE"
        assert "CDC_RELAY_KAFKA_SASL_PASSWORD" not in env, "the password stays in the file"
    # The Jobs and the prune talk to PostgreSQL alone: no Kafka Secret for them.
    for _, template in pod_templates(production):
        if command_of(template) not in ("stream", "poll"):
            volumes = template["spec"].get("volumes", [])
            assert not [v for v in volumes if "secret" in v], "no Kafka credentials"


def test_the_example_keeps_its_kafka_settings_in_the_configmap() -> None:
    objects = render(OVERLAY)
    for _, template in pod_templates(objects):
        assert not any("secret" in v for v in template["spec"].get("volumes", []))


# -- the nightly prune -----------------------------------------------------------------------


def the_prune(objects: Objects) -> tuple[dict[str, Any], list[str]]:
    (cronjob,) = of_kind(objects, "CronJob")
    (container,) = cronjob["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    return cronjob, list(container["args"])


def prune_params(objects: Objects, args: list[str], tmp_path: Path) -> dict[str, Any]:
    """The options prune would run with: the CronJob's args over the ConfigMap's file, which
    its pod mounts (tests/deploy/test_k8s_config_file.py checks where)."""
    config = named(objects, "ConfigMap", "cdc-relay")
    assert config is not None
    path = tmp_path / CONFIG_FILE
    path.write_text(config["data"][CONFIG_FILE])
    parent = click.Context(cli, info_name="cdc-relay")
    context = cli.commands["prune"].make_context(
        "prune", [*args[1:], "--config", str(path)], parent=parent
    )
    return dict(context.params)


@pytest.mark.parametrize("folder", [OVERLAY, DEPLOY / "overlays" / "standby"], ids=production_ids)
def test_a_stream_outbox_is_pruned_by_the_streams_slot(folder: Any, tmp_path: Path) -> None:
    objects = render(folder)
    cronjob, args = the_prune(objects)
    slot = config_file(objects).get("slot", DEFAULT_SLOT)  # the stream's: the top level's
    params = prune_params(objects, args, tmp_path)
    assert params["slot"] == slot
    assert params["older_than"].days == 7
    assert cronjob["spec"]["concurrencyPolicy"] == "Forbid"
    (workload,) = stream_workloads(objects)
    (container,) = workload[1]["spec"]["containers"]
    assert not any(v["name"] == "CDC_RELAY_SLOT" for v in container.get("env", []))


def test_a_polled_outbox_is_pruned_by_processed_rows_and_shards_not_at_all(
    tmp_path: Path,
) -> None:
    objects = render(POLL)
    _, args = the_prune(objects)
    assert prune_params(objects, args, tmp_path)["slot"] is None
    for folder in PRODUCTION:
        if folder.name in ("sharded", "reshard"):
            assert not of_kind(render(folder), "CronJob"), folder.name


def test_the_prune_runs_nightly_and_gives_up_in_time() -> None:
    cronjob, _ = the_prune(render(OVERLAY))
    spec = cronjob["spec"]
    assert re.fullmatch(r"\d+ \d+ \* \* \*", spec["schedule"]), "once a day"
    job = spec["jobTemplate"]["spec"]
    assert job["activeDeadlineSeconds"] <= 3600 and job["backoffLimit"] <= 3
    template = job["template"]
    assert template["spec"]["restartPolicy"] == "Never"
    assert "ports" not in template["spec"]["containers"][0]


# -- poll ------------------------------------------------------------------------------------


def test_the_poll_overlay_runs_pollers_and_applies_schema_poller() -> None:
    objects = render(POLL)
    (deployment,) = of_kind(objects, "Deployment")
    template = deployment["spec"]["template"]
    assert command_of(template) == "poll"
    assert deployment["spec"]["replicas"] == 2, "pollers claim side by side"
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    assert template["metadata"]["labels"]["app.kubernetes.io/component"] == "poll"
    assert not stream_workloads(objects), "no stream, no slot"
    (job,) = of_kind(objects, "Job")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["args"] == ["schema", "apply", "poller"]
    schema = cli.commands["schema"]
    assert "apply" in schema.commands  # type: ignore[attr-defined]
    # (the ConfigMap's file, shared with the stream overlays, has a [setup-slot] table that no
    # command of this overlay reads)
    others = [obj for obj in objects if obj["kind"] not in ("PrometheusRule", "ConfigMap")]
    assert not any("setup-slot" in str(obj) for obj in others)
