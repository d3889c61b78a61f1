"""timm models in the imagenet recipe (`model.arch=timm/<name>`): a real timm model trains and
evaluates on a small folder of JPEG files in a real process, with its FLOPs counted; without
timm, or with a name timm does not have, the run stops in one line before anything is read or
written; and no other run imports timm."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from recipes.imagenet.model import TIMM_VERSION, ModelConfig, build_model
from tests.datagen_images import write_image_folder
from tests.helpers import REPO, engine_env, final_checkpoint, records, run_dir, run_engine
from tests.project.test_pinning import LOCK, lock_versions
from tests.recipes.cli_calls import engine_calls

# timm's own test models (a few hundred thousand parameters): names torchvision does not
# have, so a run that trains one trained timm's. (name, image size: the ViT's is fixed)
MODELS = [("test_convnext", 32), ("test_vit", 160)]
# `python -m engine.train ...` in a Python where `import timm` fails, as where it is not
# installed (a None in sys.modules stops the import).
WITHOUT_TIMM = (
    "import runpy, sys; sys.modules['timm'] = None; "
    "runpy.run_module('engine.train', run_name='__main__', alter_sys=True)"
)


IMAGENET = ["train.batch_size=6", "eval.batch_size=4", "loader.num_workers=0", "log.every_steps=1"]


def imagenet(root, name, *overrides, prefix=None, check=True):
    return run_engine(
        root, name, *IMAGENET, *overrides, recipe="imagenet", prefix=prefix, check=check
    )


def sizes(size: int) -> list[str]:
    keys = ("train_size", "eval_resize", "eval_size")
    return [f"data.augment.{key}={size}" for key in keys]


def forward_flops(arch: str, size: int) -> float:
    """One sample's forward FLOPs, counted on the meta device (on the CPU, FlopCounterMode
    misses the attention of SDPA's fused kernel)."""
    with torch.device("meta"):
        model = build_model(ModelConfig(arch=arch, num_classes=3)).eval()
        sample = torch.zeros(1, 3, size, size)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(sample)
    return counter.get_total_flops()


def test_the_timm_version_is_the_locked_one():
    assert lock_versions((REPO / LOCK).read_text())["timm"] == TIMM_VERSION
    pytest.importorskip("timm")
    assert importlib.metadata.version("timm") == TIMM_VERSION


@pytest.mark.slow
@pytest.mark.parametrize("arch, size", MODELS)
def test_a_timm_model_trains_and_evaluates(tmp_path, arch, size, train_here):
    pytest.importorskip("timm")
    data = write_image_folder(tmp_path / "imagenet")
    common = [f"data.root={data}", f"model.arch=timm/{arch}", *sizes(size)]
    # log.peak_tflops: the engine counts the model's FLOPs (on the meta device) for the MFU
    train_here(tmp_path, "t", *IMAGENET, *common, "train.max_steps=3", "log.peak_tflops=1",
               recipe="imagenet")  # fmt: skip
    model = build_model(ModelConfig(arch=f"timm/{arch}", num_classes=3))
    assert type(model).__module__.startswith("timm.models."), type(model)
    weights = final_checkpoint(tmp_path, "t", "imagenet")["model"]
    expected = {k: v.shape for k, v in model.state_dict().items()}
    assert {k: v.shape for k, v in weights.items()} == expected  # timm's model, 3 classes
    assert f"arch: timm/{arch}" in (run_dir(tmp_path, "t", "imagenet") / "config.yaml").read_text()
    assert records(tmp_path, "t", "eval", "imagenet")[-1]["count"] == 6  # each image once
    step = records(tmp_path, "t", "train", "imagenet")[-1]
    counted = step["mfu"] * 1e12 / step["samples_per_s"]  # mfu = rate x FLOPs / peak
    assert counted == pytest.approx(3 * forward_flops(f"timm/{arch}", size), rel=1e-6)


def one_line_error(out: subprocess.CompletedProcess) -> str:
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert lines[0].startswith("error: "), out.stderr
    return lines[0]


