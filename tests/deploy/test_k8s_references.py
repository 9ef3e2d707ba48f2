"""The kustomizations list every file, and every name, selector and port in them resolves."""

from __future__ import annotations

import re
from typing import Any

import pytest
from deploytools import (
    KUSTOMIZATIONS,
    METRICS_PORT,
    ROOT,
    command_of,
    config_file,
    container_env,
    container_ports,
    kustomization,
    named,
    of_kind,
    pod_templates,
    relay_workloads,
    selects,
    setting,
)

pytestmark = pytest.mark.deploy

Objects = list[dict[str, Any]]
POSTGRES_PORT = 5432
DNS_PORT = 53


@pytest.mark.parametrize("folder", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(ROOT)))
def test_kustomization_lists_every_file_of_its_folder(folder: Any) -> None:
    spec = kustomization(folder)
    listed = [entry for entry in spec.get("resources", []) if "/" not in entry]
    listed += [patch["path"] for patch in spec.get("patches", []) if "path" in patch]
    assert len(listed) == len(set(listed)), "a file listed twice"
    present = {path.name for path in folder.iterdir() if path.name != "kustomization.yaml"}
    assert set(listed) == present
    for entry in spec.get("resources", []):
        assert (folder / entry).exists(), entry


# What the Jobs of the overlays run: once, as the outbox table's owner.
ADMIN_COMMANDS = {"setup-slot", "reshard", "drop-slot", "schema"}
# The Secrets docs/kubernetes.md has the user make, and their keys.
USER_SECRETS = {
    "cdc-relay-stream-db": {"username", "password"},
    "cdc-relay-poller-db": {"username", "password"},
    "cdc-relay-setup-db": {"username", "password"},
    "cdc-relay-prune-db": {"username", "password"},
    "cdc-relay-kafka": {"client.properties"},
}


def relay_templates(objects: Objects) -> list[dict[str, Any]]:
    """The pod template of every relay workload (a Deployment, or StatefulSets of shards)."""
    templates = [template for _, template in relay_workloads(objects)]
    assert templates, "no workload runs cdc-relay stream or poll"
    return templates


def containers(template: dict[str, Any]) -> list[dict[str, Any]]:
    spec = template["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def test_every_workload_selects_its_own_pods(overlay_objects: Objects) -> None:
    for workload, template in pod_templates(overlay_objects):
        labels = template["metadata"]["labels"]
        selector = workload["spec"].get("selector")
        if selector is not None:
            assert selects(selector, labels), workload["metadata"]["name"]


def test_a_stateful_sets_service_exists_and_selects_its_pods(overlay_objects: Objects) -> None:
    for workload in of_kind(overlay_objects, "StatefulSet"):
        service = named(overlay_objects, "Service", workload["spec"]["serviceName"])
        assert service is not None, workload["spec"]["serviceName"]
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert selects(service["spec"]["selector"], labels)


def secret_keys(objects: Objects, name: str) -> set[str]:
    """The keys of Secret ``name``: the overlay's own (the example's), or, where the overlay
    makes no Secret (the production ones), those docs/kubernetes.md has the user make it with."""
    if of_kind(objects, "Secret"):
        secret = named(objects, "Secret", name)
        assert secret, name
        return {*secret.get("data", {}), *secret.get("stringData", {})}
    assert name in USER_SECRETS, f"{name}: not a Secret docs/kubernetes.md tells to make"
    return USER_SECRETS[name]


def test_config_secret_and_service_account_references_resolve(overlay_objects: Objects) -> None:
    for _, template in pod_templates(overlay_objects):
        account = template["spec"]["serviceAccountName"]
        assert named(overlay_objects, "ServiceAccount", account), account
        for container in containers(template):
            for source in container.get("envFrom", []):
                if "configMapRef" in source:
                    assert named(overlay_objects, "ConfigMap", source["configMapRef"]["name"])
                assert "secretRef" not in source, "each secret by name and key"
        for volume in template["spec"].get("volumes", []):
            if "configMap" in volume:
                assert named(overlay_objects, "ConfigMap", volume["configMap"]["name"])
            for variable in container.get("env", []):
                ref = variable.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secret_keys(overlay_objects, ref["name"]), ref
            mounted = {mount["name"] for mount in container.get("volumeMounts", [])}
            for volume in template["spec"].get("volumes", []):
                if "secret" in volume:
                    assert volume["name"] in mounted, volume["name"]
                    keys = secret_keys(overlay_objects, volume["secret"]["secretName"])
                    assert {item["key"] for item in volume["secret"]["items"]} <= keys


def test_the_settings_are_the_relays_and_hold_no_password(overlay_objects: Objects) -> None:
    settings = config_file(overlay_objects)
    assert {"dsn", "kafka-bootstrap"} <= set(settings)
    assert not re.search(r"password|://[^/@]*:[^/@]*@", settings["dsn"], re.I)
    assert not [key for key in settings if "password" in key]
    assert setting(overlay_objects, "metrics-port") == METRICS_PORT
    for _, template in pod_templates(overlay_objects):
        for container in containers(template):
            assert not any(v["name"] == "PGPASSWORD" and "value" in v for v in container["env"])
            assert not any("password" in arg.lower() for arg in container.get("args", []))


def test_probes_use_the_health_endpoints_on_the_metrics_port(overlay_objects: Objects) -> None:
    for template in relay_templates(overlay_objects):
        (container,) = template["spec"]["containers"]
        assert container["args"] in (["stream"], ["poll"])
        ports = container_ports(template)
        assert ports == {"metrics": METRICS_PORT}
        expected = {
            "livenessProbe": "/healthz",
            "readinessProbe": "/readyz",
            "startupProbe": "/healthz",
        }
        for probe, path in expected.items():
            get = container[probe]["httpGet"]
            assert get["path"] == path
            assert get["port"] in ports or get["port"] in ports.values()


def test_one_stream_per_slot_and_time_to_stop_cleanly(overlay_objects: Objects) -> None:
    for workload, template in relay_workloads(overlay_objects):
        # A second pod on one slot only waits for it, and only as a standby; pollers share.
        (container,) = template["spec"]["containers"]
        standby = container_env(container).get("CDC_RELAY_STANDBY", "false") == "true"
        standby = standby or setting(overlay_objects, "standby") is True
        if workload["kind"] == "Deployment" and command_of(template) == "stream" and not standby:
            assert workload["spec"]["replicas"] == 1
            assert workload["spec"]["strategy"] == {"type": "Recreate"}
        grace = template["spec"]["terminationGracePeriodSeconds"]
        assert grace > float(setting(overlay_objects, "shutdown-timeout"))


def test_the_jobs_run_admin_commands_of_the_same_image(overlay_objects: Objects) -> None:
    jobs = of_kind(overlay_objects, "Job")
    assert jobs, "no Job sets up the slot"
    images = {
        container["image"]
        for template in relay_templates(overlay_objects)
        for container in template["spec"]["containers"]
    }
    for job in jobs:
        (container,) = job["spec"]["template"]["spec"]["containers"]
        assert command_of(job["spec"]["template"]) in ADMIN_COMMANDS, container["args"]
    for _, template in pod_templates(overlay_objects):
        (container,) = template["spec"]["containers"]
        assert images == {container["image"]}
        assert re.search(r"@sha256:[0-9a-f]{64}$", container["image"]), "pin the image by digest"


def test_pods_are_locked_down(overlay_objects: Objects) -> None:
    for _, template in pod_templates(overlay_objects):
        spec = template["spec"]
        assert spec["automountServiceAccountToken"] is False
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True
        assert isinstance(pod["runAsUser"], int) and pod["runAsUser"] > 0
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}
        for container in containers(template):
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] is True
            assert context["allowPrivilegeEscalation"] is False
            assert context["capabilities"]["drop"] == ["ALL"]
            assert context["runAsNonRoot"] is True
            assert context.get("runAsUser", pod["runAsUser"]) == 10001, "the image's UID"
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(container["resources"][kind])
    account = named(overlay_objects, "ServiceAccount", "cdc-relay")
    assert account is not None
    assert account["automountServiceAccountToken"] is False


