"""The docs hold together (issue 32, item 4): every relative link in ``README.md`` and
``docs/*.md`` reaches a file that exists, and a heading there when it names one (``#anchor``, in
GitHub's spelling), and every page of ``docs/`` is linked from the README, so a newcomer who
starts there can reach all of them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: ``[text](target)`` and ``![alt](target)``, outside code; ``target`` up to a space or ``)``.
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)


def _prose(text: str) -> str:
    """``text`` without fenced blocks and code spans (a link written in code is no link)."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, markup and punctuation dropped (hyphens
    and underscores kept), spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"[`*]", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor of ``page``: its headings' slugs, numbered as GitHub numbers repeats, and any
    explicit ``<a id=...>`` / ``<a name=...>``."""
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    found: set[str] = set()
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, flags=re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        found.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    found.update(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", text))
    return found


def links(page: Path) -> list[str]:
    return [t for t in LINK.findall(_prose(page.read_text(encoding="utf-8"))) if not re.match(r"[a-z]+:", t)]


def test_the_link_pattern_and_the_slugs_read_what_github_reads():
    assert LINK.findall("see [docs/x.md](docs/x.md#a-b) and ![img](img/p.png) and `[no](code.md)`") == [
        "docs/x.md#a-b",
        "img/p.png",
        "code.md",  # code spans are removed by _prose, not by the pattern
    ]
    assert links_of("a [b](c.md) `[d](e.md)`\n```\n[f](g.md)\n```\n") == ["c.md"]
    assert slug("Hugging Face backend (`benchmarks/hf.py`)") == "hugging-face-backend-benchmarkshfpy"
    assert slug("`StaticKVCache`: fixed shapes, one length per row") == "statickvcache-fixed-shapes-one-length-per-row"


def links_of(text: str) -> list[str]:
    return [t for t in LINK.findall(_prose(text)) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading with anchor #{anchor} in {file.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)} has broken links:\n" + "\n".join(broken)


def test_every_docs_page_is_linked_from_the_readme():
    readme = ROOT / "README.md"
    linked = {(readme.parent / t.partition("#")[0]).resolve() for t in links(readme)}
    missing = [str(p.relative_to(ROOT)) for p in PAGES[1:] if p.resolve() not in linked]
    assert not missing, f"pages of docs/ the README does not link (add them to its Documentation list): {missing}"
