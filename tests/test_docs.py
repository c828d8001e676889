"""The README and docs/ stay a newcomer's path that is true of the tree (unit): the README short,
with the set-up commands first; every relative link and anchor resolving; docs/layout.md naming
every module; the README's handover section naming every runbook. (docs/reference.md's freshness
is tests/test_reference.py's.)"""

from __future__ import annotations

import re
from pathlib import Path

from infractl.handover.bundle import MARKER
from infractl.handover.reference import RUNBOOKS

from conftest import REPO

README = REPO / "README.md"
LAYOUT = REPO / "docs" / "layout.md"
#: The Markdown a reader follows links through: the README, docs/, and the pages they link to.
PAGES = sorted(
    [README, REPO / "SECURITY.md", REPO / "runbooks" / "README.md", REPO / "bundle" / "README.md"]
    + list((REPO / "docs").glob("*.md"))
    + list((REPO / "images").glob("*/README.md"))
    + list((REPO / "infra").glob("*/README.md"))
)
MAX_README_LINES = 400


def _section(text: str, heading: str) -> str:
    """The lines under ``heading`` up to the next heading of its level or above."""
    level = heading.split(" ")[0]
    start = text.index(f"\n{heading}\n")
    following = re.search(rf"\n#{{1,{len(level)}}} ", text[start + 1 :])
    return text[start : start + 1 + following.start() if following else None]


def test_readme_is_short_and_starts_with_the_two_set_up_commands() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines: move a section to docs/"
    first = "\n".join(lines[:40])
    assert "./scripts/quickstart.sh" in first and "./scripts/test.sh" in first
    for script in ("quickstart.sh", "test.sh"):
        assert (REPO / "scripts" / script).is_file()


def test_readme_links_the_reference_the_layout_and_every_docs_page() -> None:
    text = README.read_text()
    for page in sorted((REPO / "docs").glob("*.md")):
        assert f"](docs/{page.name}" in text, f"README.md links no docs/{page.name}"


def test_the_handover_section_names_every_file_kind_and_every_runbook() -> None:
    bundle = _section(README.read_text(), "## Reading the handover bundle")
    for name in ("index.html", "topology.md", "reference.md", "configs/", "baseline/", "runbooks/", "access/", MARKER):
        assert f"`{name}" in bundle, name
    for runbook in RUNBOOKS:
        assert f"`runbooks/{runbook}.md`" in bundle, runbook


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives ``page``'s headings: lower case, punctuation but ``-`` and ``_``
    dropped, spaces as ``-``, ``-1``, ``-2`` after a repeated one."""
    found: set[str] = set()
    in_code = False
    for line in page.read_text().splitlines():
        in_code ^= line.startswith("```")
        if in_code or not line.startswith("#"):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in found:
            n += 1
            anchor = f"{slug}-{n}"
        found.add(anchor)
    return found


def test_every_relative_link_and_anchor_resolves() -> None:
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
        for target in re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r'<img src="([^"]+)"', text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            where = (page.parent / path).resolve() if path else page
            if not where.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and where.suffix == ".md" and anchor not in _anchors(where):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert broken == []


_ENTRY = re.compile(r"^(?P<indent> *)- (?P<head>.*?)(?: — |$)")


def _layout_names() -> set[str]:
    """Every path docs/layout.md's tree names, relative to the repository."""
    tree = _section(LAYOUT.read_text(), "## The tree")
    names: set[str] = set()
    parents: list[tuple[int, str]] = []  # (indent, folder) of the entries above this one
    for line in tree.splitlines():
        entry = _ENTRY.match(line)
        if entry is None:
            continue
        indent = len(entry["indent"])
        while parents and parents[-1][0] >= indent:
            parents.pop()
        base = parents[-1][1] if parents else ""
        named = [base + name for name in re.findall(r"`([^`]+)`", entry["head"])]
        assert named, f"docs/layout.md: an entry that names no path: {line.strip()}"
        names.update(named)
        if len(named) == 1 and named[0].endswith("/"):
            parents.append((indent, named[0]))
    return names


def test_the_layout_names_every_module_and_nothing_that_is_gone() -> None:
    """docs/layout.md's tree ("## The tree") is a nested list; each entry starts with one or more
    paths in backticks, relative to the folder of the entry it is nested under, then " — " and what
    they are. The rule: every path it names exists (a folder ends in "/"), and every Python module
    under infractl/ and trainer/ is named, at any depth, but for ``__init__.py`` (a package is named
    by its folder, which every module in it is nested under). So a new module fails here until it is
    given one line in the tree, and a renamed or deleted one until its line follows it."""
    names = _layout_names()
    gone = sorted(n for n in names if not ((REPO / n).is_dir() if n.endswith("/") else (REPO / n).is_file()))
    modules = {
        str(path.relative_to(REPO))
        for folder in ("infractl", "trainer")
        for path in (REPO / folder).rglob("*.py")
        if path.name != "__init__.py"
    }
    packages = {
        f"{path.parent.relative_to(REPO)}/"
        for folder in ("infractl", "trainer")
        for path in (REPO / folder).rglob("__init__.py")
    }
    unnamed = sorted((modules | packages) - names)
    assert not gone and not unnamed, (
        f"docs/layout.md names what does not exist: {gone}; and names no line for: {unnamed}"
    )
