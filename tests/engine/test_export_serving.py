"""make export OUT=model.onnx / model.pt2 (engine.export_graph): the recipe's model with a
checkpoint's weights, traced with a dynamic batch, checked on the spot against the eager model
on the recipe's held-out samples at two batch sizes, the figures in <OUT>.json; a model that
torch.export refuses, a missing package and a failed check are one line, exit 1, and leave
nothing written.

Checkpoints of cifar10, imagenet and gpt are built here, untrained (the check compares a
file with the model, whatever the weights): one short digits run covers a real run's
newest, EMA and best checkpoints and the top-1 through onnxruntime against `make eval`'s."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from engine import catalog, export, export_graph
from engine import checkpoint as ckpt
from engine.parallel import meta_init
from tests.helpers import QUIET, run_dir
from tests.recipes.tiny_settings import tiny_overrides

onnx_packages = pytest.mark.skipif(
    any(importlib.util.find_spec(p) is None for p in export_graph.ONNX_PACKAGES),
    reason="onnx, onnxruntime or onnxscript not installed (requirements.lock pins them)",
)


def built_checkpoint(root: Path, recipe: str, *overrides: str) -> Path:
    """An untrained checkpoint of the recipe's model where a run would put it, with its config
    (the tiny settings and example data), as engine.export reads any checkpoint."""
    args = [*QUIET, *tiny_overrides(recipe, root / "data"), f"run.root={root}", *overrides]
    cfg, recipe_ = catalog.load_config(recipe, [*args, "run.name=built"])
    torch.manual_seed(0)
    model = meta_init.build(recipe_, cfg.model)
    if meta_init.on_meta(model):
        meta_init.initialise(model, recipe_, cfg.model, 0, torch.device("cpu"))
    path = ckpt.checkpoint_path(run_dir(root, "built", recipe) / "checkpoints", 1)
    ckpt.atomic_save({"model": model.state_dict(), "step": 1, "config": cfg.to_dict()}, path)
    return path


def exported(source: Path, out: Path, *flags: str, capsys) -> tuple[int, str, str]:
    code = export.main([str(source), str(out), *flags])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_checked(out: Path, line: str) -> dict:
    """OUT and its JSON are there, the check passed at two batch sizes, the line says it."""
    record = json.loads(export_graph.json_path(out).read_text())
    check = record["check"]
    assert check["passed"] and check["tolerance"] == 1e-4
    # batch 1 and 8 (fewer where the held-out split is smaller: imagenet's example has 6)
    assert check["batch_sizes"] == [1, min(8, check["samples"])] and check["samples"] >= 6
    assert all(r <= 1e-4 for r in check["relative_diff"].values()), check
    assert record["sha256"] == hashlib.sha256(out.read_bytes()).hexdigest()
    line = line.strip().splitlines()[-1]  # after "newest valid checkpoint in ..." for a run
    assert line.startswith(f"wrote {out}: input batchx") and "<= 0.0001" in line
    assert not [p.name for p in out.parent.iterdir() if p.name.startswith(".")]  # no temp left
    return record


# ---------------------------------------------------------------- a real digits run


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory, train_here) -> Path:
    """One short digits run with an EMA and best checkpoints (made once for the module)."""
    root = tmp_path_factory.mktemp("serving")
    train_here(root, "short", "train.epochs=2", "ema.decay=0.9", "ckpt.best=1")
    return run_dir(root, "short")


@pytest.mark.slow
@onnx_packages
def test_digits_onnx_top1_through_onnxruntime_equals_make_evals(digits_run, tmp_path, capsys):
    from engine.cli import main as engine_main

    out = tmp_path / "digits.onnx"
    code, line, err = exported(digits_run, out, capsys=capsys)
    assert (code, err) == (0, ""), err
    record = assert_checked(out, line)
    assert record["input"] == {"shape": ["batch", 1, 8, 8], "dtype": "float32"}
    assert record["format"] == "onnx" and record["opset"] >= 18 and record["recipe"] == "digits"
    assert record["source"].startswith("short/step-") and record["ema"] is False
    assert set(record["check"]["max_abs_diff"]) == {"onnxruntime", "exported program"}

    scored = tmp_path / "eval.json"  # make eval CKPT=<the run> OUT=...
    assert engine_main(["--eval", str(digits_run), "--out", str(scored)]) == 0
    expected = json.loads(scored.read_text())["metrics"]
    session = export_graph.OnnxRunner(out)
    source = ckpt.checkpoint_path(digits_run / "checkpoints", record["step"])
    tensors, info = export.read_weights(source, ema=False)
    with export_graph.served([source], None, tensors, "digits") as model:
        correct = count = 0
        for x, y in export_graph.held_out(model.run, 64):
            (logits,) = session(x)
            correct += int((logits.argmax(1) == y).sum())
            count += len(y)
        assert count == expected["count"] == len(model.run.feed.eval_data)  # the whole split
    assert correct / count == pytest.approx(expected["top1"], abs=1e-12)


@pytest.mark.slow
def test_digits_pt2_of_the_best_ema_weights_serves_any_batch(digits_run, tmp_path, capsys):
    out = tmp_path / "best-ema.pt2"
    code, line, err = exported(digits_run, out, "--best", "--ema", capsys=capsys)
    assert code == 0, err
    record = assert_checked(out, line)
    assert record["format"] == "torch.export" and record["ema"] is True
    assert record["source"].startswith("short/best/step-")
    assert set(record["check"]["max_abs_diff"]) == {"exported program (from the file)"}
    program = torch.export.load(out).module()
    assert program(torch.zeros(3, 1, 8, 8)).shape == (3, 10)  # a batch the check did not use


# ---------------------------------------------------------------- the other recipes


@pytest.mark.slow
@onnx_packages
@pytest.mark.parametrize("recipe", ["cifar10", "imagenet"])
def test_image_recipes_export_to_onnx_and_pt2_within_tolerance(recipe, tmp_path, capsys):
    """cifar10's tiny ResNet and imagenet's ResNet-18 on 32-pixel example images."""
    classes = ["model.num_classes=3"] if recipe == "imagenet" else []  # its example classes
    source = built_checkpoint(tmp_path, recipe, *classes)
    shape = {"cifar10": [3, 32, 32], "imagenet": [3, 32, 32]}[recipe]
    for suffix in (".onnx", ".pt2"):
        out = tmp_path / f"{recipe}{suffix}"
        code, line, err = exported(source, out, capsys=capsys)
        assert code == 0, err
        assert assert_checked(out, line)["input"]["shape"] == ["batch", *shape]


@pytest.mark.slow
@onnx_packages
def test_gpt_exports_token_batches(tmp_path, capsys):
    source = built_checkpoint(tmp_path, "gpt")
    for suffix in (".onnx", ".pt2"):
        out = tmp_path / f"gpt{suffix}"
        code, line, err = exported(source, out, capsys=capsys)
        assert code == 0, err
        record = assert_checked(out, line)
        assert record["input"] == {"shape": ["batch", 16], "dtype": "int64"}


# ---------------------------------------------------------------- refusals


class Gate(nn.Module):
    """Data-dependent control flow: which branch runs depends on the values."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x * 2
        return x


