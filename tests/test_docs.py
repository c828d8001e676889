"""The README and docs/ stay a newcomer's path that is true of the tree (unit): the README short,
with the set-up commands first; every relative link and anchor resolving; docs/layout.md naming
every module; the README's handover section naming every runbook; SECURITY.md citing only code and
tests that exist, by name, never by line. (docs/reference.md's freshness is tests/test_reference.py's.)"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from infractl.handover.bundle import MARKER
from infractl.handover.reference import RUNBOOKS

from conftest import REPO

README = REPO / "README.md"
SECURITY = REPO / "SECURITY.md"
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


#: The folders of the repository a path SECURITY.md cites starts with (its other backquoted names
#: with a "/" are folders of a node, a store or the bundle).
_CODE_ROOTS = ("infractl/", "trainer/", "tests/", "infra/", "playbooks/", "scripts/", "images/", "docs/")
_SYMBOL = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")


def _defined_names(scope: ast.AST) -> set[str]:
    """Every function, class, assigned name and parameter in ``scope``, at any depth."""
    found: set[str] = set()
    for node in ast.walk(scope):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, ast.arg):
            found.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            found.add(node.id)
    return found


def _defines(path: Path, parts: list[str]) -> bool:
    """Whether ``path`` defines ``parts`` (``["Class", "method"]``, ``["function"]``; a last part
    ending in ``...`` is a prefix, as the findings table shortens a test's name). Outside Python:
    whether each part is a word of the file (``terraform_data.guard`` in a .tf file)."""
    text = path.read_text()
    if path.suffix != ".py":
        return all(re.search(rf"\b{re.escape(part)}\b", text) for part in parts)
    scope: ast.AST = ast.parse(text)
    for outer in parts[:-1]:
        cls = next((n for n in ast.walk(scope) if isinstance(n, ast.ClassDef) and n.name == outer), None)
        if cls is None:
            return False
        scope = cls
    last = parts[-1]
    names = _defined_names(scope)
    if last.endswith("..."):
        return any(name.startswith(last.removesuffix("...")) for name in names)
    return last in names


def test_security_cites_no_line_numbers() -> None:
    """A line number goes stale with the next edit above it: SECURITY.md names the file and the
    function, class or method instead (``path``, ``Class.method``)."""
    text = SECURITY.read_text()
    assert re.findall(r"`[^`]*\.\w+:\d+[^`]*`|`:\d+`", text) == []


def test_security_cites_only_files_tests_and_names_that_exist() -> None:
    """Each backquoted path of the repository in SECURITY.md (a bare ``test_*.py`` is under tests/,
    any other ``.py`` must be given from the repository's root) exists; each ``path::test`` (and a
    ``::test`` that continues the test file cited before it) names a test the file defines; and each
    name that follows a path with only commas between them (``infractl/launcher.py``, ``launch``,
    ``_PASSED``) is defined in that file. So a rename or a move fails here until the page follows it."""
    text = SECURITY.read_text()
    missing = []
    cited: Path | None = None  # the file the names that follow it are looked up in
    test_file: Path | None = None  # the file a ``::test`` continuation is in
    end = 0
    for span in re.finditer(r"`([^`]+)`", text):
        gap, end = text[end : span.start()], span.end()
        name, *tests = span[1].split("::")
        if not name:
            if test_file is None or not _defines(test_file, tests):
                missing.append(f"{test_file.relative_to(REPO) if test_file else '(no test file)'}{span[1]}")
            cited = None
        elif name.startswith(_CODE_ROOTS) or name.endswith(".py"):
            path = REPO / "tests" / name if name.startswith("test_") else REPO / name
            cited = path if path.is_file() else None
            if not path.exists():
                missing.append(span[1])
            elif tests:
                test_file = path
                if not _defines(path, tests):
                    missing.append(span[1])
        elif cited is not None and _SYMBOL.fullmatch(name) and re.fullmatch(r"[,\s]*", gap):
            if not _defines(cited, name.split(".")):
                missing.append(f"{cited.relative_to(REPO)}: {name}")
        else:
            cited = None
    assert missing == [], f"SECURITY.md cites what is not in the tree: {missing}"
