"""Fine-tuning and evaluate-only, as real runs: weights in the formats people bring (a
torchvision file as its weights API caches it, a timm training checkpoint with an EMA and DDP's
`module.` names, a safetensors export) start the imagenet recipe on a small image folder on 2
processes (the other formats, read the same way on every rank, on one); a fine-tune stopped and resumed equals one that ran through; `make eval` of a run
gives its final eval record; the mistakes are one line."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import torchvision

from engine.export import write as write_export
from recipes.imagenet.data import DataConfig, make_shards
from recipes.imagenet.example import write_example
from tests import helpers

pytestmark = [pytest.mark.slow, pytest.mark.dist]

TINY = [
    "model.arch=resnet18",
    "train.batch_size=4",
    "train.epochs=1",
    "eval.batch_size=8",
    "data.augment.train_size=32",
    "data.augment.eval_resize=36",
    "data.augment.eval_size=32",
    "loader.num_workers=0",
]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def foreign(tmp_path_factory) -> dict:
    """An image folder, and 1000-class ResNet-18 weights in three formats."""
    root = tmp_path_factory.mktemp("finetune")
    write_example(root / "images")
    torch.manual_seed(1)
    weights = torchvision.models.resnet18(num_classes=1000).state_dict()
    torch.manual_seed(2)
    average = torchvision.models.resnet18(num_classes=1000).state_dict()
    cached = helpers.cache_stand_in_weights(
        "ResNet18_Weights.IMAGENET1K_V1", "resnet18", root / "torch", seed=1
    )
    timm = {
        "epoch": 9,
        "arch": "resnet18",
        "state_dict": {f"module.{k}": v for k, v in weights.items()},
        "state_dict_ema": {f"module.{k}": v for k, v in average.items()},
        "optimizer": {},
    }
    torch.save(timm, root / "checkpoint-9.pth.tar")
    write_export(weights, root / "export.safetensors", {"recipe": "imagenet", "step": 9})
    return {
        "root": root,
        "weights": weights,
        "average": average,
        "files": {
            "torchvision": (cached, [], 1),
            "timm-ema": (root / "checkpoint-9.pth.tar", ["model.init_ema=true"], 2),
            "safetensors": (root / "export.safetensors", [], 1),
        },
    }


def fine_tune_args(foreign: dict, kind: str, *more: str) -> list[str]:
    path, extra, _ = foreign["files"][kind]
    return [
        *TINY,
        f"data.root={foreign['root'] / 'images'}",
        f"model.init_from={path}",
        "model.num_classes=10",
        'optim.lr_mult=["fc.*=1", "*=0"]',
        "log.every_steps=1",
        *extra,
        *more,
    ]


@pytest.fixture(scope="module")
def two_process_fine_tune(foreign) -> Path:
    """timm's DDP checkpoint fine-tuned on 2 processes from the image folder, once: its test
    below reads it, and so does the same run from the folder's shards."""
    root = foreign["root"] / "runs"
    args = fine_tune_args(foreign, "timm-ema", "--spawn", "2")
    helpers.run_engine(root, "timm-ema", *args, recipe="imagenet")
    return root


@pytest.mark.parametrize("kind", ["torchvision", "timm-ema", "safetensors"])
def test_fine_tune_from_each_format(foreign, kind, train_here, request):
    """A 10-class head on a 1000-class file: exactly the head is re-initialised; the backbone
    at lr x 0 stays the file's (its EMA for timm's), the head trains; the file is recorded.
    timm's DDP checkpoint starts 2 processes (every rank reads the file); the others, whose
    reading does not depend on the rank, 1."""
    path, extra, processes = foreign["files"][kind]
    root = foreign["root"] / "runs"
    if processes > 1:
        request.getfixturevalue("two_process_fine_tune")
    else:  # nothing here depends on the process: trained in the test's
        train_here(root, kind, *fine_tune_args(foreign, kind), recipe="imagenet")
    log = (helpers.run_dir(root, kind, "imagenet") / "train.log").read_text()
    assert "re-initialised 2 (fc.weight, fc.bias), left unused 0" in log
    run = helpers.run_dir(root, kind, "imagenet")
    for record in ("env.json", "summary.json"):
        init = json.loads((run / record).read_text())["init"]
        assert (init["name"], init["sha256"]) == (path.name, sha256(path))
        assert init["reinitialised"] == ["fc.weight", "fc.bias"] and init["unused"] == []
    trained = helpers.final_weights(root, kind, "imagenet")
    source = foreign["average" if extra else "weights"]
    params = dict(torchvision.models.resnet18().named_parameters())
    backbone = [n for n in params if not n.startswith("fc.")]
    assert all(torch.equal(trained[n], source[n]) for n in backbone)
    assert trained["fc.weight"].shape == (10, 512)


