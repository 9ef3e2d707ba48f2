"""Least privilege in deploy/: each workload connects as its own role of sql/roles.sql, from
its own Secret. The stream pods as the stream role (it reads the slot, changes no outbox row),
the pollers as the poller role (it marks rows); the Jobs as the outbox table's owner (a
publication needs it); the nightly prune as the pruner role (it deletes confirmed rows). None
sees another's Secret; only the relays get the Kafka client's (cdc-relay-kafka)."""

from __future__ import annotations

import re
from typing import Any

import pytest
from deploytools import (
    OVERLAY,
    config_file,
    named,
    objects_of,
    of_kind,
    pod_templates,
    relay_workloads,
    resource_files,
    secrets_of,
    stream_workloads,
)
from psycopg.conninfo import conninfo_to_dict

from cdc_relay import schema

pytestmark = pytest.mark.deploy

Objects = list[dict[str, Any]]
STREAM_DB = "cdc-relay-stream-db"
POLLER_DB = "cdc-relay-poller-db"
SETUP_DB = "cdc-relay-setup-db"
PRUNE_DB = "cdc-relay-prune-db"
KAFKA = "cdc-relay-kafka"


def role_of_roles_sql(variable: str) -> str:
    """The default name schema roles gives a role (`\\set stream_role cdc_relay_stream`)."""
    text = schema.text("roles")
    match = re.search(rf"^\s*\\set {variable} (\S+)$", text, re.M)
    assert match, f"schema roles sets no {variable}"
    return match[1]


def libpq_environment(template: dict[str, Any]) -> dict[str, Any]:
    """The PG* variables of the pod's container: the Secret and key of each, or its value."""
    (container,) = template["spec"]["containers"]
    found = {}
    for variable in container.get("env", []):
        if variable["name"].startswith("PG"):
            ref = variable.get("valueFrom", {}).get("secretKeyRef")
            found[variable["name"]] = (ref["name"], ref["key"]) if ref else variable
    return found


def from_secret(secret: str) -> dict[str, tuple[str, str]]:
    return {"PGUSER": (secret, "username"), "PGPASSWORD": (secret, "password")}


def test_the_relays_connect_as_their_roles_and_never_see_the_owners_secret(
    overlay_objects: Objects,
) -> None:
    relays = relay_workloads(overlay_objects)
    assert relays
    for workload, template in relays:
        name = workload["metadata"]["name"]
        streams = (workload, template) in stream_workloads(overlay_objects)
        secret = STREAM_DB if streams else POLLER_DB
        assert libpq_environment(template) == from_secret(secret), name
        assert secrets_of(template) - {KAFKA} == {secret}, name


def test_the_nightly_prune_connects_as_the_pruner_and_sees_no_other_secret(
    overlay_objects: Objects,
) -> None:
    """Every overlay prunes but the sharded ones (a shard's slot confirms its rows only)."""
    prunes = of_kind(overlay_objects, "CronJob")
    sharded = bool(of_kind(overlay_objects, "StatefulSet"))
    assert len(prunes) == (0 if sharded else 1)
    for workload, template in pod_templates(prunes):
        (container,) = template["spec"]["containers"]
        assert container["args"][0] == "prune"
        assert libpq_environment(template) == from_secret(PRUNE_DB)
        assert secrets_of(template) == {PRUNE_DB}
        assert workload["spec"]["concurrencyPolicy"] == "Forbid", "one prune at a time"


def test_the_jobs_connect_as_the_tables_owner_and_never_see_the_streams_secret(
    overlay_objects: Objects,
) -> None:
    jobs = of_kind(overlay_objects, "Job")
    assert jobs
    for job in jobs:
        template = job["spec"]["template"]
        name = job["metadata"]["name"]
        assert libpq_environment(template) == from_secret(SETUP_DB), name
        assert secrets_of(template) == {SETUP_DB}, name


def test_the_shared_settings_name_no_role(overlay_objects: Objects) -> None:
    """A user in the DSN of the file every pod reads would make the stream and the Jobs one
    role again (a DSN's user wins over PGUSER)."""
    settings = config_file(overlay_objects)
    for table in (settings, *(v for v in settings.values() if isinstance(v, dict))):
        if "dsn" in table:
            assert "user" not in conninfo_to_dict(table["dsn"])


def test_the_example_secrets_hold_three_roles_the_streams_and_pruners_from_roles_sql() -> None:
    objects = objects_of(list(resource_files(OVERLAY)))
    stream = named(objects, "Secret", STREAM_DB)
    owner = named(objects, "Secret", SETUP_DB)
    pruner = named(objects, "Secret", PRUNE_DB)
    assert stream is not None and owner is not None and pruner is not None
    for secret in (stream, owner, pruner):
        assert secret["type"] == "kubernetes.io/basic-auth"
        assert set(secret["stringData"]) == {"username", "password"}
    assert stream["stringData"]["username"] == role_of_roles_sql("stream_role")
    assert pruner["stringData"]["username"] == role_of_roles_sql("pruner_role")
    others = {role_of_roles_sql(f"{role}_role") for role in ("stream", "poller", "pruner")}
    assert owner["stringData"]["username"] not in others, "the owner is no relay role"
    passwords = {s["stringData"]["password"] for s in (stream, owner, pruner)}
    assert len(passwords) == 3
