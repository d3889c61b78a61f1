"""Every relative link and image in the project's Markdown (README.md, docs/, the recipes',
tests' and bench's READMEs) reaches a file that exists and, with #anchor, a heading of that
file; no page links to itself by its own file name (a heading of its own: #anchor); and
every test a page names (`tests/x/test_y.py::test_z`, or without tests/) exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from launch.request import SLURM_FLAGS
from tests.helpers import REPO

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")  # a link, or an image (![alt](file))
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
        if file and dest == doc.resolve():
            broken.append(f"{target}: the page itself (#anchor alone links a heading here)")
        elif not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(REPO)}")
    assert not broken, broken


def test_the_link_check_sees_a_broken_link_and_a_missing_heading(tmp_path):
    (tmp_path / "a.md").write_text("# Top\n\n## Some part, here\n\ntext\n")
    doc = tmp_path / "b.md"
    doc.write_text("[ok](a.md#some-part-here) [gone](c.md) [bad](a.md#nowhere) ![i](d.png)\n")
    assert links(doc) == ["a.md#some-part-here", "c.md", "a.md#nowhere", "d.png"]
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


TEST_NAMED = re.compile(r"((?:tests/)?[a-z_]+(?:/[a-z_]+)*/test_\w+\.py)(?:::(\w+))?")


def named_tests(text: str) -> list[tuple[str, str]]:
    """(file under tests/, test name or "") for each test a page names."""
    return [(f.removeprefix("tests/"), name) for f, name in TEST_NAMED.findall(text)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_test_a_page_names_exists(doc):
    missing = []
    for file, name in named_tests(doc.read_text()):
        path = REPO / "tests" / file
        if not path.is_file():
            missing.append(f"tests/{file}: no such file")
        elif name and not re.search(rf"^\s*(async )?def {name}\b", path.read_text(), re.M):
            missing.append(f"tests/{file}::{name}: no such test")
    assert not missing, missing


def test_the_test_reference_check_reads_both_spellings():
    text = "(tests/engine/test_a.py::test_b) and engine/parallel/test_c.py, not engine/x.py"
    assert named_tests(text) == [("engine/test_a.py", "test_b"), ("engine/parallel/test_c.py", "")]


@pytest.mark.parametrize("recipe", sorted(p.parent.name for p in REPO.glob("recipes/*/README.md")))
def test_every_recipe_readme_has_the_commands_the_readme_promises(recipe):
    """README.md: "Each folder's README has ... the commands for CPU, 1 GPU, 8 GPUs, 2 nodes
    and SLURM": a make command for each, in the README's own shell blocks."""
    text = (REPO / "recipes" / recipe / "README.md").read_text()
    shell = "\n".join(re.findall(r"```bash\n(.*?)```", text, re.S))
    commands = [line for line in shell.splitlines() if re.search(r"\bmake (train|submit)\b", line)]
    wanted = {
        "8 GPUs": lambda c: "make train" in c and "GPUS=8" in c,
        "2 nodes": lambda c: "make train" in c and "NODES=2" in c and "RDZV_ENDPOINT=" in c,
        "SLURM": lambda c: "make submit" in c,
        "1 GPU or the CPU": lambda c: "make train" in c and "NODES" not in c and "GPUS=8" not in c,
    }
    missing = [what for what, holds in wanted.items() if not any(map(holds, commands))]
    assert not missing, f"recipes/{recipe}/README.md has no command for {missing}"