def planted(cfg) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, cfg.num_classes), Gate())


def test_a_module_torch_export_refuses_is_one_line_naming_it(tmp_path, capsys, monkeypatch):
    real = catalog.load

    def load(name: str):
        recipe = real(name)
        return dataclasses.replace(recipe, build_model=planted) if name == "digits" else recipe

    monkeypatch.setattr(catalog, "load", load)
    source = built_checkpoint(tmp_path, "digits")
    before = sorted(tmp_path.rglob("*"))
    code, line, err = exported(source, tmp_path / "gated.pt2", capsys=capsys)
    assert (code, line) == (1, "")
    assert err.count("\n") == 1, err
    assert err.startswith(
        "error: torch.export refuses module 2 (Gate, tests/engine/test_export_serving.py:"
    )
    assert "`if x.sum() > 0:`): Could not guard on data-dependent expression" in err
    assert sorted(tmp_path.rglob("*")) == before  # nothing written, nothing left


def test_a_failed_check_keeps_the_users_file_and_writes_nothing(tmp_path, capsys, monkeypatch):
    source = built_checkpoint(tmp_path, "digits")
    out = tmp_path / "model.pt2"
    out.write_bytes(b"keep me")
    before = sorted(tmp_path.rglob("*"))
    monkeypatch.setattr(export_graph, "TOLERANCE", -1.0)  # no difference passes
    code, line, err = exported(source, out, "--force", capsys=capsys)
    assert (code, line) == (1, "") and err.count("\n") == 1
    assert err.startswith(f"error: {out}: the check failed, nothing written: input batchx1x8x8")
    assert "EXCEEDS -1" in err
    assert out.read_bytes() == b"keep me" and not export_graph.json_path(out).exists()
    assert sorted(tmp_path.rglob("*")) == before


def test_a_missing_package_is_one_line_before_any_checkpoint_is_read(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxscript", None)  # as if it were not installed
    code, line, err = exported(tmp_path / "no-such.pt", tmp_path / "m.onnx", capsys=capsys)
    assert (code, line) == (1, "")
    assert err == (
        "error: writing .onnx needs onnxscript, not installed: pip install onnx onnxruntime "
        "onnxscript (requirements.lock pins them; the project's `serving` extra), or export to "
        ".pt2\n"
    )


def test_an_existing_json_beside_out_is_not_replaced_without_force(tmp_path, capsys):
    beside = tmp_path / "m.pt2.json"
    beside.write_text("mine")
    code, _, err = exported(tmp_path / "x.pt", tmp_path / "m.pt2", capsys=capsys)
    assert code == 2 and err == (
        f"error: {beside} exists; pass --force (make export ... FORCE=1) to replace it\n"
    )
    assert beside.read_text() == "mine"
