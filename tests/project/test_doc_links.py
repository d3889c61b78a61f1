"""Every relative link in the project's Markdown (README.md, docs/, the recipes', tests' and
bench's READMEs) reaches a file that exists and, with #anchor, a heading of that file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from launch.request import SLURM_FLAGS
from tests.helpers import REPO

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
DOCS = sorted(
    p
    for p in [
        REPO / "README.md",
        *REPO.glob("docs/**/*.md"),
        *REPO.glob("*/README.md"),
        *REPO.glob("recipes/*/README.md"),
    ]  # fmt: skip
    if ".venv" not in p.parts
)


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    text = FENCE.sub("", path.read_text())
    found = set()
    for heading in re.findall(r"^#+\s+(.+?)\s*$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        found.add(slug)
    return found


def links(path: Path) -> list[str]:
    return [t for t in LINK.findall(FENCE.sub("", path.read_text())) if "://" not in t
            and not t.startswith("mailto:")]  # fmt: skip


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(doc):
    broken = []
    for target in links(doc):
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(REPO)}")
    assert not broken, broken


def test_the_link_check_sees_a_broken_link_and_a_missing_heading(tmp_path):
    (tmp_path / "a.md").write_text("# Top\n\n## Some part, here\n\ntext\n")
    doc = tmp_path / "b.md"
    doc.write_text("[ok](a.md#some-part-here) [gone](c.md) [bad](a.md#nowhere)\n")
    assert links(doc) == ["a.md#some-part-here", "c.md", "a.md#nowhere"]
    assert "some-part-here" in anchors(tmp_path / "a.md") and "nowhere" not in anchors(
        tmp_path / "a.md"
    )


def test_the_readme_is_a_page_a_newcomer_reads_and_names_no_commit():
    """README.md: the two commands, the recipes, the request interface and links, within 300
    lines; measurements with their commits live in docs/ (a commit hash dates a page)."""
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    words = set(re.findall(r"\b[0-9a-f]{7,40}\b", FENCE.sub("", text)))
    assert not {w for w in words if re.search(r"[a-f]", w) and re.search(r"[0-9]", w)}


def test_each_shortcut_in_the_docs_sets_the_key_launch_sets():
    """docs/config.md's table of Make variables and the config keys they set is launch's own
    mapping (launch.request.SLURM_FLAGS), row for row: one name per setting in the docs."""
    text = (REPO / "docs" / "config.md").read_text()
    rows = dict(re.findall(r"^\| `([A-Z_]+)` \| `([a-z_.]+)` \|", text, flags=re.M))
    expected = {var: f"slurm.{key}" for key, (_, var) in SLURM_FLAGS.items()}
    expected |= {"GPUS": "slurm.gpus_per_node", "NODES": "slurm.nodes"}
    assert rows == expected
