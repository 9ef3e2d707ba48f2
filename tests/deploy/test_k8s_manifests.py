"""Every Kubernetes manifest in deploy/ is valid: the built-in kinds against the Kubernetes
schemas (kubernetes-validate, strict), the Prometheus Operator's against their CRDs' structure.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from crd_schemas import SCHEMAS
from deploytools import DEPLOY, KUSTOMIZATIONS, OVERLAY, load_docs, objects_of, resource_files

pytestmark = pytest.mark.deploy

# The oldest Kubernetes the manifests are for (PodDisruptionBudget's unhealthyPodEvictionPolicy
# is GA since 1.31) and the newest whose schemas kubernetes-validate ships.
KUBERNETES_VERSIONS = ("1.31.0", "1.37.0")


def validate(obj: dict[str, Any], version: str) -> None:
    kind = obj["kind"]
    if kind in SCHEMAS:
        jsonschema.Draft202012Validator(SCHEMAS[kind]).validate(obj)
        return
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = ".".join(str(part) for part in exc.path)
        pytest.fail(f"{kind}/{obj['metadata']['name']} at {path}: {exc.message}")


def all_resource_files() -> list[Path]:
    files = {path for folder in KUSTOMIZATIONS for path in resource_files(folder)}
    return sorted(files)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("path", all_resource_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_resource_file_is_valid(path: Path, version: str) -> None:
    docs = load_docs(path)
    assert docs, f"{path} is empty"
    for obj in docs:
        validate(obj, version)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_rendered_overlay_is_valid(rendered_overlay: list[dict[str, Any]], version: str) -> None:
    for obj in rendered_overlay:
        validate(obj, version)


def test_the_crd_schemas_refuse_what_the_api_server_would_drop() -> None:
    """The structural schemas are strict: a misplaced key is an error, not a silent no-op."""
    podmonitor = next(
        obj for obj in objects_of(list(resource_files(OVERLAY))) if obj["kind"] == "PodMonitor"
    )
    broken = yaml.safe_load(yaml.safe_dump(podmonitor))
    broken["spec"]["podMetricsEndpoints"][0]["intervall"] = "30s"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(SCHEMAS["PodMonitor"]).validate(broken)


def test_every_yaml_file_parses() -> None:
    for path in sorted(DEPLOY.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            assert doc is None or isinstance(doc, dict), path
