"""deploy/overlays/sharded: a StatefulSet whose pod K streams shard K/N, and a setup Job that
makes the N shards. deploy/overlays/reshard: the step from N shards to M, a Job that runs
`reshard --from N --to M` and a second StatefulSet of M pods beside the running one."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from deploytools import (
    RESHARD,
    SHARDED,
    STANDBY,
    expanded_env,
    kustomize_command,
    named,
    of_kind,
    option_value,
    render,
)

from cdc_relay.commands.cli import cli
from cdc_relay.postgres.shards import Shard, every_shard

pytestmark = [
    pytest.mark.deploy,
    pytest.mark.skipif(kustomize_command() is None, reason="neither kustomize nor kubectl here"),
]

Objects = list[dict[str, Any]]
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
SHARD_SETTINGS = ("POD_INDEX", "CDC_RELAY_SHARD")


@pytest.fixture(scope="module")
def sharded() -> Objects:
    return render(SHARDED)


@pytest.fixture(scope="module")
def resharding() -> Objects:
    return render(RESHARD)


def the_statefulset(objects: Objects) -> dict[str, Any]:
    (statefulset,) = of_kind(objects, "StatefulSet")
    return statefulset


def the_job(objects: Objects) -> dict[str, Any]:
    (job,) = of_kind(objects, "Job")
    return job


def the_container(template: dict[str, Any]) -> dict[str, Any]:
    (container,) = template["spec"]["containers"]
    return container


def the_args(workload: dict[str, Any]) -> list[str]:
    args: list[str] = the_container(workload["spec"]["template"])["args"]
    return args


def options(command: str) -> set[str]:
    return {opt for param in cli.commands[command].params for opt in param.opts}


def shards_of_pods(statefulset: dict[str, Any]) -> list[Shard]:
    """The shard each pod streams, by ordinal, as the kubelet expands its environment."""
    container = the_container(statefulset["spec"]["template"])
    env = {variable["name"]: variable for variable in container["env"]}
    field = env["POD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert field == f"metadata.labels['{POD_INDEX_LABEL}']"
    order = [variable["name"] for variable in container["env"]]
    assert order.index("POD_INDEX") < order.index("CDC_RELAY_SHARD"), "expanded in order"
    return [
        Shard.parse(expanded_env(container, {"POD_INDEX": str(k)})["CDC_RELAY_SHARD"])
        for k in range(statefulset["spec"]["replicas"])
    ]


def without_name_count_and_shard(statefulset: dict[str, Any]) -> dict[str, Any]:
    """The StatefulSet apart from what differs from one N to another."""
    rest = copy.deepcopy(statefulset)
    del rest["metadata"]["name"], rest["spec"]["replicas"]
    container = the_container(rest["spec"]["template"])
    container["env"] = [v for v in container["env"] if v["name"] != "CDC_RELAY_SHARD"]
    return rest


# -- deploy/overlays/sharded -----------------------------------------------------------------


def test_a_statefulset_takes_the_place_of_the_deployment(sharded: Objects) -> None:
    assert not of_kind(sharded, "Deployment")
    statefulset = the_statefulset(sharded)
    spec = statefulset["spec"]
    assert statefulset["metadata"]["name"] == f"cdc-relay-{spec['replicas']}", "named after N"
    assert spec["podManagementPolicy"] == "Parallel"
    assert "strategy" not in spec


def test_pod_k_streams_shard_k_of_n(sharded: Objects) -> None:
    statefulset = the_statefulset(sharded)
    assert shards_of_pods(statefulset) == every_shard(statefulset["spec"]["replicas"])
    # the variable stream reads for --shard
    option = next(p for p in cli.commands["stream"].params if p.name == "shard")
    assert option.envvar == "CDC_RELAY_SHARD"


def test_the_setup_job_makes_as_many_shards_as_there_are_pods(sharded: Objects) -> None:
    job = the_job(sharded)
    assert job["metadata"]["name"] == "cdc-relay-setup-slot"
    args = the_args(job)
    assert args[0] == "setup-slot"
    assert option_value(args, "--shards") == str(the_statefulset(sharded)["spec"]["replicas"])
    assert "--shards" in options("setup-slot")


def test_the_shards_run_the_production_deployments_pod(sharded: Objects) -> None:
    """Probes, port, security context, Secrets, image, anti-affinity: all the standby
    overlay's pod (the base's with the site's and the Kafka client's), only the shard added
    and no --standby."""
    deployment = named(render(STANDBY), "Deployment", "cdc-relay")
    assert deployment is not None
    expected = copy.deepcopy(deployment["spec"]["template"])
    container = the_container(expected)
    container["env"] = [v for v in container["env"] if v["name"] != "CDC_RELAY_STANDBY"]
    statefulset = the_statefulset(sharded)
    template = copy.deepcopy(statefulset["spec"]["template"])
    container = the_container(template)
    container["env"] = [v for v in container["env"] if v["name"] not in SHARD_SETTINGS]
    assert template == expected
    assert statefulset["spec"]["selector"] == deployment["spec"]["selector"]
    assert statefulset["metadata"]["labels"] == deployment["metadata"]["labels"]


# -- deploy/overlays/reshard -----------------------------------------------------------------


def test_reshard_runs_from_the_running_count_to_the_new_one(
    sharded: Objects, resharding: Objects
) -> None:
    old, new = the_statefulset(sharded), the_statefulset(resharding)
    before, after = old["spec"]["replicas"], new["spec"]["replicas"]
    assert before != after
    job = the_job(resharding)
    args = the_args(job)
    assert args[0] == "reshard"
    assert option_value(args, "--from") == str(before)
    assert option_value(args, "--to") == str(after)
    assert {"--from", "--to"} <= options("reshard")
    assert job["metadata"]["name"] != the_job(sharded)["metadata"]["name"], "a Job of its own"
    # The reshard runs in the setup Job's pod: the table's owner, its Secret.
    setup = the_job(sharded)
    pod = copy.deepcopy(job["spec"]["template"])
    the_container(pod)["args"] = the_args(setup)
    assert pod == setup["spec"]["template"]


def test_the_second_statefulset_streams_the_new_shards_beside_the_old(
    sharded: Objects, resharding: Objects
) -> None:
    old, new = the_statefulset(sharded), the_statefulset(resharding)
    after = new["spec"]["replicas"]
    assert shards_of_pods(new) == every_shard(after)
    assert new["metadata"]["name"] == f"cdc-relay-{after}"
    # The running StatefulSet is not in the build: applying it leaves the old shards alone.
    assert old["metadata"]["name"] != new["metadata"]["name"]
    assert not named(resharding, "StatefulSet", old["metadata"]["name"])
    # Only N differs, so the sharded overlay set to the new N is this same StatefulSet.
    assert without_name_count_and_shard(new) == without_name_count_and_shard(old)


def test_resharding_changes_nothing_else(sharded: Objects, resharding: Objects) -> None:
    def others(objects: Objects) -> Objects:
        return [obj for obj in objects if obj["kind"] not in ("StatefulSet", "Job")]

    assert others(resharding) == others(sharded)
    assert "--yes" in options("drop-slot") and "--shards" in options("drop-slot")