def test_the_two_process_fine_tune_from_shards_is_the_folders_bit_for_bit(
    foreign, two_process_fine_tune
):
    """The same two gloo processes reading the folder's tar shards (make shards,
    data.format=shards) train the same bits: every loss, evaluation and weight (BN statistics too).
    Here rather than beside the other shard tests (tests/recipes/test_imagenet_shards.py):
    it reuses this module's 2-process run from the folder as its reference."""
    root, images = two_process_fine_tune, foreign["root"] / "images"
    shards = foreign["root"] / "shards"
    make_shards(DataConfig(root=str(images), shards=str(shards)))
    more = ["data.format=shards", f"data.shards={shards}", "--spawn", "2"]
    helpers.run_engine(
        root, "shards", *fine_tune_args(foreign, "timm-ema", *more), recipe="imagenet"
    )
    folder, sharded = (
        helpers.final_checkpoint(root, n, "imagenet") for n in ("timm-ema", "shards")
    )
    assert helpers.same_weights(folder["model"], sharded["model"])
    for kind in ("train", "eval"):
        runs = [helpers.records(root, n, kind, "imagenet") for n in ("timm-ema", "shards")]
        assert [r["loss"] for r in runs[0]] == [r["loss"] for r in runs[1]] and runs[0]
    assert folder["data"]["train"]["sha256"] == sharded["data"]["train"]["sha256"]
    env = json.loads((helpers.run_dir(root, "shards", "imagenet") / "env.json").read_text())
    assert env["data"]["train"]["summary"].endswith("bytes in 1 shard")


def test_named_weights_missing_from_the_cache_is_one_line(foreign, tmp_path):
    env = helpers.engine_env(TORCH_HOME=str(tmp_path / "empty"))
    out = helpers.run_engine(
        tmp_path,
        "missing",
        *TINY,
        f"data.root={foreign['root'] / 'images'}",
        "model.weights=ResNet18_Weights.IMAGENET1K_V1",
        recipe="imagenet",
        env=env,
        check=False,
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "not in the local cache" in lines[0], out.stderr
    assert "https://download.pytorch.org/models/resnet18-f37072fd.pth" in lines[0]
    assert not (tmp_path / "imagenet" / "missing").exists()


def test_named_weights_from_the_cache_with_their_preprocessing(foreign):
    env = helpers.engine_env(TORCH_HOME=str(foreign["root"] / "torch"))
    root = foreign["root"] / "runs"
    out = helpers.run_engine(
        root,
        "named",
        *TINY[:-3],  # the weights' resize and crop, not the test's
        f"data.root={foreign['root'] / 'images'}",
        "model.weights=ResNet18_Weights.IMAGENET1K_V1",
        "train.max_steps=1",
        recipe="imagenet",
        env=env,
    )
    assert "not the published file" in out.stderr  # its bytes are not torchvision's
    init = json.loads((helpers.run_dir(root, "named", "imagenet") / "env.json").read_text())["init"]
    assert init["weights"] == "ResNet18_Weights.IMAGENET1K_V1"
    assert init["preprocessing"].startswith("the weights' (ResNet18_Weights.IMAGENET1K_V1)")
    saved = (helpers.run_dir(root, "named", "imagenet") / "config.yaml").read_text()
    assert "eval_resize: 256" in saved and "eval_size: 224" in saved


# ---------------------------------------------------------------- digits: resume and eval

FINETUNE = [
    "model.width=16",  # not the recipe's 32: scoring must rebuild the model the run trained
    "train.epochs=2",  # 23 steps an epoch on 2 processes: the stop at step 30 is mid-epoch
    "optim.freeze=[0.*]",
    'optim.lr_mult=["16.*=1", "*=0.5"]',
    "ema.decay=0.9",
]


@pytest.fixture(scope="module")
def digits_runs(tmp_path_factory, train_here) -> Path:
    """A base run, its export, and fine-tunes from it: through, and stopped then resumed."""
    root = tmp_path_factory.mktemp("digits-finetune")
    train_here(root, "base", "train.epochs=1", "model.width=16")  # in this process: the base
    base = helpers.run_dir(root, "base")
    for name, stop in (("through", []), ("resumed", ["train.stop_at_step=30"])):
        spawn = ["--spawn", "2"]
        helpers.run_engine(root, name, f"model.init_from={base}", *FINETUNE, *stop, *spawn)
    out = helpers.run_engine(root, "resumed", f"model.init_from={base}", *FINETUNE, *spawn)
    assert "resuming from" in out.stderr
    return root


def test_a_resumed_fine_tune_equals_one_that_ran_through(digits_runs):
    through = helpers.final_checkpoint(digits_runs, "through")
    resumed = helpers.final_checkpoint(digits_runs, "resumed")
    assert helpers.same_weights(through["model"], resumed["model"])
    assert helpers.same_weights(through["ema"]["model"], resumed["ema"]["model"])
    base = helpers.final_weights(digits_runs, "base")
    assert torch.equal(through["model"]["0.weight"], base["0.weight"])  # frozen
    assert not torch.equal(through["model"]["16.weight"], base["16.weight"])  # trained
    inits = [
        json.loads((helpers.run_dir(digits_runs, n) / "summary.json").read_text())["init"]
        for n in ("through", "resumed")
    ]
    assert inits[0] == inits[1] and inits[0]["loaded"] == len(base)


def test_make_eval_of_a_run_equals_its_final_record(digits_runs, tmp_path):
    run = helpers.run_dir(digits_runs, "through")
    # No RECIPE, no model keys: `make eval` scores a run with the request it trained with.
    out = helpers.launch(
        "eval", GPUS="0", PROCS="2", CKPT=str(run), ARGS="log.wandb=off", timeout=300
    )
    assert out.returncode == 0, out.stderr
    final = helpers.records(digits_runs, "through", "eval")[-1]
    written = json.loads(next((run / "checkpoints").glob("*.eval.json")).read_text())
    assert written["step"] == final["step"] and written["world_size"] == 2
    assert written["metrics"] == {k: final[k] for k in written["metrics"]}
    ema = helpers.launch(
        "eval", RECIPE="digits", GPUS="0", CKPT=str(run), EMA="1", OUT=str(tmp_path / "e.json")
    )
    assert ema.returncode == 0, ema.stderr
    scored = json.loads((tmp_path / "e.json").read_text())["metrics"]
    assert scored == {k.removeprefix("ema_"): final[k] for k in final if k.startswith("ema_")} | {
        "count": final["count"]
    }
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1] == final  # the run's own records are untouched


