"""The documentation stands alone: every relative link resolves, nothing points outside the repo.

Checked over ``README.md`` and every ``docs/**/*.md``:

* every relative markdown link (``[text](path)``, ``![alt](path)``, ``path#anchor``, ``#anchor``)
  names a file that exists in the repository and, for a ``.md`` target with an anchor, a heading
  of that file (GitHub's anchor rule: lower case, punctuation dropped, spaces to hyphens);
* no text refers to files that are not in the repository (the design and algorithm notes live
  in ``docs/design.md`` and ``docs/algorithms.md``) or to tracker issues by number, which a
  reader of the repository cannot look up.

Links inside code spans and fenced code blocks are not links and are skipped.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

#: Mentions of material outside the repository.
OUTSIDE = re.compile(r"reference/algorithms\.md|DESIGN\.md|\.\./shared")
#: "issue 4", "issue #7", "issues 4, 7", "Issue 9's".
ISSUE_NUMBER = re.compile(r"\bissues? #?\d", re.IGNORECASE)

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.MULTILINE)


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _prose(text: str) -> str:
    """The text without fenced code blocks and code spans."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file (repeated headings get ``-1``, ``-2`` …)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for heading in _HEADING.findall(_FENCE.sub("", path.read_text())):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """The relative links of ``path`` whose file (inside ``root``) or anchor does not exist."""
    broken: list[str] = []
    for target in _LINK.findall(_prose(path.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path.resolve()
        if not dest.exists() or root.resolve() not in (dest, *dest.parents):
            broken.append(f"{target}: no such file in the repository")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    return broken


def test_the_checks_catch_what_they_should(tmp_path: Path) -> None:
    """A missing file, a missing anchor and an outside mention are reported; good links are not."""
    doc = ROOT / "docs" / "design.md"
    assert "3-request-path-data-plane-in-order" in anchors(doc)
    assert _slug("1.2 Latency profile → convex piecewise-linear cost") == (
        "12-latency-profile--convex-piecewise-linear-cost"
    )
    assert _slug("`marginal-cost`") == "marginal-cost"
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "there.md").write_text("# Top\n## Top\n")
    (tmp_path / "outside.md").write_text("")
    sample = repo / "x.md"
    sample.write_text(
        "[a](nowhere.md) [b](#nope) [c](https://example.org) `[d](skipped.md)` [e](#x)\n"
        "[f](there.md#top-1) [g](there.md#top-2) [h](../outside.md)\n# X\n"
    )
    assert broken_links(sample, root=repo) == [
        "nowhere.md: no such file in the repository",
        "#nope: no heading #nope in x.md",
        "there.md#top-2: no heading #top-2 in there.md",
        "../outside.md: no such file in the repository",
    ]
    assert OUTSIDE.search("see DESIGN.md §3") and OUTSIDE.search("../shared/traces")
    assert ISSUE_NUMBER.search("Issue 9's figures") and ISSUE_NUMBER.search("(issue #7)")
    assert not ISSUE_NUMBER.search("a known issue with the tree")


@pytest.mark.parametrize("path", DOCS, ids=_name)
def test_relative_links_resolve(path: Path) -> None:
    """Every relative link names an existing file (and heading) of the repository."""
    assert broken_links(path) == []


@pytest.mark.parametrize("path", DOCS, ids=_name)
def test_no_reference_outside_the_repository(path: Path) -> None:
    """No mention of notes that are not in the repository, nor of tracker issues by number."""
    text = path.read_text()
    lines = [
        f"{i}: {line.strip()}"
        for i, line in enumerate(text.splitlines(), 1)
        if OUTSIDE.search(line) or ISSUE_NUMBER.search(line)
    ]
    assert lines == []
