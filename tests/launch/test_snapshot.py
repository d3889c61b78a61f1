"""The snapshot of the code per submission (launch.snapshot): what it holds and leaves out,
one folder per code, read-only, and a job's processes importing it rather than the
checkout. The queued and requeued jobs on the real cluster: tests/slurm/test_snapshot_slurm.py."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine import codeid
from launch import render, snapshot
from launch.errors import UserError
from launch.render import LaunchRequest
from tests import helpers
from tests.helpers import git, git_checkout


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    return git_checkout(tmp_path_factory.mktemp("checkout"))


def changed(repo: Path, text: str) -> None:
    """An uncommitted edit of a tracked source file."""
    path = repo / "engine" / "train.py"
    path.write_text(path.read_text().split("\n# test edit")[0] + f"\n# test edit {text}\n")


def request(repo: Path, name: str = "r") -> LaunchRequest:
    return snapshot.attach(LaunchRequest(recipe="digits", run_name=name, src=str(repo)))


def test_a_snapshot_holds_the_code_as_it_is_and_never_data_runs_or_venvs(repo):
    changed(repo, "one")
    (repo / "recipes" / "digits" / "untracked_helper.py").write_text("X = 1\n")
    for ignored in ("runs/digits/old/metrics.jsonl", "data/digits/x.bin", ".venv/bin/python"):
        (repo / ignored).parent.mkdir(parents=True, exist_ok=True)
        (repo / ignored).write_text("not code")
    try:
        req = request(repo)
        code = snapshot.take(req)
    finally:
        (repo / "recipes" / "digits" / "untracked_helper.py").unlink()
        git(repo, "checkout", "--", "engine/train.py")
    identity = codeid.identity(code)
    assert code == repo / "runs" / "digits" / "r" / "code" / snapshot.name_of(identity)
    assert identity["commit"] == git(repo, "rev-parse", "HEAD") and identity["dirty"]
    assert json.loads((code / codeid.RECORD).read_text())["snapshot_of"] == str(repo)
    assert set(identity) == {"commit", "dirty", "diff_sha256"}  # what runs record: no path
    assert (code / "engine" / "train.py").read_text().endswith("# test edit one\n")
    assert (code / "recipes" / "digits" / "untracked_helper.py").read_text() == "X = 1\n"
    assert not any((code / top).exists() for top in ("runs", "data", ".venv", ".git"))
    assert not (code / "engine" / "train.py").stat().st_mode & 0o222


def test_other_code_gets_a_folder_of_its_own_and_the_same_code_the_same(repo):
    first = snapshot.take(request(repo, "twice"))
    written = (first / codeid.RECORD).stat().st_mtime_ns
    stray = repo / "slurm-9.out"  # a job's output, not code: the same code all the same
    stray.write_text("log")
    try:
        assert snapshot.take(request(repo, "twice")) == first  # reused as it is
    finally:
        stray.unlink()
    assert not (first / "slurm-9.out").exists()
    assert (first / codeid.RECORD).stat().st_mtime_ns == written
    changed(repo, "two")
    try:
        second = snapshot.take(request(repo, "twice"))
    finally:
        git(repo, "checkout", "--", "engine/train.py")
    assert second != first and second.parent == first.parent
    assert "# test edit" not in (first / "engine" / "train.py").read_text()  # never changed
    assert (second / "engine" / "train.py").read_text().endswith("# test edit two\n")
    assert not codeid.same_code(codeid.identity(first), codeid.identity(second))


def test_a_job_s_processes_import_the_snapshot_while_working_in_the_checkout(repo):
    req = request(repo, "imports")
    code = snapshot.take(req)
    changed(repo, "after submission")  # the checkout moves on
    probe = (
        "import json, os, engine, launch, recipes; from engine import codeid; "
        "print(json.dumps([os.getcwd(), engine.__file__, launch.__file__, "
        "recipes.__file__, codeid.identity()]))"
    )
    env = helpers.launch_env() | render.code_environment(req)
    try:
        done = subprocess.run(
            [sys.executable, "-c", probe], cwd=repo, env=env, capture_output=True, text=True
        )
    finally:
        git(repo, "checkout", "--", "engine/train.py")
    assert done.returncode == 0, done.stderr
    cwd, *modules, identity = json.loads(done.stdout)
    assert cwd == str(repo)  # relative run.root and data.root keep meaning the checkout's
    assert all(Path(m).is_relative_to(code) for m in modules), modules
    assert identity == codeid.identity(code) and identity["commit"] == git(
        repo, "rev-parse", "HEAD"
    )
    assert render.code_environment(req)["RECIPES_DATA"] == str(repo / "data")


def test_the_batch_scripts_export_the_snapshot_before_anything_runs(repo):
    req = request(repo, "it's quoted")
    env = render.code_environment(req)
    script = render.sbatch_script(req)
    exports = [f"export {k}={render.shlex.quote(v)}" for k, v in env.items()]
    assert all(line in script.splitlines() for line in exports), script
    assert script.index(exports[0]) < script.index("srun ")
    from launch import slurm  # submitit's script: the same lines, before its srun

    assert slurm.setup_lines(req)[-3:] == exports
    assert slurm.engine_job(req).code == env["PYTHONPATH"]


def test_a_dry_run_names_the_snapshot_and_writes_none_a_batch_script_writes_it(tmp_path):
    args = f"run.name=snap run.root={tmp_path}"
    dry = helpers.launch("submit", DRY_RUN="1", GPUS="0", ARGS=args)
    assert dry.returncode == 0, dry.stderr
    named = [ln for ln in dry.stdout.splitlines() if ln.startswith("export PYTHONPATH=")]
    assert len(named) == 1, dry.stdout
    folder = Path(named[0].removeprefix("export PYTHONPATH="))
    assert folder.parent == tmp_path / "digits" / "snap" / "code" and not folder.exists()

    done = helpers.launch("sbatch", GPUS="0", ARGS=args)
    assert done.returncode == 0, done.stderr
    assert f"export PYTHONPATH={folder}" in done.stdout.splitlines()
    assert codeid.same_code(codeid.identity(folder), codeid.identity(helpers.REPO))


@pytest.mark.parametrize(
    ("run_root", "inside"),
    [
        ("runs", "/workspace/runs/digits/p/code/c0"),
        ("/scratch/runs", "/scratch/runs/digits/p/code/c0"),
    ],
)
def test_pyxis_s_container_imports_the_snapshot_through_its_mounts(run_root, inside):
    base = LaunchRequest(recipe="digits", run_name="p", src="/ck", run_root=run_root)
    req = dataclasses.replace(base, code=f"{base.run_dir}/code/c0")
    (export,) = [a for a in render.pyxis(req) if a.startswith("--export=")]
    assert export.split(",")[2:] == [f"PYTHONPATH={inside}", "PYTHONSAFEPATH=1"]
    (without,) = [a for a in render.pyxis(base) if a.startswith("--export=")]
    assert "PYTHONPATH" not in without


def test_a_checkout_holding_a_dataset_git_does_not_ignore_is_refused_in_one_line(repo, monkeypatch):
    monkeypatch.setattr(snapshot, "MAX_BYTES", 2**20)
    big = repo / "stray_dataset.json"
    big.write_bytes(b"\0" * 2**21)
    try:
        with pytest.raises(UserError, match=r"largest: stray_dataset\.json \(2 MB\).*\.gitignore"):
            snapshot.take(request(repo, "big"))
    finally:
        big.unlink()
    assert not (repo / "runs" / "digits" / "big").exists()
