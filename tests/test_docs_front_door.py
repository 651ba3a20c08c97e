"""The README is a short front door and the docs it opens onto hold together (issue 56).

The README stays at most 200 lines, shows the set-up commands exactly as CI runs them
(``.ci/run``'s last line), holds no paragraph in a table cell, and every relative link in it
and in ``docs/`` lands on a file that exists and, for ``#anchor`` links into Markdown, on a
heading that exists (GitHub's anchor rules). ``docs/index.md`` names every page of ``docs/``.
"""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = REPO / "docs"
MAX_README_LINES = 200
MAX_CELL_CHARS = 200

LINK = re.compile(r"!?\[[^\]]*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"#{1,6}\s+(.*?)\s*#*\s*$")


def markdown_pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (a fenced line becomes empty, keeping numbering)."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            out.append("")
        else:
            out.append("" if fenced else line)
    return out


def github_anchor(heading: str) -> str:
    """GitHub's heading id: links reduced to their text, lower case, everything but letters,
    digits, spaces, '-' and '_' dropped, spaces turned into '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The ids of a page's headings; a repeated heading gets -1, -2, ... as on GitHub."""
    counts: dict[str, int] = {}
    ids = set()
    for line in prose_lines(page.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if match:
            slug = github_anchor(match.group(1))
            count = counts.get(slug, 0)
            counts[slug] = count + 1
            ids.add(slug if count == 0 else f"{slug}-{count}")
    return ids


def relative_links(page: Path) -> list[tuple[int, str]]:
    """(line, target) of every link that is not a URL, outside code (fenced or inline)."""
    found = []
    for number, line in enumerate(prose_lines(page.read_text(encoding="utf-8")), 1):
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if not re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target):
                found.append((number, target))
    return found


def test_github_anchor_follows_githubs_rules():
    assert github_anchor("Preprocessing: raw text → memory-mapped Arrow shards") == (
        "preprocessing-raw-text--memory-mapped-arrow-shards"
    )
    assert github_anchor("Index choice (`retromae_ds/search/`)") == "index-choice-retromae_dssearch"
    assert github_anchor("The README's main job") == "the-readmes-main-job"
    assert github_anchor("Why no budget meets ≥ 0.10 and ≥ 5×") == "why-no-budget-meets--010-and--5"


def test_readme_is_at_most_200_lines():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md: {len(lines)} lines, at most 200"


def test_readme_shows_the_set_up_commands_ci_runs():
    """The README's test command is .ci/run's last line (less pip's -q, CI's quiet output),
    and the demo command installs the same torch pin."""
    ci_lines = (REPO / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()
    ci_command = " ".join(token for token in ci_lines[-1].split() if token != "-q")
    readme_lines = [line.strip() for line in README.read_text(encoding="utf-8").splitlines()]
    assert ci_command in readme_lines, f"README.md: no line {ci_command!r} (.ci/run's command)"
    torch_pin = next(token for token in ci_command.split() if token.startswith("torch=="))
    demo = f"pip install {torch_pin} -e . && retromae-ds demo"
    assert demo in readme_lines, f"README.md: no line {demo!r}"


def test_no_readme_table_cell_holds_a_paragraph():
    for number, line in enumerate(README.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith("|"):
            for cell in line.strip().strip("|").split("|"):
                assert len(cell.strip()) <= MAX_CELL_CHARS, (
                    f"README.md:{number}: a table cell of {len(cell.strip())} characters"
                )


def test_every_relative_link_lands_on_a_file_and_heading():
    broken = []
    for page in markdown_pages():
        for number, target in relative_links(page):
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            where = f"{page.relative_to(REPO)}:{number}: {target}"
            if not dest.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{where} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_link_check_sees_links():
    """The check above is not vacuous: the README links into docs/ and to a heading."""
    targets = [target for _, target in relative_links(README)]
    assert "docs/index.md" in targets
    assert any("#" in target for target in targets)


def test_docs_index_names_every_page():
    listed = {target.partition("#")[0] for _, target in relative_links(DOCS / "index.md")}
    pages = {page.name for page in DOCS.glob("*.md")} - {"index.md"}
    assert not pages - listed, f"docs/index.md: pages not listed: {sorted(pages - listed)}"


def test_every_test_the_guarantees_name_exists():
    """Each ``test_file.py::test_name`` (or ``::test_name`` after one) in docs/guarantees.md
    names a test function that exists: a promise never points at a renamed or deleted test."""
    missing = []
    for line in (DOCS / "guarantees.md").read_text(encoding="utf-8").splitlines():
        last = None
        for m in re.finditer(r"`(?:tests/)?(test_\w+\.py)?::(test_\w+)", line):
            last = m.group(1) or last
            path = REPO / "tests" / str(last)
            if last is None or f"def {m.group(2)}(" not in path.read_text(encoding="utf-8"):
                missing.append(f"{last}::{m.group(2)}")
    assert not missing, missing