def test_eval_of_a_runs_best_folder_scores_its_best_checkpoint(digits_runs, tmp_path):
    """On 3 processes, which do not divide the training batch: evaluation alone splits none."""
    run = helpers.run_dir(digits_runs, "through")
    (best,) = json.loads((run / "summary.json").read_text())["best_checkpoints"]
    out = tmp_path / "best.json"
    args = ["digits", *helpers.QUIET, "--eval", str(run / "best"), "--out", str(out)]
    done = helpers.engine_process(*args, "--spawn", "3")
    assert done.returncode == 0, done.stderr
    written = json.loads(out.read_text())
    assert written["step"] == best["step"] and written["weights"] == str(run / best["path"])
    assert written["world_size"] == 3
    (record,) = [
        r for r in helpers.records(digits_runs, "through", "eval") if r["step"] == best["step"]
    ]
    assert written["metrics"] == {k: record[k] for k in written["metrics"]}


def test_resume_from_a_weights_only_file_points_to_init_from(digits_runs, tmp_path):
    exported = tmp_path / "w.pt"
    write_export(helpers.final_weights(digits_runs, "base"), exported, {"step": 1})
    out = helpers.run_engine(tmp_path, "r", f"resume={exported}", check=False)
    assert out.returncode == 2
    assert out.stderr.strip() == (
        f"error: resume={exported} holds weights only (an export or published weights), not a "
        f"training checkpoint; start a run from them with model.init_from={exported}"
    )


def test_a_launch_of_several_processes_checks_the_weights_before_starting(tmp_path):
    missing = tmp_path / "nope.pt"
    out = helpers.launch(
        "train", GPUS="0", PROCS="2", ARGS=f"model.init_from={missing} run.root={tmp_path}"
    )
    assert out.returncode == 2
    assert out.stderr.strip() == (
        f"launch: model.init_from={missing}: no such file or folder (config checked for 2 "
        "process(es); nothing was started)"
    )
    assert not (tmp_path / "digits").exists()
