"""engine.weights in one process: every weights format it reads, how tensors are matched to
the model (head re-initialised, skip patterns, strict), the fine-tuning knobs (freeze,
per-pattern learning rates), the named torchvision weights and their preprocessing, and the
one-line refusals. The runs that train from such files are in tests/recipes/test_finetune_runs.py."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
import torchvision
from safetensors.torch import save_file
from torch import nn

from engine import catalog, optim, weights
from engine import checkpoint as ckpt
from engine.config import ConfigError, OptimConfig, WeightsInit
from engine.optim import build_optimizer, lr_factors, param_groups
from engine.vision.images import follow_weights
from engine.weights import files as weight_files
from engine.weights import match, sources


def small(classes: int = 10) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, classes))


def random_state(classes: int, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return small(classes).state_dict()


# ---------------------------------------------------------------- formats


@pytest.fixture
def files(tmp_path: Path) -> dict:
    """The same weights in each format the readers know, plus an EMA that differs."""
    weights, average = random_state(1000, 0), random_state(1000, 1)
    wrapped = {f"module.{k}": v for k, v in weights.items()}
    out = {"weights": weights, "average": average}
    torch.save(weights, tmp_path / "resnet-0123abcd.pth")  # torchvision: a plain state dict
    out["torchvision"] = tmp_path / "resnet-0123abcd.pth"
    timm = {"epoch": 3, "arch": "x", "state_dict": wrapped, "optimizer": {}}
    timm["state_dict_ema"] = {f"module.{k}": v for k, v in average.items()}
    torch.save(timm, tmp_path / "checkpoint-3.pth.tar")  # timm's train.py
    out["timm"] = tmp_path / "checkpoint-3.pth.tar"
    torch.save({f"_orig_mod.{k}": v for k, v in weights.items()}, tmp_path / "pytorch_model.bin")
    out["bin"] = tmp_path / "pytorch_model.bin"
    save_file({k: v.contiguous() for k, v in weights.items()}, tmp_path / "model.safetensors")
    out["safetensors"] = tmp_path / "model.safetensors"
    state = {"model": wrapped, "ema": {"model": average, "n_averaged": torch.tensor(3)}, "step": 7}
    ckpt.atomic_save(state | {"optimizer": {}, "scheduler": {}}, tmp_path / "step-00000007.pt")
    out["checkpoint"] = tmp_path / "step-00000007.pt"
    return out


@pytest.mark.parametrize("kind", ["torchvision", "timm", "bin", "safetensors", "checkpoint"])
def test_every_format_reads_as_the_same_bare_weights(files, kind):
    tensors, _ = weight_files.read(files[kind], ema=False)
    assert tensors.keys() == files["weights"].keys()  # no module. / _orig_mod. left
    assert all(torch.equal(tensors[k], files["weights"][k]) for k in tensors)


@pytest.mark.parametrize("kind", ["timm", "checkpoint"])
def test_init_ema_takes_the_average_where_the_file_holds_one(files, kind):
    tensors, _ = weight_files.read(files[kind], ema=True)
    assert all(torch.equal(tensors[k], files["average"][k]) for k in files["average"])


@pytest.mark.parametrize("kind", ["torchvision", "safetensors"])
def test_init_ema_on_a_file_without_an_average_is_one_line(files, kind):
    with pytest.raises(ConfigError, match="no EMA"):
        weight_files.read(files[kind], ema=True)


def test_a_file_that_is_not_weights_is_one_line(tmp_path):
    (tmp_path / "notes.pt").write_text("not torch")
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(ConfigError, match="not a readable weights file"):
        weight_files.read(tmp_path / "notes.pt", ema=False)
    with pytest.raises(ConfigError, match="holds a list, not a state dict"):
        weight_files.read(tmp_path / "list.pt", ema=False)


def test_a_pickled_object_is_refused_without_running_it(tmp_path):
    from tests.helpers import PicklePayload

    marker = tmp_path / "ran"
    torch.save({"w": PicklePayload(marker)}, tmp_path / "evil.pt")
    with pytest.raises(ConfigError, match="not a readable weights file"):
        weight_files.read(tmp_path / "evil.pt", ema=False)
    assert not marker.exists()


# ---------------------------------------------------------------- matching


def test_a_head_for_another_class_count_is_exactly_what_is_reinitialised(files):
    torch.manual_seed(5)
    model = small(10)
    built_head = model[3].weight.detach().clone()
    found = match.match(model, files["weights"], skip=[], strict=False)
    match.load(model, found)
    assert found.reinitialised == ["3.weight", "3.bias"]
    assert found.unused == []
    assert torch.equal(model[3].weight, built_head)  # the seed's head, not the file's
    assert torch.equal(model[0].weight, files["weights"]["0.weight"])


def test_strict_refuses_the_head_and_unused_tensors(files):
    with pytest.raises(ConfigError, match=r"3.weight \[1000, 4\] in the file, \[10, 4\] here"):
        match.match(small(10), files["weights"], skip=[], strict=True)
    extra = random_state(10, 0) | {"aux.weight": torch.zeros(2)}
    with pytest.raises(ConfigError, match="aux.weight in the file, not in the model"):
        match.match(small(10), extra, skip=[], strict=True)
    found = match.match(small(10), extra, skip=[], strict=False)
    assert found.unused == ["aux.weight"] and not found.reinitialised


def test_any_other_difference_is_one_line_listing_the_first(files):
    other = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Flatten(), nn.Linear(8, 10))
    with pytest.raises(ConfigError) as err:
        match.match(other, files["weights"], skip=[], strict=False)
    text = str(err.value)
    assert "\n" not in text and "0.weight [4, 3, 3, 3] in the file, [8, 3, 3, 3] here" in text
    assert "model.init_skip" in text


def test_skip_patterns_keep_the_seed_and_a_pattern_matching_nothing_is_refused(files):
    model = small(1000)
    found = match.match(model, files["weights"], skip=["0.*"], strict=False)
    assert found.reinitialised == ["0.weight", "0.bias"]
    with pytest.raises(ConfigError, match="'conv9.*' matches no tensor"):
        match.match(model, files["weights"], skip=["conv9.*"], strict=False)


def test_a_missing_tensor_is_a_difference(files):
    partial = {k: v for k, v in files["weights"].items() if k != "1.running_var"}
    with pytest.raises(ConfigError, match="1.running_var missing from the file"):
        match.match(small(1000), partial, skip=[], strict=False)


def test_the_classifier_is_the_last_linear_layer():
    model = torchvision.models.resnet18(num_classes=3)
    assert match.classifier(model) == {"fc.weight", "fc.bias"}
    vit = torchvision.models.vit_b_16(num_classes=3)
    assert match.classifier(vit) == {"heads.head.weight", "heads.head.bias"}


# ---------------------------------------------------------------- freeze and rates


def test_freeze_and_lr_mult_shape_the_optimizer():
    model = small(10)
    optim.freeze_parameters(model, ["0.*"])
    assert [n for n, p in model.named_parameters() if not p.requires_grad] == ["0.weight", "0.bias"]
    cfg = OptimConfig(lr=0.1, weight_decay=0.01, lr_mult=["3.*=1", "*=0.1"])
    groups = param_groups(model, cfg, 0.1)
    by_param = {id(p): g for g in groups for p in g["params"]}
    lrs = {n: by_param[id(p)]["lr"] for n, p in model.named_parameters() if p.requires_grad}
    assert lrs == {"1.weight": 0.1 * 0.1, "1.bias": 0.1 * 0.1, "3.weight": 0.1, "3.bias": 0.1}
    decay = {
        n: by_param[id(p)]["weight_decay"] for n, p in model.named_parameters() if p.requires_grad
    }
    assert decay == {"1.weight": 0.0, "1.bias": 0.0, "3.weight": 0.01, "3.bias": 0.0}


def test_freezing_rates_and_batch_scaling_are_each_said_in_one_line_at_start(capsys):
    model = small(10)
    optim.freeze_parameters(model, ["0.*"])
    cfg = OptimConfig(lr=0.1, lr_reference_batch=256, lr_mult=["3.*=1", "*=0.1"])
    build_optimizer(model, cfg, 512, torch.device("cpu"))
    assert capsys.readouterr().err.splitlines() == [
        "frozen: 1 pattern, 2 of 6 tensors (0.*)",
        "optim.lr 0.1 scaled to 0.2 for batch 512 (lr_reference_batch 256)",
        "lr groups: 3.*=0.2 (2 tensors), *=0.02 (2 tensors)",
    ]
    # tensors no pattern matches keep optim.lr; nothing to say without lr_mult or the scaling
    build_optimizer(small(), OptimConfig(lr=0.1, lr_mult=["3.*=2"]), 512, torch.device("cpu"))
    build_optimizer(small(), OptimConfig(lr=0.1), 512, torch.device("cpu"))
    assert capsys.readouterr().err.splitlines() == [
        "lr groups: 3.*=0.2 (2 tensors), others=0.1 (4 tensors)"
    ]


def test_start_up_notes_are_said_by_rank_0_alone(monkeypatch, capsys):
    monkeypatch.setattr(optim.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(optim.dist, "get_rank", lambda: 1)
    optim.freeze_parameters(small(), ["0.*"])
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("entry", ["3.*", "=0.5", "3.*=-1", "3.*=fast", "3.*=nan"])
def test_a_malformed_lr_mult_entry_is_one_line(entry):
    with pytest.raises(ConfigError, match="not PATTERN=FACTOR"):
        lr_factors(small(), [entry])


def test_freeze_pattern_matching_nothing_is_refused():
    with pytest.raises(ConfigError, match="optim.freeze: 'layer1.*' matches no tensor"):
        optim.freeze_parameters(small(), ["layer1.*"])


# ---------------------------------------------------------------- named weights


def test_named_weights_come_from_the_local_cache_only(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    with pytest.raises(ConfigError) as err:
        sources.published_file("ResNet18_Weights.IMAGENET1K_V1")
    text = str(err.value)
    assert "\n" not in text
    assert str(tmp_path / "hub" / "checkpoints" / "resnet18-f37072fd.pth") in text
    assert "https://download.pytorch.org/models/resnet18-f37072fd.pth" in text
    cached = tmp_path / "hub" / "checkpoints" / "resnet18-f37072fd.pth"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"x")
    assert sources.published_file("ResNet18_Weights.IMAGENET1K_V1") == cached


def test_an_unknown_weights_name_suggests_the_closest():
    with pytest.raises(ConfigError, match="did you mean ResNet18_Weights.IMAGENET1K_V1"):
        sources.published_file("ResNet18_Weights.IMAGENET_V1")


def test_the_weights_preprocessing_is_used_unless_the_config_keeps_its_own():
    def resolved(*args: str):
        cfg, _ = catalog.load_config("imagenet", list(args))
        return cfg, follow_weights(cfg, sources.transforms_of)

    named = ["model.weights=EfficientNet_B0_Weights.IMAGENET1K_V1", "model.arch=efficientnet_b0"]
    cfg, said = resolved(*named)
    aug = cfg.data.augment
    assert (aug.eval_resize, aug.eval_size, aug.interpolation) == (256, 224, "bicubic")
    assert said.startswith("the weights' (EfficientNet_B0_Weights.IMAGENET1K_V1)")
    kept, said = resolved(*named, "data.augment.follow_weights=false")
    aug = kept.data.augment
    assert (aug.eval_resize, aug.eval_size, aug.interpolation) == (256, 224, "bilinear")
    assert "follow_weights=false" in said
    v2, _ = resolved("model.weights=ResNet50_Weights.IMAGENET1K_V2")
    assert (v2.data.augment.eval_resize, v2.data.augment.eval_size) == (232, 224)
    cifar, said = catalog.load_config("cifar10", ["model.weights=ResNet18_Weights.IMAGENET1K_V1"])
    assert follow_weights(cifar, sources.transforms_of).startswith("the recipe's")


def test_the_name_hash_of_a_torchvision_file_is_checked(tmp_path):
    path = tmp_path / "resnet18-f37072fd.pth"
    assert sources.name_hash_warning(path, "f37072fd" + "0" * 56) == ""
    assert "not the published file" in sources.name_hash_warning(path, "ab" * 32)


def test_a_head_of_another_input_width_is_a_difference_not_a_new_head(files):
    wider = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 10))
    state = dict(files["weights"]) | {"3.weight": torch.zeros(1000, 8)}
    with pytest.raises(ConfigError, match=r"3.weight \[1000, 8\] in the file, \[10, 4\] here"):
        match.match(wider, state, skip=[], strict=False)


def test_a_sharded_checkpoint_and_a_run_directory_read_as_their_weights(tmp_path):
    from engine.checkpoint import sharded

    torch.manual_seed(0)
    model = small(10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    folder = tmp_path / "digits" / "run" / "checkpoints"
    sharded.save(ckpt.sharded_path(folder, 8), model, optimizer, {"step": 8})
    for path in (ckpt.sharded_path(folder, 8), folder.parent):
        tensors, kind = weight_files.read(path, ema=False)
        assert kind == "checkpoint"
        assert all(torch.equal(tensors[k], v) for k, v in model.state_dict().items())
        assert tensors.keys() == model.state_dict().keys()
    with pytest.raises(ConfigError, match="holds no EMA"):
        weight_files.read(folder.parent, ema=True)
    with pytest.raises(ConfigError, match="nor a run directory holding one"):
        weight_files.read(tmp_path, ema=False)


# ---------------------------------------------------------------- what the run records


def started_from(path: Path, model: nn.Module) -> dict:
    """start_from's record for a run whose model.init_from is `path` (rank 0)."""
    return weights.start_from(model, WeightsInit(init_from=str(path)), is_main=True)


