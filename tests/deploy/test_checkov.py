"""checkov finds nothing in deploy/, in the overlays as kustomize renders them (what the
patches make, a StatefulSet from the Deployment, is in no file) and in the Dockerfiles; every
suppression is deliberate.

Suppressions live beside what they excuse: `checkov.io/skipN: CHECK=reason` annotations on
Kubernetes objects, `# checkov:skip=CHECK: reason` lines in Dockerfiles. The list below makes
adding one a visible change.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from deploytools import DEPLOY, OVERLAYS, ROOT, kustomize_command, rendered_text, tool

pytestmark = pytest.mark.deploy

DOCKERFILES = [ROOT / "Dockerfile", DEPLOY / "compose" / "postgres.Dockerfile"]
EXPECTED_SKIPS = {
    # PGPASSWORD from a Secret as an environment variable: libpq has no usable file form here.
    ("CKV_K8S_35", "deploy/base/deployment.yaml"),
    ("CKV_K8S_35", "deploy/base/setup-slot-job.yaml"),
    ("CKV_K8S_35", "deploy/base/prune-cronjob.yaml"),
    # The base image is an ARG with a pinned default; checkov does not resolve ARGs.
    ("CKV_DOCKER_7", "Dockerfile"),
    # The official postgres entrypoint needs root to start, then drops to postgres itself.
    ("CKV_DOCKER_3", "deploy/compose/postgres.Dockerfile"),
}
# The same PGPASSWORD suppression, carried by the workloads into every rendered overlay.
WORKLOADS_WITH_PGPASSWORD = {"Deployment", "StatefulSet", "Job", "CronJob"}


def checkov(files: list[Path]) -> list[dict[str, Any]]:
    """checkov's reports on these files, one per framework (kubernetes, dockerfile)."""
    program = tool("checkov")
    assert program, "checkov comes with the dev extra"
    command = [program, "--framework", "kubernetes", "dockerfile", "--skip-download"]
    command += ["--output", "json"]
    for path in files:
        command += ["--file", str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)]
    # --skip-download: no policy metadata from checkov's vendor; the checks are all local.
    result = subprocess.run(
        command, capture_output=True, text=True, cwd=ROOT, timeout=240, check=False
    )
    assert result.stdout.strip(), result.stderr[-2000:]
    output = json.loads(result.stdout)
    found: list[dict[str, Any]] = output if isinstance(output, list) else [output]
    return found


@pytest.fixture(scope="module")
def reports() -> list[dict[str, Any]]:
    return checkov([*sorted(DEPLOY.rglob("*.yaml")), *DOCKERFILES])


@pytest.fixture(scope="module")
def rendered_reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    if kustomize_command() is None:
        pytest.skip("neither kustomize nor kubectl (its built-in kustomize) is installed")
    folder = tmp_path_factory.mktemp("rendered")
    files = []
    for overlay in OVERLAYS:
        path = folder / f"{overlay.name}.yaml"
        path.write_text(rendered_text(overlay))
        files.append(path)
    return checkov(files)


def by_type(reports: list[dict[str, Any]], check_type: str) -> dict[str, Any]:
    (report,) = [r for r in reports if r["check_type"] == check_type]
    return report


def failures(reports: list[dict[str, Any]]) -> list[str]:
    return [
        f"{c['check_id']} {c['resource']} ({c['file_path']}:{c['file_line_range'][0]}): "
        f"{c['check_name']}"
        for report in reports
        for c in report["results"]["failed_checks"]
    ]


def test_no_failed_checks(reports: list[dict[str, Any]]) -> None:
    assert not failures(reports), "\n".join(failures(reports))


def test_no_failed_checks_in_the_rendered_overlays(rendered_reports: list[dict[str, Any]]) -> None:
    assert not failures(rendered_reports), "\n".join(failures(rendered_reports))
    kubernetes = by_type(rendered_reports, "kubernetes")["summary"]
    assert kubernetes["resource_count"] >= 10 * len(OVERLAYS)
    assert kubernetes["parsing_errors"] == 0
    for report in rendered_reports:
        for check in report["results"]["skipped_checks"]:
            kind = check["resource"].split(".")[0]
            assert check["check_id"] == "CKV_K8S_35", check["resource"]
            assert kind in WORKLOADS_WITH_PGPASSWORD, check["resource"]


def test_everything_was_scanned(reports: list[dict[str, Any]]) -> None:
    assert by_type(reports, "dockerfile")["summary"]["resource_count"] == len(DOCKERFILES)
    kubernetes = by_type(reports, "kubernetes")["summary"]
    assert kubernetes["resource_count"] >= 10 and kubernetes["parsing_errors"] == 0


def test_every_suppression_is_expected_and_has_a_reason(reports: list[dict[str, Any]]) -> None:
    skipped = [c for report in reports for c in report["results"]["skipped_checks"]]
    for check in skipped:
        reason = check.get("check_result", {}).get("suppress_comment", "")
        assert len(reason.split()) >= 5, f"{check['check_id']} in {check['file_path']}: no reason"
    found = {(c["check_id"], c["file_path"].lstrip("/")) for c in skipped}
    assert found == EXPECTED_SKIPS
