"""Fixtures of the deployment tests: the overlays' objects, as files and as rendered."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from deploytools import OVERLAY, OVERLAYS, kustomize_command, objects_of, render, resource_files


def _rendered(folder: Path) -> list[dict[str, Any]]:
    if kustomize_command() is None:
        pytest.skip("neither kustomize nor kubectl (its built-in kustomize) is installed")
    return render(folder)


@pytest.fixture(scope="session", params=OVERLAYS, ids=lambda folder: folder.name)
def rendered_overlay(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    """Each overlay as `kubectl apply -k` would send it."""
    return _rendered(request.param)


@pytest.fixture(
    scope="session",
    params=[None, *OVERLAYS],
    ids=lambda folder: "example-resource-files" if folder is None else folder.name,
)
def overlay_objects(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    """The example overlay's objects from its resource files as written (patches not applied),
    and every overlay's as kustomize renders them. References must hold in all."""
    if request.param is None:
        return objects_of(list(resource_files(OVERLAY)))
    return _rendered(request.param)