def test_without_timm_a_timm_arch_is_one_line_naming_the_install(tmp_path):
    missing = tmp_path / "no-data-here"  # the name is checked first: the data is not read
    prefix = [sys.executable, "-c", WITHOUT_TIMM]
    out = imagenet(
        tmp_path,
        "t",
        f"data.root={missing}",
        "model.arch=timm/resnet18",
        prefix=prefix,
        check=False,
    )
    line = one_line_error(out)
    assert "'timm/resnet18' needs timm" in line, line
    assert f"pip install timm=={TIMM_VERSION}" in line and "requirements.lock" in line, line
    assert not (tmp_path / "imagenet").exists()  # no run directory


def test_without_timm_torchvision_models_still_train(tmp_path):
    data = write_image_folder(tmp_path / "imagenet")
    prefix = [sys.executable, "-c", WITHOUT_TIMM]
    overrides = ["model.arch=resnet18", *sizes(32), "train.max_steps=1", "eval.batch_size=8"]
    imagenet(tmp_path, "t", f"data.root={data}", *overrides, prefix=prefix)


UNKNOWN = [
    ("timm/resnet81", "did you mean timm/resnet18,"),
    ("timm/convnext_tiny.fb_in1kk", "did you mean timm/convnext_tiny.fb_in1k,"),
    ("deit_tiny_patch16_224", "did you mean timm/deit_tiny_patch16_224?"),
]


def test_an_unknown_name_is_one_line_with_close_matches(tmp_path):
    """Each name's command line in turn, in one process (each stops at its config)."""
    pytest.importorskip("timm")
    calls = engine_calls(
        *(
            ["imagenet", f"run.root={tmp_path / str(i)}", "run.name=t", "data.root=/nonexistent"]
            + [f"model.arch={arch}"]
            for i, (arch, _) in enumerate(UNKNOWN)
        )
    )
    for i, ((arch, suggestion), out) in enumerate(zip(UNKNOWN, calls, strict=True)):
        line = one_line_error(out)
        assert f"model.arch={arch!r} is not a" in line and suggestion in line, line
        assert not (tmp_path / str(i) / "imagenet").exists()


def test_other_runs_never_import_timm():
    """Only a timm/ name imports timm (seconds of start-up): not the engine, not resolving
    the imagenet or digits configs, not building a torchvision model."""
    script = (
        "import sys\n"
        "from engine import catalog, lifecycle\n"
        "from recipes.imagenet.model import ModelConfig, build_model\n"
        "catalog.load_config('digits', [])\n"
        "catalog.load_config('imagenet', ['model.arch=resnet18'])\n"
        "build_model(ModelConfig(arch='resnet18', num_classes=3))\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('timm', 'huggingface_hub')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        env=engine_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["model.safetensors", "pytorch_model.bin"])
def test_init_from_reads_timms_files_into_a_timm_model(tmp_path, layout, train_here):
    """timm's weights as its hub repositories ship them (a 1000-class test_convnext), into a
    3-class timm model: the backbone is the file's, exactly the head is re-initialised."""
    import timm
    from safetensors.torch import save_file

    torch.manual_seed(0)
    published = timm.create_model("test_convnext", pretrained=False, num_classes=1000).state_dict()
    path = tmp_path / layout
    if layout.endswith(".safetensors"):
        save_file({k: v.contiguous() for k, v in published.items()}, path)
    else:
        torch.save(published, path)
    write_image_folder(tmp_path / "data", classes=3, train_per_class=4, val_per_class=2)
    train_here(
        tmp_path,
        "ft",
        *IMAGENET,
        "model.arch=timm/test_convnext",
        f"data.root={tmp_path / 'data'}",
        f"model.init_from={path}",
        "optim.lr_mult=[head.fc.*=1,*=0]",
        "train.max_steps=2",
        *sizes(32),
        recipe="imagenet",
    )
    log = (run_dir(tmp_path, "ft", "imagenet") / "train.log").read_text()
    assert "re-initialised 2 (head.fc.weight, head.fc.bias), left unused 0" in log
    trained = final_checkpoint(tmp_path, "ft", "imagenet")["model"]
    params = timm.create_model("test_convnext", num_classes=3).named_parameters()
    body = [name for name, _ in params if not name.startswith("head.fc.")]
    assert body and all(torch.equal(trained[n], published[n]) for n in body)
