"""deploy/overlays/sharded: a StatefulSet whose pod K streams shard K/N, and a setup Job that
makes the N shards."""

from __future__ import annotations

from typing import Any

import pytest
from deploytools import (
    OVERLAY,
    SHARDED,
    expanded_env,
    kustomize_command,
    named,
    of_kind,
    option_value,
    render,
)

from cdc_relay.cli import cli
from cdc_relay.shards import Shard, every_shard

pytestmark = [
    pytest.mark.deploy,
    pytest.mark.skipif(kustomize_command() is None, reason="neither kustomize nor kubectl here"),
]

Objects = list[dict[str, Any]]
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
SHARD_SETTINGS = ("POD_INDEX", "CDC_RELAY_SHARD")


@pytest.fixture(scope="module")
def objects() -> Objects:
    return render(SHARDED)


def shards_statefulset(objects: Objects) -> dict[str, Any]:
    (statefulset,) = of_kind(objects, "StatefulSet")
    return statefulset


def the_container(workload: dict[str, Any]) -> dict[str, Any]:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


def test_a_statefulset_takes_the_place_of_the_deployment(objects: Objects) -> None:
    assert not of_kind(objects, "Deployment")
    statefulset = shards_statefulset(objects)
    spec = statefulset["spec"]
    assert statefulset["metadata"]["name"] == f"cdc-relay-{spec['replicas']}", "named after N"
    assert spec["podManagementPolicy"] == "Parallel"
    assert "strategy" not in spec


def test_pod_k_streams_shard_k_of_n(objects: Objects) -> None:
    statefulset = shards_statefulset(objects)
    count = statefulset["spec"]["replicas"]
    container = the_container(statefulset)
    env = {variable["name"]: variable for variable in container["env"]}
    field = env["POD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert field == f"metadata.labels['{POD_INDEX_LABEL}']"
    order = [variable["name"] for variable in container["env"]]
    assert order.index("POD_INDEX") < order.index("CDC_RELAY_SHARD"), "expanded in order"
    shards = [
        Shard.parse(expanded_env(container, {"POD_INDEX": str(k)})["CDC_RELAY_SHARD"])
        for k in range(count)
    ]
    assert shards == every_shard(count)
    # the variable stream reads for --shard
    option = next(p for p in cli.commands["stream"].params if p.name == "shard")
    assert option.envvar == "CDC_RELAY_SHARD"


def test_the_setup_job_makes_as_many_shards_as_there_are_pods(objects: Objects) -> None:
    job = named(objects, "Job", "cdc-relay-setup-slot")
    assert job is not None
    args = the_container(job)["args"]
    assert args[0] == "setup-slot"
    assert option_value(args, "--shards") == str(shards_statefulset(objects)["spec"]["replicas"])
    assert "--shards" in {opt for p in cli.commands["setup-slot"].params for opt in p.opts}


def test_the_shards_run_the_example_deployments_pod(objects: Objects) -> None:
    """Probes, port, security context, Secret, image: all the base's, only the shard added."""
    deployment = named(render(OVERLAY), "Deployment", "cdc-relay")
    assert deployment is not None
    template = shards_statefulset(objects)["spec"]["template"]
    container = the_container({"spec": {"template": template}})
    container["env"] = [v for v in container["env"] if v["name"] not in SHARD_SETTINGS]
    assert template == deployment["spec"]["template"]
    statefulset = shards_statefulset(objects)
    assert statefulset["spec"]["selector"] == deployment["spec"]["selector"]
    assert statefulset["metadata"]["labels"] == deployment["metadata"]["labels"]