def test_the_record_names_exactly_the_tensors_not_loaded(tmp_path):
    """A head for another class count: its tensors keep the seed's values and are the ones
    the record lists as re-initialised; every other tensor is loaded and counted."""
    weights = random_state(1000, 0) | {"aux.weight": torch.ones(3)}
    torch.save(weights, tmp_path / "other-head.pth")
    torch.manual_seed(5)
    model = small(10)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rec = started_from(tmp_path / "other-head.pth", model)
    after = model.state_dict()
    from_file = [k for k in after if torch.equal(after[k], weights[k])]
    kept = [k for k in after if k not in from_file]
    assert kept == ["3.weight", "3.bias"]  # the head, and nothing else
    assert all(torch.equal(after[k], before[k]) for k in kept)
    assert rec["reinitialised"] == kept
    assert rec["loaded"] == len(from_file) == len(after) - len(kept)
    assert rec["unused"] == ["aux.weight"]


def test_the_record_holds_the_sha256_of_the_files_bytes(tmp_path):
    """Of the whole file (several MiB: read in chunks), not of its name or its first chunk."""
    weights = random_state(10, 1) | {"aux.weight": torch.randn(3 << 18)}  # 3 MiB of floats
    path = tmp_path / "weights.pt"
    torch.save(weights, path)
    rec = started_from(path, small(10))
    assert rec["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert (rec["file"], rec["name"], rec["format"]) == (str(path), "weights.pt", "state dict")
    assert rec["reinitialised"] == [] and rec["loaded"] == len(small(10).state_dict())
