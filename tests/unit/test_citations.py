"""What the code, the tests and the documents cite exists: the documents (the repository carries
its own design in ARCHITECTURE.md), their sections, the invariants by number, and the modules
by path. A citation that leads nowhere is how a document drifts from the code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(
    path
    for folder in ("cdc_relay", "tests", "bench", "demo", "deploy", ".ci")
    for path in (ROOT / folder).rglob("*")
    if path.suffix in {".py", ".sql", ".md", ".yaml", ".yml", ".sh", ""}
    and path.is_file()
    and "results" not in path.relative_to(ROOT).parts  # bench runs of the past, as they were
    and "__pycache__" not in path.parts
    and path.name != "test_citations.py"
) + [ROOT / name for name in ("ARCHITECTURE.md", "README.md", "Makefile", "Dockerfile")]


def _text(path: Path) -> str:
    """The file with comment and docstring line breaks undone, so a citation wrapped over two
    lines reads as one."""
    text = path.read_text(errors="replace")
    text = re.sub(r"\n\s*(?:#|--)\s*", " ", text)
    return re.sub(r"\s*\n\s*", " ", text)


TEXTS = {path.relative_to(ROOT).as_posix(): _text(path) for path in SOURCES}


def _headings(document: str) -> list[str]:
    lines = (ROOT / document).read_text().splitlines()
    return [line.lstrip("#").strip().replace("`", "") for line in lines if line.startswith("#")]


def _cited_sections() -> list[tuple[str, str, str]]:
    """(citing file, document, section) for each ``DOC.md, "Section"`` or ``DOC.md ("A", "B")``."""
    found = []
    pattern = re.compile(r'(ARCHITECTURE|README)\.md,?\s*\(?((?:"[^"]+"(?:,\s*|\s+and\s+)?)+)')
    for name, text in TEXTS.items():
        for match in pattern.finditer(text):
            document = f"{match.group(1)}.md"
            sections = re.findall(r'"([A-Z`][^"]*)"', match.group(2))
            found.extend((name, document, section.replace("`", "")) for section in sections)
    return found


SECTIONS = _cited_sections()


def test_citations_are_found() -> None:
    assert len(SECTIONS) > 10
    assert ("tests/unit/test_simulation.py", "ARCHITECTURE.md", "The simulation") in SECTIONS


@pytest.mark.parametrize(("citing", "document", "section"), SECTIONS)
def test_a_cited_section_exists(citing: str, document: str, section: str) -> None:
    headings = _headings(document)
    assert any(heading.startswith(section) for heading in headings), (
        f"{citing} cites {document}, {section!r}, which has no such section"
    )


def test_only_documents_the_repository_has_are_cited() -> None:
    cited = {
        (name, document)
        for name, text in TEXTS.items()
        for document in re.findall(r"\b((?:[\w.-]+/)*[A-Z][\w-]*\.md)\b", text)
    }
    missing = sorted(
        (name, document)
        for name, document in cited
        if not (ROOT / document).exists()
        and not (ROOT / name).parent.joinpath(document).exists()
        and document not in {"CHANGELOG.md"}  # none yet; nothing cites it
    )
    assert missing == []


def test_a_cited_invariant_exists() -> None:
    text = (ROOT / "ARCHITECTURE.md").read_text()
    numbers = {int(n) for n in re.findall(r"^(\d+)\. \*\*", text, re.M)}
    cited = set()
    for body in TEXTS.values():
        for match in re.finditer(r"\binvariants? (\d+)((?:,? (?:and )?\d+)*)", body):
            cited |= {int(n) for n in re.findall(r"\d+", match.group(0))}
    assert cited, "no invariant cited: the pattern no longer matches"
    assert cited <= numbers


def test_a_cited_module_path_exists() -> None:
    cited = {
        (name, path)
        for name, text in TEXTS.items()
        for path in re.findall(r"\b(cdc_relay/[\w/]+\.(?:py|sql))\b", text)
    }
    assert cited
    assert sorted((name, path) for name, path in cited if not (ROOT / path).exists()) == []


@pytest.mark.parametrize("document", ["ARCHITECTURE.md", "README.md"])
def test_a_module_the_documents_name_exists(document: str) -> None:
    """``relay/stream.py``, or ``stream.py`` alone where only one module has that name."""
    files = [path.relative_to(ROOT).as_posix() for path in ROOT.rglob("*.py")]
    named = set(re.findall(r"\b((?:\w+/)*\w+\.py)\b", (ROOT / document).read_text()))
    assert named
    missing = sorted(
        name for name in named if not any(f == name or f.endswith("/" + name) for f in files)
    )
    assert missing == []
