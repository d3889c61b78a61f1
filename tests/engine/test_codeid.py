"""The code's identity (engine.codeid) on a small git repository of its own: what a resume
and a job's snapshot compare. The runs that refuse a resume over other code are
tests/engine/test_code_identity.py's."""

from __future__ import annotations

from engine import codeid
from tests.helpers import git


def test_untracked_code_is_part_of_the_code_identity(tmp_path):
    """A module git does not track yet changes the identity, and so does its edit; what git
    ignores and files that are not code do not."""
    git(tmp_path, "init", "-q")
    (tmp_path / "model.py").write_text("WIDTH = 8\n")
    (tmp_path / ".gitignore").write_text("runs/\n")
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-q", "-m", "base")
    clean = codeid.identity(tmp_path)
    assert clean["diff_sha256"] is None and clean["dirty"] is False

    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "helper.py").write_text("ignored = True\n")  # git ignores it
    (tmp_path / "slurm-7.out").write_text("a job's output\n")  # not code
    assert codeid.same_code(codeid.identity(tmp_path), clean)

    (tmp_path / "helper.py").write_text("SCALE = 1\n")  # untracked code
    added = codeid.identity(tmp_path)
    assert added["diff_sha256"] and not codeid.same_code(added, clean)
    (tmp_path / "helper.py").write_text("SCALE = 2\n")  # the same file, edited
    edited = codeid.identity(tmp_path)
    assert edited["diff_sha256"] and not codeid.same_code(edited, added)
