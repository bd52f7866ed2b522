"""Every `docs/<file>.md [section N]` that code, rules, profiles or build files cite exists in the repository."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CITING = ["src", "rules", "profiles", "benchmarks", "tests", ".ci", "Makefile", "Snakefile", "pyproject.toml",
          "matrix.yaml"]  # fmt: skip
CITE = re.compile(r"docs/([\w.-]+\.md)(?:,? section (\d+))?")


def citations():
    for name in CITING:
        top = ROOT / name
        files = [top] if top.is_file() else [p for p in top.rglob("*") if p.is_file()] if top.is_dir() else []
        for path in files:
            if "__pycache__" in path.parts or path.suffix in (".pyc", ".parquet", ".gz"):
                continue
            text = path.read_text(errors="ignore")
            for m in CITE.finditer(text):
                yield path.relative_to(ROOT).as_posix(), m[1], m[2]


def test_cited_docs_and_sections_exist():
    found = list(citations())
    assert len(found) >= 10  # the comments this test exists for
    missing = []
    for where, doc, section in found:
        path = ROOT / "docs" / doc
        if not path.is_file():
            missing.append(f"{where}: docs/{doc} does not exist")
        elif section and not re.search(rf"^## {section}\. ", path.read_text(), re.M):
            missing.append(f"{where}: docs/{doc} has no section {section}")
    assert not missing, "\n".join(missing)