def test_the_metrics_service_and_pod_monitor_reach_the_stream_pods(
    overlay_objects: Objects,
) -> None:
    (service,) = of_kind(overlay_objects, "Service")
    (monitor,) = of_kind(overlay_objects, "PodMonitor")
    for template in relay_templates(overlay_objects):
        labels = template["metadata"]["labels"]
        ports = container_ports(template)
        assert selects(service["spec"]["selector"], labels)
        (port,) = service["spec"]["ports"]
        assert port["targetPort"] in ports and port["port"] == METRICS_PORT
        assert selects(monitor["spec"]["selector"], labels)
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            assert endpoint["port"] in ports
            assert endpoint.get("path", "/metrics") == "/metrics"
    assert service["spec"]["publishNotReadyAddresses"] is True
    # Nothing else is scraped by mistake: the Jobs' pods are not selected.
    for job in of_kind(overlay_objects, "Job"):
        labels = job["spec"]["template"]["metadata"]["labels"]
        assert not selects(monitor["spec"]["selector"], labels)


def test_the_disruption_budget_covers_the_stream_and_lets_drains_proceed(
    overlay_objects: Objects,
) -> None:
    (budget,) = of_kind(overlay_objects, "PodDisruptionBudget")
    for template in relay_templates(overlay_objects):
        assert selects(budget["spec"]["selector"], template["metadata"]["labels"])
    assert budget["spec"].get("maxUnavailable") == 1 and "minAvailable" not in budget["spec"]


def test_the_network_policy_lets_in_scrapes_and_out_dns_postgres_kafka(
    overlay_objects: Objects,
) -> None:
    (policy,) = of_kind(overlay_objects, "NetworkPolicy")
    spec = policy["spec"]
    assert set(spec["policyTypes"]) == {"Ingress", "Egress"}
    for _, template in pod_templates(overlay_objects):
        assert selects(spec["podSelector"], template["metadata"]["labels"])
    ports = {
        name: number
        for template in relay_templates(overlay_objects)
        for name, number in container_ports(template).items()
    }
    (ingress,) = spec["ingress"]
    assert [port["port"] for port in ingress["ports"]] in (["metrics"], [METRICS_PORT])
    assert all(port["port"] in ports or port["port"] in ports.values() for port in ingress["ports"])

    data = config_file(overlay_objects)
    dsn_port = re.search(r"\bport=(\d+)", data["dsn"])
    wanted = {DNS_PORT, int(dsn_port.group(1)) if dsn_port else POSTGRES_PORT}
    wanted |= {int(server.rsplit(":", 1)[1]) for server in data["kafka-bootstrap"].split(",")}
    allowed = {port["port"] for rule in spec["egress"] for port in rule["ports"]}
    assert allowed == wanted, "egress: exactly DNS, the database's port and the brokers' ports"
    for rule in spec["egress"]:
        assert rule["ports"], "an egress rule without ports lets everything out"


def test_every_object_lands_in_one_namespace(rendered_overlay: Objects) -> None:
    namespaces = {obj["metadata"].get("namespace") for obj in rendered_overlay}
    namespaces.discard(None)
    (namespace,) = namespaces
    assert named(rendered_overlay, "Namespace", namespace), "the overlay creates its namespace"
    for obj in rendered_overlay:
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == namespace, obj["metadata"]["name"]
