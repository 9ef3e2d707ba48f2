"""What the code, the tests and the documents cite exists: the documents (the repository carries
its own design in ARCHITECTURE.md, and the users' documentation in the pages of docs/), their
sections, the invariants by number, and the modules by path. A citation that leads nowhere is
how a document drifts from the code. README.md is a short introduction with no sections to
cite: what users are pointed to is a page, ``docs/PAGE.md, "Heading"``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(
    path
    for folder in ("cdc_relay", "tests", "bench", "demo", "deploy", ".ci", "docs")
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
    """The document's headings; a ``#`` line inside a fenced block (a shell comment) is none."""
    headings, fenced = [], False
    for line in (ROOT / document).read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif line.startswith("#") and not fenced:
            headings.append(line.lstrip("#").strip().replace("`", ""))
    return headings


# ARCHITECTURE.md, README.md or a page of the site, docs/PAGE.md, then the quoted sections.
CITATION = re.compile(
    r'\b(ARCHITECTURE\.md|README\.md|docs/[\w/-]+\.md),?\s*\(?((?:"[^"]+"(?:,\s*|\s+and\s+)?)+)'
)


def _cited_sections() -> list[tuple[str, str, str]]:
    """(citing file, document, section) for each ``DOC.md, "Section"`` or ``DOC.md ("A", "B")``,
    DOC.md being ARCHITECTURE.md, README.md or docs/PAGE.md."""
    found = []
    for name, text in TEXTS.items():
        for match in CITATION.finditer(text):
            sections = re.findall(r'"([A-Z`][^"]*)"', match.group(2))
            found.extend((name, match.group(1), section.replace("`", "")) for section in sections)
    return found


SECTIONS = _cited_sections()


def test_citations_are_found() -> None:
    assert len(SECTIONS) > 10
    assert ("tests/unit/test_simulation.py", "ARCHITECTURE.md", "The simulation") in SECTIONS
    cited = {(name, document, section) for name, document, section in SECTIONS}
    assert (
        "cdc_relay/postgres/failover.py",
        "docs/failover.md",
        "A slot PostgreSQL gave up on",
    ) in cited


@pytest.mark.parametrize(
    ("citing", "document", "section"),
    [(name, doc, section) for name, doc, section in SECTIONS if doc != "README.md"],
)
def test_a_cited_section_exists(citing: str, document: str, section: str) -> None:
    assert (ROOT / document).is_file(), f"{citing} cites {document}, which does not exist"
    headings = _headings(document)
    assert any(heading.startswith(section) for heading in headings), (
        f"{citing} cites {document}, {section!r}, which has no such section"
    )


# README, then a section: quoted (README.md, "A"; README 'A'; README ("A")) or named after a
# comma or a colon (README, Kubernetes; README: A slot ...). Another README (tests/golden/...)
# is another file; README.md as a path ("README.md") is no section.
README_SECTION = re.compile(
    r"""(?<![\w/.])README(?:\.md)?(?:(?:\s*[,:])?\s*\(?["'][A-Z`]|[,:] [A-Z])"""
)


def test_nothing_cites_a_section_of_the_readme() -> None:
    """The README keeps none of the sections users were pointed to: they are pages now."""
    citing = sorted(
        f"{name}: {text[match.start() : match.end() + 40]}"
        for name, text in TEXTS.items()
        for match in README_SECTION.finditer(text)
    )
    assert citing == [], 'cite docs/PAGE.md, "Heading" instead of the README:\n' + "\n".join(citing)


def test_the_readme_pattern_finds_each_form_of_a_readme_citation() -> None:
    forms = [
        'see README.md, "The configuration file"',
        '(README.md ("Order per aggregate on each path")',
        "and see README 'Hot standby and database failover'",
        '(README "Pruning a stream outbox")',
        "(README, Kubernetes, step 3)",
        "(README: A slot PostgreSQL gave up on)",
    ]
    assert all(README_SECTION.search(form) for form in forms)
    kept = [
        "(tests/golden/README.md)",
        'bench/README.md, "Results"',
        "the README says so",
        "the README's first lines",
        'ROOT / "README.md").read_text()',
    ]
    assert not any(README_SECTION.search(form) for form in kept)


def test_only_documents_the_repository_has_are_cited() -> None:
    cited = {
        (name, document)
        for name, text in TEXTS.items()
        for document in re.findall(r"\b((?:[\w.-]+/)*[A-Z][\w-]*\.md)\b", text)
    }
    cited |= {  # the site's pages, docs/PAGE.md
        (name, document)
        for name, text in TEXTS.items()
        for document in re.findall(r"(?<![\w/.-])(docs/[\w/-]+\.md)\b", text)
    }
    assert any(document == "docs/failover.md" for _, document in cited)
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


@pytest.mark.parametrize("documents", [["ARCHITECTURE.md"], ["README.md", "docs"]])
def test_a_module_the_documents_name_exists(documents: list[str]) -> None:
    """``relay/stream.py``, or ``stream.py`` alone where only one module has that name: in the
    design, and in what users read (the README and the site's pages)."""
    files = [path.relative_to(ROOT).as_posix() for path in ROOT.rglob("*.py")]
    paths = [
        path
        for document in documents
        for path in (
            [ROOT / document] if document.endswith(".md") else (ROOT / document).rglob("*.md")
        )
    ]
    text = "\n".join(path.read_text() for path in paths)
    named = set(re.findall(r"\b((?:\w+/)*\w+\.py)\b", text))
    assert named
    missing = sorted(
        name for name in named if not any(f == name or f.endswith("/" + name) for f in files)
    )
    assert missing == []
