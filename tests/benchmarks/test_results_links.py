"""Citations of benchmark figures lead somewhere: every link into `benchmarks/RESULTS.md` or its
history files, and every section the code and docs name there, is a heading that exists (a
section renamed or moved to history/ breaks this, not the reader's search)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"


def headings(path: Path) -> list[str]:
    return [line.lstrip("#").strip() for line in path.read_text().splitlines() if line.startswith("#")]


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def tracked_texts() -> dict[str, str]:
    names = subprocess.run(["git", "ls-files", "*.md", "*.py", "*.sh", "*.yaml"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.split()
    # a citation may wrap across comment lines: joined into one line, comment markers dropped
    return {name: re.sub(r"\s*\n\s*(?:#+\s)?", " ", (REPO / name).read_text(errors="replace")) for name in names
            if "/data/" not in name}


def test_every_citation_of_a_results_section_names_a_heading() -> None:
    results = headings(BENCHMARKS / "RESULTS.md")
    anchors = {anchor(h) for h in results}
    broken = []
    for name, text in tracked_texts().items():
        for link in re.findall(r"RESULTS\.md#([\w\-]+)", text):
            if link not in anchors:
                broken.append(f"{name}: RESULTS.md#{link}")
        if name == "benchmarks/RESULTS.md":
            broken += [f"{name}: #{link}" for link in re.findall(r"\]\(#([\w\-]+)\)", text) if link not in anchors]
        for quoted in re.findall(r"RESULTS\.md`?,? \(?[\"“]([^\"”]+)[\"”]", text):
            if quoted not in results:
                broken.append(f"{name}: RESULTS.md, {quoted!r}")
        for plain in re.findall(r"RESULTS\.md`, ([A-Z][\w\- ]+)\)", text):
            if plain not in results:
                broken.append(f"{name}: RESULTS.md, {plain!r}")
    assert broken == []


def test_every_citation_of_a_history_section_names_a_heading_of_that_day() -> None:
    broken = []
    for name, text in tracked_texts().items():
        for day, section in re.findall(r"\[(\d{4}-\d\d-\d\d)\]\([^)]*history/\1\.md\),? [\"“]([^\"”]+)[\"”]", text):
            path = BENCHMARKS / "history" / f"{day}.md"
            # a citation may shorten a heading to its start ("Async scheduling" for "Async
            # scheduling (issue 17), commit 8d3cde0")
            if not path.exists() or not any(h.startswith(section) for h in headings(path)):
                broken.append(f"{name}: {day}, {section!r}")
    assert broken == []
