"""The package's layout (ARCHITECTURE.md, "The layout"): imports go one way, no module imports
itself back through others, no module is over 600 lines, each says what it owns.

Every import counts, those inside functions and under ``TYPE_CHECKING`` too: a cycle that only
the type checker sees is still two rooms that cannot be read apart.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "cdc_relay"
MAX_LINES = 600

# Lower layers never import higher ones; the top-level modules are the foundation.
LAYERS = {"postgres": 1, "kafka": 2, "relay": 3, "ops": 4, "commands": 5}


def _name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _layer(module: str) -> int:
    if module == "cdc_relay.__main__":  # python -m cdc_relay: the command, at the top layer
        return LAYERS["commands"]
    parts = module.split(".")
    return LAYERS.get(parts[1], 0) if len(parts) > 2 else 0


def _imports(module: str) -> Iterator[str]:
    """The package's modules that ``module`` imports, wherever in it."""
    tree = ast.parse(MODULES[module].read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name in MODULES and name != module and name != "cdc_relay":
                yield name


GRAPH = {module: sorted(set(_imports(module))) for module in MODULES}


def _cycles() -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in GRAPH[module]:
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in GRAPH:
        if module not in index:
            visit(module)
    return found


def test_the_graph_is_read_from_the_code() -> None:
    assert len(MODULES) > 40
    assert "cdc_relay.kafka.sink" in GRAPH["cdc_relay.relay.stream"]


def test_no_module_imports_itself_back() -> None:
    assert _cycles() == []


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_go_down_the_layers(module: str) -> None:
    upward = [other for other in GRAPH[module] if _layer(other) > _layer(module)]
    assert upward == [], f"{module} imports a higher layer"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_a_module_is_at_most_600_lines_and_says_what_it_owns(module: str) -> None:
    text = MODULES[module].read_text()
    assert len(text.splitlines()) <= MAX_LINES
    assert ast.get_docstring(ast.parse(text)), f"{module} has no docstring"


def test_the_public_import_paths_stay() -> None:
    """What applications import: writing events, and idempotent consumers."""
    for module in ("cdc_relay.outbox", "cdc_relay.consumer", "cdc_relay.sqlalchemy"):
        assert module in MODULES
