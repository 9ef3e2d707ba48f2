"""What the deployment tests share: paths, the metrics contract, YAML loading, kustomize, PromQL."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import promql_parser
import yaml

from cdc_relay.commands.cli import cli

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
BASE = DEPLOY / "base"
OVERLAY = DEPLOY / "overlays" / "example"
STANDBY = DEPLOY / "overlays" / "standby"
SHARDED = DEPLOY / "overlays" / "sharded"
RESHARD = DEPLOY / "overlays" / "reshard"
POLL = DEPLOY / "overlays" / "poll"
# Production overlays: built on the base, with the site's placeholders and the user's Secrets.
PRODUCTION = (STANDBY, SHARDED, RESHARD, POLL)
OVERLAYS = (OVERLAY, *PRODUCTION)
COMPONENTS = (DEPLOY / "components" / "site", DEPLOY / "components" / "kafka-sasl")
KUSTOMIZATIONS = (BASE, *OVERLAYS, *COMPONENTS)
METRICS_PORT = 9464

# Every metric cdc-relay exports, by the name Prometheus stores, and its type. The alert
# rules and the dashboard may use these and nothing else.
METRICS = {
    "outbox_events_published_total": "counter",
    "outbox_events_failed_total": "counter",
    "outbox_events_pending": "gauge",
    "outbox_dead_letters": "gauge",
    "outbox_batch_duration_seconds": "histogram",
    "cdc_relay_slot_wal_retained_bytes": "gauge",
    "cdc_relay_slot_safe_wal_bytes": "gauge",
    "cdc_relay_slot_invalidated": "gauge",
    "cdc_relay_slot_failover_ready": "gauge",
    "cdc_relay_slot_failover_standby_ready": "gauge",
    "cdc_relay_slot_failover_lag_bytes": "gauge",
    "cdc_relay_confirmed_lsn": "gauge",
    "cdc_relay_end_to_end_latency_seconds": "histogram",
    "cdc_relay_events_in_flight": "gauge",
    "cdc_relay_seconds_since_last_event": "gauge",
    "cdc_relay_connected": "gauge",
    "cdc_relay_standby": "gauge",
}
HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")
# Their own labels; Prometheus adds the target's (namespace, pod, ...) when it scrapes.
METRIC_LABELS = {
    "outbox_events_published_total": {"relay"},
    "outbox_events_failed_total": {"relay", "event_type"},
    "cdc_relay_connected": {"service"},
    "cdc_relay_slot_failover_ready": {"slot"},
    "cdc_relay_slot_failover_standby_ready": {"slot", "standby"},
    "cdc_relay_slot_failover_lag_bytes": {"slot", "standby"},
}


def series_names() -> set[str]:
    """Names a query may select: the metrics, and each histogram's _bucket, _sum and _count."""
    names = set()
    for name, kind in METRICS.items():
        if kind == "histogram":
            names.update(name + suffix for suffix in HISTOGRAM_SERIES)
        else:
            names.add(name)
    return names


CONFIG_FILE = "cdc-relay.toml"
"""The key of the ConfigMap cdc-relay: the file every workload reads from CDC_RELAY_CONFIG."""


def config_file(objects: list[dict[str, Any]]) -> dict[str, Any]:
    """The settings of the ConfigMap cdc-relay, its cdc-relay.toml as tomllib reads it."""
    config = named(objects, "ConfigMap", "cdc-relay")
    assert config is not None, "no ConfigMap cdc-relay"
    assert set(config["data"]) == {CONFIG_FILE}, "the ConfigMap holds the file, nothing else"
    return tomllib.loads(config["data"][CONFIG_FILE])


def setting(objects: list[dict[str, Any]], key: str, command: str = "stream") -> Any:
    """What the ConfigMap's file sets ``key`` to for ``command``: its table's, else the top
    level's (config_file.py's rule), or None."""
    settings = config_file(objects)
    return settings.get(command, {}).get(key, settings.get(key))


def container_env(container: dict[str, Any]) -> dict[str, str]:
    """The container's plain variables (value, not valueFrom)."""
    return {v["name"]: v["value"] for v in container.get("env", []) if "value" in v}


def relay_settings(*commands: str) -> set[str]:
    """The environment variables the relay's commands read, as their --help lists them."""
    return {
        param.envvar
        for command in commands
        for param in cli.commands[command].params
        if isinstance(param.envvar, str)
    }


def tool(name: str) -> str | None:
    """An executable of the virtualenv (the dev extra installs it there), else one on PATH."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


# -- YAML ----------------------------------------------------------------------------------


def load_docs(path: Path) -> list[dict[str, Any]]:
    """The YAML documents of a file, empty ones left out."""
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def kustomization(folder: Path) -> dict[str, Any]:
    docs = load_docs(folder / "kustomization.yaml")
    assert len(docs) == 1, f"{folder}/kustomization.yaml: one document expected"
    return docs[0]


def resource_files(folder: Path) -> Iterator[Path]:
    """The files a kustomization takes as resources, following folders (other kustomizations)."""
    for entry in kustomization(folder).get("resources", []):
        target = (folder / entry).resolve()
        if target.is_dir():
            yield from resource_files(target)
        else:
            yield target


def objects_of(files: Iterator[Path] | list[Path]) -> list[dict[str, Any]]:
    return [doc for path in files for doc in load_docs(path)]


# -- kustomize -----------------------------------------------------------------------------


def kustomize_command() -> list[str] | None:
    """`kustomize build`, or kubectl's built-in kustomize, whichever is installed."""
    if standalone := shutil.which("kustomize"):
        return [standalone, "build"]
    if kubectl := shutil.which("kubectl"):
        return [kubectl, "kustomize"]
    return None


