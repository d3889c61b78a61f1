import dataclasses

import pytest
import torch
from torch import nn

from engine import catalog
from engine import checkpoint as ckpt
from engine.catalog import load_config
from engine.checkpoint.state import check_config_drift, config_changes
from engine.config import ConfigError
from engine.tracking import redact
from recipes.digits.model import ModelConfig, build_model
from tests.helpers import PicklePayload


def small_model(seed=0):
    torch.manual_seed(seed)
    return build_model(ModelConfig(width=8))


@pytest.mark.parametrize(
    "prefix", ["module.", "_orig_mod.", "module._orig_mod.", "_orig_mod.module."]
)
def test_prefixed_state_dicts_load_into_the_bare_model(prefix):
    source = small_model(1)
    saved = {prefix + k: v for k, v in source.state_dict().items()}
    target = small_model(2)
    ckpt.load_model_state(target, saved)
    assert all(
        torch.equal(a, b)
        for a, b in zip(target.state_dict().values(), source.state_dict().values(), strict=True)
    )


def test_dataparallel_checkpoint_loads_into_bare_model(tmp_path):
    wrapped = nn.DataParallel(small_model(3))  # writes `module.` keys, like DDP
    assert next(iter(wrapped.state_dict())).startswith("module.")
    torch.save({"model": wrapped.state_dict()}, tmp_path / "dp.pt")
    bare = small_model(4)
    ckpt.load_model_state(bare, ckpt.load(tmp_path / "dp.pt")["model"])
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            bare.state_dict().values(), wrapped.module.state_dict().values(), strict=True
        )
    )


def test_unwrap_finds_the_bare_model():
    bare = small_model()
    assert ckpt.unwrap(nn.DataParallel(bare)) is bare
    compiled = torch.compile(bare)
    assert ckpt.unwrap(compiled) is bare


def test_atomic_save_leaves_old_file_when_writing_fails(tmp_path):
    path = tmp_path / "step-00000001.pt"
    ckpt.atomic_save({"x": torch.ones(2)}, path)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        ckpt.atomic_save({"x": Unpicklable()}, path)
    assert torch.equal(ckpt.load(path)["x"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary left over


def test_latest_valid_skips_a_torn_checkpoint(tmp_path, capsys):
    for step in (10, 20):
        ckpt.atomic_save({"step": step}, ckpt.checkpoint_path(tmp_path, step))
    newest = ckpt.checkpoint_path(tmp_path, 30)
    ckpt.atomic_save({"step": 30, "w": torch.zeros(1000)}, newest)
    newest.write_bytes(newest.read_bytes()[:100])  # torn, as by a crash mid-write elsewhere
    path, state = ckpt.latest_valid(tmp_path)
    assert state["step"] == 20 and path.name == "step-00000020.pt"
    assert "skipping unreadable checkpoint" in capsys.readouterr().err


def test_a_folder_of_torn_checkpoints_says_truncated_not_a_checkpoint(tmp_path, capsys):
    """Every checkpoint cut short (a full disk, a partial copy): one line that says so, not
    the reader's own error (EOFError, IndexError: pop from empty list, zip internals)."""
    for step, keep in ((10, 0), (20, 100), (30, 60_000)):
        path = ckpt.checkpoint_path(tmp_path, step)
        ckpt.atomic_save({"step": step, "w": torch.zeros(40_000)}, path)
        path.write_bytes(path.read_bytes()[:keep])
    with pytest.raises(ConfigError) as err:
        ckpt.latest_valid(tmp_path)
    said = str(err.value)
    assert said.count("truncated: not a checkpoint") == 3 and "\n" not in said, said
    assert "step-00000030.pt: truncated: not a checkpoint (60000 bytes" in said
    assert "IndexError" not in said and "EOFError" not in said and "zip archive" not in said
    assert capsys.readouterr().err.count("truncated: not a checkpoint") == 3


def test_prune_keeps_the_newest(tmp_path):
    for step in (5, 10, 100, 20):
        ckpt.atomic_save({}, ckpt.checkpoint_path(tmp_path, step))
    ckpt.prune(tmp_path, 2, ckpt.checkpoint_path(tmp_path, 100))
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == [
        "step-00000100.pt",
        "step-00000020.pt",
    ]


def test_prune_never_deletes_the_checkpoint_just_written(tmp_path):
    # Newer files a resumed run skipped as unreadable must not push the new one out.
    for step in (30, 40):
        ckpt.checkpoint_path(tmp_path, step).write_bytes(b"torn")
    for step in (10, 20, 25):
        ckpt.atomic_save({}, ckpt.checkpoint_path(tmp_path, step))
    written = ckpt.checkpoint_path(tmp_path, 25)
    ckpt.prune(tmp_path, 2, written)
    names = [p.name for p in ckpt.list_checkpoints(tmp_path)]
    assert names == ["step-00000040.pt", "step-00000030.pt", written.name, "step-00000020.pt"]


def test_no_loadable_checkpoint_is_an_error_naming_each_file(tmp_path):
    marker = tmp_path / "payload-ran"
    torch.save({"model": PicklePayload(marker)}, ckpt.checkpoint_path(tmp_path, 20))
    ckpt.checkpoint_path(tmp_path, 10).write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError) as err:
        ckpt.latest_valid(tmp_path)
    message = str(err.value)
    assert "step-00000020.pt: UnpicklingError" in message and "step-00000010.pt" in message
    assert "another run.name" in message and "\n" not in message
    assert not marker.exists(), "the planted payload ran"


def test_config_changes_refuse_what_alters_the_run_and_allow_the_rest():
    saved = {"seed": 0, "optim": {"lr": 0.1}, "train": {"epochs": 3, "batch_size": 64}}
    saved |= {"log": {"every_steps": 10}, "data": {"augment": {"flip": True}, "root": "a"}}
    current = {"seed": 0, "optim": {"lr": 0.2}, "train": {"epochs": 5, "batch_size": 64}}
    current |= {"log": {"every_steps": 5}, "data": {"augment": {"flip": False}, "root": "b"}}
    current |= {"model": {"width": 8}}  # a field added by a code update: not a change
    refused, allowed = config_changes(saved, current)
    assert refused == ["data.augment.flip True -> False", "optim.lr 0.1 -> 0.2"]
    assert allowed == ["data.root a -> b", "log.every_steps 10 -> 5", "train.epochs 3 -> 5"]


def test_weights_only_refuses_arbitrary_objects(tmp_path):
    torch.save({"obj": ConfigError("x")}, tmp_path / "evil.pt")
    with pytest.raises(Exception, match="Weights only load failed"):
        ckpt.load(tmp_path / "evil.pt")


def test_missing_resume_path_is_a_user_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        ckpt.load(tmp_path / "nope.pt")


def test_a_recipes_resume_safe_keys_may_change_on_resume_and_no_others(tmp_path):
    """check_config_drift allows what Recipe.resume_safe names (cifar10: data.download) and
    still refuses the same change for a recipe that does not name it."""
    cfg, recipe = load_config("digits", [f"run.root={tmp_path}"])
    saved = redact(cfg.to_dict())
    saved["data"]["shift"] = cfg.data.shift + 1
    source = (tmp_path / "step-00000001.pt", {"config": saved})
    with pytest.raises(ConfigError, match=r"another config \(data.shift"):
        check_config_drift(cfg, recipe, source, is_main=True)
    lenient = dataclasses.replace(recipe, resume_safe=("data.shift",))
    check_config_drift(cfg, lenient, source, is_main=True)  # allowed, and said
    assert "data.download" in catalog.load("cifar10").resume_safe
