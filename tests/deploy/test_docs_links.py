"""The documentation holds together: every page of docs/ is reached from docs/index.md, and every relative link in
docs/, benchmarks/README.md and README.md names a file that exists (a page moved or renamed breaks no reader)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
# [text](target) with the target up to a space, a closing parenthesis or a fragment; images alike
LINK = re.compile(r"\]\(([^)\s#]*)(?:#[^)\s]*)?(?:\s+\"[^\"]*\")?\)")


def relative_links(page: Path) -> list[str]:
    """The targets of the page's Markdown links that point into the repository (not URLs, not fragments alone)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
    return [target for target in LINK.findall(text) if target and "://" not in target
            and not target.startswith("mailto:")]


def broken_links(pages: list[Path]) -> list[tuple[str, str]]:
    """Each link, as (page's name, target), whose target is not a file or folder beside the page."""
    return [(page.name, target) for page in pages for target in relative_links(page)
            if not (page.parent / target).exists()]


def unlinked_pages(index: Path) -> set[str]:
    """The pages of the index's folder that the index does not link to."""
    linked = {(index.parent / target).resolve() for target in relative_links(index)}
    return {page.name for page in index.parent.glob("*.md") if page != index and page.resolve() not in linked}


def test_every_docs_page_is_linked_from_the_index() -> None:
    assert unlinked_pages(DOCS / "index.md") == set(), "link these pages from docs/index.md"


def test_every_relative_link_resolves() -> None:
    pages = sorted(DOCS.glob("*.md")) + [ROOT / "README.md", ROOT / "benchmarks" / "README.md"]
    assert broken_links(pages) == []


def test_the_checks_fail_on_a_missing_page_and_a_broken_link(tmp_path: Path) -> None:
    """Both checks can fail: an index that misses a page, and a link to a file that is not there."""
    (tmp_path / "index.md").write_text("See [the guide](guide.md) and [nothing](gone.md#part).\n")
    (tmp_path / "guide.md").write_text("# Guide\n\n```\n[not a link](inside-code.md)\n```\n")
    (tmp_path / "orphan.md").write_text("# Nobody links here\n")
    assert unlinked_pages(tmp_path / "index.md") == {"orphan.md"}
    assert broken_links([tmp_path / "index.md", tmp_path / "guide.md"]) == [("index.md", "gone.md")]
