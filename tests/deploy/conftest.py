"""Fixtures of the deployment tests: the example overlay's objects, as files and as rendered."""

from __future__ import annotations

from typing import Any

import pytest
from deploytools import OVERLAY, kustomize_command, objects_of, render, resource_files


@pytest.fixture(scope="session")
def rendered_overlay() -> list[dict[str, Any]]:
    """The example overlay as `kubectl apply -k` would send it."""
    if kustomize_command() is None:
        pytest.skip("neither kustomize nor kubectl (its built-in kustomize) is installed")
    return render(OVERLAY)


@pytest.fixture(scope="session", params=["resource-files", "rendered"])
def overlay_objects(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    """The overlay's objects: from its resource files as written (patches not applied), and as
    kustomize renders them. References must hold in both."""
    if request.param == "rendered":
        objects: list[dict[str, Any]] = request.getfixturevalue("rendered_overlay")
        return objects
    return objects_of(list(resource_files(OVERLAY)))
