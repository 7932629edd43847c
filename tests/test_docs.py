"""The README is the front door: its first lines keep the two commands a newcomer runs (the
quickstart and CI's test command, read from .ci/run), it links every docs/ page, and every relative
link in README.md, docs/*.md and deploy/*.md points at a file that exists, without an #anchor
(anchors break silently when a heading is reworded)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest


def _root() -> Path:
    """The repository root: the nearest folder above this file with pyproject.toml (the tests may
    live in subfolders)."""
    for d in Path(__file__).resolve().parents:
        if (d / "pyproject.toml").is_file():
            return d
    raise RuntimeError("no pyproject.toml above tests/")


ROOT = _root()
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
OTHER = sorted((ROOT / "deploy").glob("*.md"))     # link into docs/ too
FIRST_LINES = 10          # the two commands must be seen before any prose
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _links(md: Path) -> list[str]:
    """Targets of the inline links of a markdown file, outside code blocks and code spans."""
    text = _CODE.sub("", _FENCE.sub("", md.read_text(encoding="utf-8")))
    return _LINK.findall(text)


def _ci_test_command() -> str:
    """The pytest command .ci/run runs (the README's test command), as written there."""
    lines = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    runs = [ln for ln in lines if "-m pytest" in ln and not ln.startswith("#")]
    assert len(runs) == 1, f".ci/run should run pytest once, found {runs}"
    return runs[0]


def _first_block() -> list[str]:
    """The lines of the README's first fenced code block, which must open in its first lines."""
    lines = README.read_text(encoding="utf-8").splitlines()
    start = next((i for i, ln in enumerate(lines[:FIRST_LINES]) if ln.startswith("```")), None)
    assert start is not None, f"README.md: no code block in its first {FIRST_LINES} lines"
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("```"))
    return lines[start + 1:end]


def test_readme_first_lines_have_the_quickstart_and_ci_test_command():
    block = _first_block()
    commands = [ln.split("#")[0].strip() for ln in block]
    assert "bash scripts/quickstart.sh" in commands, block
    assert _ci_test_command() in commands, block


def test_quickstart_and_ci_set_up_the_same_way():
    setup = "bash scripts/setup.sh"
    assert setup in (ROOT / "scripts" / "quickstart.sh").read_text().splitlines()
    assert setup in (ROOT / ".ci" / "run").read_text().splitlines()


def test_docs_pages_start_with_a_title_and_a_line_on_what_they_cover():
    assert PAGES, "docs/ has no pages"
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        assert lines[0].startswith("# "), f"{page.name}: first line should be its title"
        assert lines[1] == "" and lines[2].strip(), f"{page.name}: a line on what it covers after the title"


def test_readme_links_every_docs_page():
    linked = {(README.parent / t).resolve() for t in _links(README)}
    missing = [p.name for p in PAGES if p.resolve() not in linked]
    assert not missing, f"README.md does not link {missing}"


@pytest.mark.parametrize("md", [README, *PAGES, *OTHER], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve_without_anchors(md: Path):
    bad = []
    for target in _links(md):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):       # http:, https:, mailto: ...
            continue
        if "#" in target or target.startswith("/"):
            bad.append(f"{target} (anchor or absolute path)")
        elif not (md.parent / target).exists():
            bad.append(f"{target} (no such file)")
    assert not bad, f"{md.relative_to(ROOT)}: {bad}"