def render(folder: Path) -> list[dict[str, Any]]:
    """The objects of a kustomization as `kubectl apply -k` would send them (fresh copies)."""
    return [doc for doc in yaml.safe_load_all(rendered_text(folder)) if doc]


@functools.cache
def rendered_text(folder: Path) -> str:
    command = kustomize_command()
    assert command is not None
    result = subprocess.run(
        [*command, str(folder)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, f"kustomize {folder}: {result.stderr}"
    return result.stdout


# -- Kubernetes objects --------------------------------------------------------------------


def named(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any] | None:
    for obj in objects:
        if obj.get("kind") == kind and obj["metadata"]["name"] == name:
            return obj
    return None


def of_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [obj for obj in objects if obj.get("kind") == kind]


WORKLOADS = ("Deployment", "StatefulSet", "Job", "CronJob")


def pod_templates(objects: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, pod template) of every Deployment, StatefulSet, Job and CronJob."""
    return [
        (obj, obj["spec"]["jobTemplate"]["spec"]["template"])
        if obj["kind"] == "CronJob"
        else (obj, obj["spec"]["template"])
        for obj in objects
        if obj["kind"] in WORKLOADS
    ]


def command_of(template: dict[str, Any]) -> str:
    """The cdc-relay command the pod runs: the first argument of its one container."""
    (container,) = template["spec"]["containers"]
    return str(container["args"][0])


def stream_workloads(
    objects: list[dict[str, Any]],
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, pod template) of every workload that runs `cdc-relay stream`."""
    return [
        (workload, template)
        for workload, template in pod_templates(objects)
        if command_of(template) == "stream"
    ]


def relay_workloads(
    objects: list[dict[str, Any]],
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, pod template) of every workload that runs a relay: stream or poll."""
    return [
        (workload, template)
        for workload, template in pod_templates(objects)
        if command_of(template) in ("stream", "poll")
    ]


def option_value(args: list[str], option: str) -> str | None:
    """The value of ``--option VALUE`` or ``--option=VALUE`` in a container's args."""
    for previous, arg in zip(["", *args], args, strict=False):
        if previous == option:
            return arg
        if arg.startswith(option + "="):
            return arg.split("=", 1)[1]
    return None


def expanded_env(container: dict[str, Any], given: dict[str, str]) -> dict[str, str]:
    """The container's plain environment as the kubelet makes it: each `$(NAME)` replaced by
    the value of a variable defined before it (``given`` holds those of the downward API),
    `$$` by `$`, and an unknown reference left as it is."""
    values: dict[str, str] = {}

    def expand(text: str) -> str:
        def one(match: re.Match[str]) -> str:
            if match[0] == "$$":
                return "$"
            return values.get(match[1], match[0])

        return re.sub(r"\$\$|\$\((\w+)\)", one, text)

    for variable in container.get("env", []):
        name = variable["name"]
        if "value" in variable:
            values[name] = expand(variable["value"])
        elif name in given:
            values[name] = given[name]
    return values


def secrets_of(template: dict[str, Any]) -> set[str]:
    """Every Secret a pod template names, wherever: env, envFrom, volumes, projections."""
    names: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("secretKeyRef", "secretRef") and isinstance(value, dict):
                    names.add(value["name"])
                elif key == "secret" and isinstance(value, dict):
                    names.add(value.get("secretName") or value["name"])
                visit(value)
        elif isinstance(node, list):
            for item in node:
                visit(item)

    visit(template)
    return names


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a label selector (matchLabels and matchExpressions, or a plain map) matches."""
    if "matchLabels" not in selector and "matchExpressions" not in selector:
        selector = {"matchLabels": selector}
    for key, value in selector.get("matchLabels", {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values")
        present = key in labels
        if operator == "In" and not (present and labels[key] in values):
            return False
        if operator == "NotIn" and present and labels[key] in values:
            return False
        if operator == "Exists" and not present:
            return False
        if operator == "DoesNotExist" and present:
            return False
    return True


def container_ports(template: dict[str, Any]) -> dict[str, int]:
    return {
        port["name"]: port["containerPort"]
        for container in template["spec"]["containers"]
        for port in container.get("ports", [])
        if "name" in port
    }


# -- PromQL --------------------------------------------------------------------------------

GRAFANA_VARIABLES = {
    "$__rate_interval": "5m",
    "$__interval": "1m",
    "$__range": "1h",
}


def selected_names(expr: str) -> set[str]:
    """The metric names an expression selects; raises ValueError when it does not parse."""
    names: set[str] = set()

    def visit(node: Any) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            name = node.name
            if name is None:
                matcher = next(m for m in node.matchers.matchers if m.name == "__name__")
                name = matcher.value
            names.add(name)
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def without_grafana_variables(expr: str) -> str:
    """A Grafana query as plain PromQL: its interval variables replaced by durations."""
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    leftover = re.findall(r"\$\{?\w+\}?", re.sub(r'"[^"]*"', '""', expr))
    assert not leftover, f"{expr}: variables outside label matchers: {leftover}"
    return expr
