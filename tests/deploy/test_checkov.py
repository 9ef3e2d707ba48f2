"""checkov finds nothing in deploy/ and the Dockerfiles; every suppression is deliberate.

Suppressions live beside what they excuse: `checkov.io/skipN: CHECK=reason` annotations on
Kubernetes objects, `# checkov:skip=CHECK: reason` lines in Dockerfiles. The list below makes
adding one a visible change.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest
from deploytools import DEPLOY, ROOT, tool

pytestmark = pytest.mark.deploy

DOCKERFILES = [ROOT / "Dockerfile", DEPLOY / "compose" / "postgres.Dockerfile"]
EXPECTED_SKIPS = {
    # PGPASSWORD from a Secret as an environment variable: libpq has no usable file form here.
    ("CKV_K8S_35", "deploy/base/deployment.yaml"),
    ("CKV_K8S_35", "deploy/base/setup-slot-job.yaml"),
    # The base image is an ARG with a pinned default; checkov does not resolve ARGs.
    ("CKV_DOCKER_7", "Dockerfile"),
    # The official postgres entrypoint needs root to start, then drops to postgres itself.
    ("CKV_DOCKER_3", "deploy/compose/postgres.Dockerfile"),
}


@pytest.fixture(scope="module")
def reports() -> list[dict[str, Any]]:
    checkov = tool("checkov")
    assert checkov, "checkov comes with the dev extra"
    files = [*sorted(DEPLOY.rglob("*.yaml")), *DOCKERFILES]
    command = [checkov, "--framework", "kubernetes", "dockerfile", "--skip-download"]
    command += ["--output", "json"]
    for path in files:
        command += ["--file", str(path.relative_to(ROOT))]
    # --skip-download: no policy metadata from checkov's vendor; the checks are all local.
    result = subprocess.run(
        command, capture_output=True, text=True, cwd=ROOT, timeout=240, check=False
    )
    assert result.stdout.strip(), result.stderr[-2000:]
    output = json.loads(result.stdout)
    found: list[dict[str, Any]] = output if isinstance(output, list) else [output]
    return found


def by_type(reports: list[dict[str, Any]], check_type: str) -> dict[str, Any]:
    (report,) = [r for r in reports if r["check_type"] == check_type]
    return report


def test_no_failed_checks(reports: list[dict[str, Any]]) -> None:
    failures = [
        f"{c['check_id']} {c['resource']} ({c['file_path']}:{c['file_line_range'][0]}): "
        f"{c['check_name']}"
        for report in reports
        for c in report["results"]["failed_checks"]
    ]
    assert not failures, "\n".join(failures)


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
