"""python -m engine.export: a checkpoint (file, sharded directory or run directory) becomes a
plain state dict that a single-process model loads strictly and that computes what the
source weights compute; user mistakes are one line, exit 2, and no OUT.

A fresh interpreter (this file run as a script) does the loading, so nothing from the
training side (wrappers, process groups, registered classes) can help it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from engine import checkpoint as ckpt
from engine import export
from engine.checkpoint import sharded
from tests import helpers

HERE = Path(__file__).resolve()
REPO = HERE.parents[2]
X = torch.linspace(-1, 1, 4 * 6).reshape(4, 6)


def build() -> nn.Module:
    """A plain model with a buffer-carrying layer, so buffers travel too."""
    return nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 2))


def trained(seed: int):
    torch.manual_seed(seed)
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    model(torch.randn(8, 6)).square().mean().backward()
    optimizer.step()
    return model.eval(), optimizer


def outputs(state: dict) -> torch.Tensor:
    model = build().eval()
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        return model(X)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    """A run directory with an older file checkpoint (DDP-style `module.` names, an EMA),
    and a newer sharded one; and the outputs each set of weights must give."""
    root = tmp_path_factory.mktemp("export")
    folder = root / "digits" / "run-a" / "checkpoints"
    model, optimizer = trained(0)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    with torch.no_grad():
        for p in ema.module.parameters():
            p.mul_(0.5)  # the average differs from the weights
    state = {
        "model": {f"module.{k}": v for k, v in model.state_dict().items()},
        "ema": {"model": ema.module.state_dict(), "n_averaged": ema.n_averaged},
        "step": 4,
        "config": {"recipe": "digits"},
    }
    ckpt.atomic_save(state, ckpt.checkpoint_path(folder, 4))
    newer, newer_opt = trained(1)
    meta = {"step": 8, "config": {"recipe": "digits"}}
    sharded.save(ckpt.sharded_path(folder, 8), newer, newer_opt, meta)
    return {
        "run": folder.parent,
        "file": ckpt.checkpoint_path(folder, 4),
        "dir": ckpt.sharded_path(folder, 8),
        "expect": {
            "file": outputs(model.state_dict()),
            "ema": outputs(ema.module.state_dict()),
            "dir": outputs(newer.state_dict()),
        },
    }


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()} | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=120, env=env, cwd=REPO
    )


def test_exports_load_strictly_in_a_fresh_process_and_compute_the_same(run, tmp_path, capsys):
    cases = {  # OUT: (arguments, which weights)
        "file.pt": ([str(run["file"])], "file"),
        "file.safetensors": ([str(run["file"])], "file"),
        "ema.safetensors": ([str(run["file"]), "--ema"], "ema"),
        "dir.pt": ([str(run["dir"])], "dir"),
        "dir.safetensors": ([str(run["dir"])], "dir"),
        "run.pt": ([str(run["run"])], "dir"),  # a run directory: its newest checkpoint
    }
    said = {}
    for name, (args, _) in cases.items():
        assert export.main([args[0], str(tmp_path / name), *args[1:]]) == 0
        said[name] = capsys.readouterr().out.strip().splitlines()[-1]
    assert said["ema.safetensors"] == (
        f"wrote {tmp_path / 'ema.safetensors'}: EMA weights of step 4, 9 tensors, "
        "68 parameters (buffers included)"
    )
    assert said["dir.pt"].startswith(f"wrote {tmp_path / 'dir.pt'}: weights of step 8, 9 tensors")

    expected = {name: run["expect"][which] for name, (_, which) in cases.items()}
    torch.save(expected, tmp_path / "expected.pt")
    out = cli(str(HERE), "check", str(tmp_path), *cases)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == [f"ok:{name}" for name in cases]

    from safetensors import safe_open

    with safe_open(tmp_path / "dir.safetensors", "pt") as f:
        assert f.metadata() == {"recipe": "digits", "step": "8", "source": "run-a/step-00000008"}


def test_a_run_directory_names_the_checkpoint_it_exports(run, tmp_path, capsys):
    assert export.main([str(run["run"]), str(tmp_path / "w.pt")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"newest valid checkpoint in {run['run']}: step-00000008"
    assert "of step 8" in lines[1]


def test_user_mistakes_are_one_line_exit_2_and_leave_no_file(run, tmp_path, capsys):
    not_ckpt = tmp_path / "notes.pt"
    not_ckpt.write_text("not a checkpoint")
    empty_run = tmp_path / "empty-run"
    (empty_run / "checkpoints").mkdir(parents=True)
    existing = tmp_path / "exists.pt"
    existing.write_bytes(b"keep me")
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    sharded_no_ema = str(run["dir"])
    cases = [
        ([str(tmp_path / "missing.pt"), "o.pt"], "does not exist"),
        ([str(not_ckpt), "o.pt"], "is not a readable checkpoint"),
        ([str(empty_run), "o.pt"], "is not a checkpoint"),
        ([str(run["file"]), "o.tflite"], "unknown format .tflite; use .pt or .safetensors"),
        ([str(run["file"]), str(existing)], "exists; pass --force (make export ... FORCE=1)"),
        ([str(run["file"]), str(blocked / "o.pt")], "(Not a directory); choose another OUT"),
        ([sharded_no_ema, "o.pt", "--ema"], "holds no EMA of the weights"),
    ]
    for args, message in cases:
        args[1] = args[1] if "/" in args[1] else str(tmp_path / args[1])
        assert export.main(args) == 2, args
        captured = capsys.readouterr()
        assert captured.err.startswith("error: ") and message in captured.err, captured.err
        assert captured.err.count("\n") == 1 and captured.out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "a-file",
        "empty-run",
        "exists.pt",
        "notes.pt",
    ]
    assert existing.read_bytes() == b"keep me"
    assert export.main([str(run["file"]), str(existing), "--force"]) == 0
    assert torch.load(existing, weights_only=True).keys() == build().state_dict().keys()

    out = cli("-m", "engine.export", str(tmp_path / "missing.pt"), str(tmp_path / "o.pt"))
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr == f"error: {tmp_path / 'missing.pt'} does not exist\n"


@pytest.mark.slow
def test_a_digits_run_exports_with_its_recipe_in_the_metadata(tmp_path, train_here):
    """A real run's checkpoint: the recipe comes from its config, or from where the engine
    put it (<run.root>/<recipe>/<run name>/checkpoints/) when the config does not name it."""
    train_here(tmp_path, "tiny", "train.max_steps=2")  # tests/engine/conftest.py
    out = tmp_path / "digits.safetensors"
    done = cli("-m", "engine.export", str(helpers.run_dir(tmp_path, "tiny")), str(out))
    assert done.returncode == 0, done.stderr
    from safetensors import safe_open

    with safe_open(out, "pt") as f:
        assert f.metadata() == {"recipe": "digits", "step": "2", "source": "tiny/step-00000002.pt"}


def test_the_recipe_is_the_configs_else_the_run_directorys(tmp_path):
    in_a_run = tmp_path / "runs" / "gpt" / "r1" / "checkpoints" / "step-00000004.pt"
    assert export.recipe_of({"config": {"recipe": "digits"}}, in_a_run) == "digits"
    assert export.recipe_of({"config": {"seed": 0}}, in_a_run) == "gpt"
    assert export.recipe_of({}, Path("runs/gpt/r1/checkpoints/step-00000004.pt")) == "gpt"
    assert export.recipe_of({"config": {}}, tmp_path / "step-00000004.pt") == ""  # moved away


def test_make_export_names_its_own_switch_to_replace_a_file(run, tmp_path):
    existing = tmp_path / "w.pt"
    existing.write_bytes(b"keep me")
    make = ["make", "-s", "-o", ".venv/.installed-lock", "export"]
    env = helpers.engine_env(CKPT=str(run["file"]), OUT=str(existing), MAKEFLAGS="", MAKELEVEL="")
    done = subprocess.run(make, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and existing.read_bytes() == b"keep me"
    assert f"error: {existing} exists; pass --force (make export ... FORCE=1) to replace it" in (
        done.stderr
    )


def _check(folder: Path, names: list[str]) -> None:
    """In a fresh interpreter: load each export as a user would, compare the outputs."""
    expected = torch.load(folder / "expected.pt", weights_only=True)
    for name in names:
        path = folder / name
        if name.endswith(".safetensors"):
            from safetensors.torch import load_file

            state = load_file(path)
        else:
            state = torch.load(path, weights_only=True)
        assert torch.equal(outputs(state), expected[name]), name
        print(f"ok:{name}")


if __name__ == "__main__":
    if sys.argv[1] == "check":
        _check(Path(sys.argv[2]), sys.argv[3:])
