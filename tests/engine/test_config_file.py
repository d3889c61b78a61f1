"""A config given by path (`--config runs/digits/b/config.yaml`), `--print-config` and
`--check N`: the config a run would use, resolved and checked without writing anything."""

import re
import subprocess

import pytest
import yaml

from engine import catalog, cli
from engine import config as C
from engine.catalog import load_config
from tests import helpers
from tests.helpers import REPO, engine_env, engine_here, run_dir


def clean_env(**extra: str) -> dict[str, str]:
    """engine_env without W&B's variables, which would layer over the configs."""
    env = {k: v for k, v in engine_env(**extra).items() if not k.startswith("WANDB_")}
    return env | {k: v for k, v in extra.items() if k.startswith("WANDB_")}


def engine_process(*args: str, env=None) -> subprocess.CompletedProcess:
    """`python -m engine.train ARGS` in a process of its own (a run that trains)."""
    return helpers.engine_process(*args, env=env or clean_env())


def engine(*args: str, cwd=REPO, env=None) -> subprocess.CompletedProcess:
    return engine_here(*args, cwd=cwd, env=env or clean_env())


def one_error_line(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 2, out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("error: ")
    return line


def files_under(folder) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------- config files


def test_a_saved_config_resolves_to_the_config_it_was_saved_from(tmp_path):
    cfg, _ = load_config("imagenet", ["optim.lr=0.3", "run.name=b"], "v2")
    saved = tmp_path / "b" / "config.yaml"
    saved.parent.mkdir()
    saved.write_text(C.dump(cfg))
    assert yaml.safe_load(saved.read_text())["recipe"] == "imagenet"
    again, _ = load_config("imagenet", [], str(saved))
    assert again.variant == "v2"  # recorded in the file, and kept
    assert again.to_dict() == cfg.to_dict()


def test_a_partial_config_file_layers_on_the_variant_it_names(tmp_path):
    partial = tmp_path / "mine.yaml"
    partial.write_text("variant: v2\noptim:\n  lr: 0.7\n")
    cfg, _ = load_config("imagenet", ["train.epochs=3"], str(partial))
    by_name, _ = load_config("imagenet", ["optim.lr=0.7", "train.epochs=3"], "v2")
    assert cfg.to_dict() == by_name.to_dict()
    variant, layered = catalog.layered_yaml("imagenet", str(partial))  # launch's view
    assert (variant, layered["optim"]["lr"]) == ("v2", 0.7)


@pytest.mark.parametrize(
    ("config", "is_file"),
    [("v2", False), ("runs/digits/b/config.yaml", True), ("mine.yml", True), ("./v2", True)],
)
def test_a_config_with_a_slash_or_a_yaml_suffix_is_a_file_else_a_variant(config, is_file):
    assert catalog.is_config_file(config) == is_file


def test_a_recorded_recipe_must_be_the_recipe_run(tmp_path):
    cfg, recipe = load_config("digits", [])
    saved = yaml.safe_load(C.dump(cfg))
    sections = {"model": recipe.model_config, "data": recipe.data_config}
    with pytest.raises(
        C.ConfigError, match="recipe='digits' in the config, but the recipe run is 'gpt'"
    ):
        C.resolve("gpt", saved, [], sections)
    path = tmp_path / "digits.yaml"
    path.write_text(C.dump(cfg))
    with pytest.raises(C.ConfigError, match=f"{path} is a config of recipe 'digits', not of 'gpt'"):
        load_config("gpt", [], str(path))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "config file {path} not found"),
        ("optim: [", "{path}: not valid YAML"),
        ("- a list", "{path}: the top level must be a mapping of sections"),
        ("recipe: 5", "{path}: recipe must be a recipe's name, got 5"),
    ],
)
def test_a_bad_config_file_is_a_one_line_error(tmp_path, content, message):
    path = tmp_path / "bad.yaml"
    if content is not None:
        path.write_text(content)
    line = one_error_line(engine("--config", str(path), "--check", "1"))
    assert line.startswith(f"error: {message.format(path=path)}"), line


def test_a_config_file_of_another_recipe_is_refused_naming_both(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("recipe: digits\n")
    line = one_error_line(engine("gpt", "--config", str(path), "--check", "1"))
    assert line == f"error: {path} is a config of recipe 'digits', not of 'gpt'"


@pytest.mark.slow
def test_rerunning_a_saved_config_by_path_starts_a_new_run_with_the_same_config(
    tmp_path, train_here
):
    train_here(tmp_path, "b", "train.max_steps=2", "optim.lr=0.05")  # tests/engine/conftest.py
    first = run_dir(tmp_path, "b")
    before = files_under(first)
    saved = first / "config.yaml"
    assert yaml.safe_load(saved.read_text())["recipe"] == "digits"

    out = engine_process("--config", str(saved))  # no recipe, no overrides
    assert out.returncode == 0, out.stderr
    note = f"note: {saved} is the config of run 'b'; this starts a new run (add run.name=b"
    assert note in out.stderr
    (second,) = [p for p in (tmp_path / "digits").iterdir() if p.name != "b"]
    assert files_under(first) == before  # the first run is untouched
    old, new = (yaml.safe_load((d / "config.yaml").read_text()) for d in (first, second))
    assert new["run"].pop("name") == second.name != old["run"].pop("name")
    assert new == old


# ---------------------------------------------------------------- --print-config


def test_print_config_prints_what_the_run_would_save_and_writes_nothing(tmp_path):
    overrides = ["optim.lr=0.2", f"run.root={tmp_path / 'runs'}", "run.name=x"]
    out = engine("imagenet", "--config", "v2", *overrides, "--print-config", cwd=tmp_path)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    expected, _ = load_config("imagenet", overrides, "v2")
    assert out.stdout == C.dump(expected)
    assert list(tmp_path.iterdir()) == []


def test_print_config_with_a_bad_override_is_the_usual_one_line_error(tmp_path):
    line = one_error_line(engine("digits", "optim.lrr=1", "--print-config", cwd=tmp_path))
    assert "did you mean 'optim.lr'" in line
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- --check N


def test_check_passes_a_config_that_suits_the_world_size_and_writes_nothing(tmp_path):
    # log.wandb stays auto: deciding W&B's mode must not create a W&B folder either
    out = engine(
        "digits", f"run.root={tmp_path / 'runs'}", "run.name=a", "--check", "2", cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == "config ok for 2 processes\n"
    assert list(tmp_path.iterdir()) == []


def test_check_refuses_a_batch_that_does_not_divide_over_the_processes(tmp_path):
    out = engine("digits", "log.wandb=off", "--check", "3", cwd=tmp_path)
    assert "train.batch_size=64 does not divide over 3 processes" in one_error_line(out)
    assert list(tmp_path.iterdir()) == []


def test_check_refuses_a_fresh_start_over_a_run_and_leaves_it_as_it_was(tmp_path):
    held = tmp_path / "digits" / "a"
    held.mkdir(parents=True)
    (held / "metrics.jsonl").write_text('{"step": 1}\n')
    args = ["digits", f"run.root={tmp_path}", "run.name=a", "log.wandb=off", "--check", "1"]
    assert "already holds a run" in one_error_line(engine(*args, "resume=none"))
    assert engine(*args).returncode == 0  # resume=auto continues it
    assert files_under(tmp_path) == {str(held / "metrics.jsonl"): b'{"step": 1}\n'}
    assert [p.name for p in held.iterdir()] == ["metrics.jsonl"]


def test_check_leaves_a_data_root_that_exists_only_on_the_compute_nodes(tmp_path):
    missing = tmp_path / "only-on-the-nodes" / "imagenet"
    out = engine("imagenet", f"data.root={missing}", "log.wandb=off", "--check", "8")
    assert out.returncode == 0, out.stderr
    assert not missing.parent.exists()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (["x"], "--check needs a process count, got 'x'"),
        (["2,x"], "--check needs a process count, got 'x'"),
        (["0"], "--check needs a process count, got '0'"),
        ([], "--check needs a value"),
    ],
)
def test_check_needs_process_counts(value, message):
    with pytest.raises(C.ConfigError, match=re.escape(message)):
        cli.parse_argv(["digits", "--check", *value])


def test_check_takes_every_world_size_of_an_elastic_range():
    assert cli.parse_argv(["digits", "--check", "2,4,6"]).check == (2, 4, 6)
    assert cli.parse_argv(["digits", "--check", "3"]).check == (3,)


def test_check_runs_preflight_with_the_given_world_size_not_the_environment(tmp_path):
    env = clean_env(RANK="0", WORLD_SIZE="2")  # half set: a run would refuse it
    out = engine("digits", "log.wandb=off", "--check", "4", env=env)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize(
    ("args", "world", "message"),
    [
        (
            ["dist.strategy=fsdp", "dist.replicate=3"],
            "4",
            "dist.replicate=3 does not divide the 4 processes of this run; use a divisor of 4 "
            "(1, 2, 4)",
        ),
        (["dist.replicate=2"], "4", "dist.replicate=2 is hybrid sharding, which needs "),
        (["ckpt.async_save=true"], "2", "ckpt.async_save writes sharded checkpoints in the "),
        # an elastic range: every world size it may take
        (["dist.strategy=fsdp", "dist.replicate=2", "train.micro_batch_size=4"], "1,2,4", "the 1 "),
    ],
)
def test_check_refuses_a_sharding_layout_the_world_size_cannot_take(capsys, args, world, message):
    """Said in one line, exit 2, by the check every launch runs before anything starts."""
    assert cli.main(["gpt", "device=cpu", "log.wandb=off", *args, "--check", world]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: ") and message in line, line


def test_check_passes_hybrid_sharding_with_async_saves(capsys):
    args = ["dist.strategy=fsdp", "dist.replicate=2", "ckpt.async_save=true", "--check", "4"]
    assert cli.main(["gpt", "device=cpu", "log.wandb=off", *args]) == 0
    assert capsys.readouterr().out == "config ok for 4 processes\n"


# ---------------------------------------------------------------- --resolved


@pytest.mark.parametrize("recipe", catalog.available())  # config.yaml and every variant
def test_a_resolved_config_read_alone_is_the_config_it_was_resolved_to(tmp_path, recipe):
    """--resolved reads a launch's frozen config with no layer under it: every key is in the
    file, so nothing falls back to the engine's defaults where the recipe set another."""
    for variant in ["", *catalog.variants(recipe)]:
        cfg, _ = load_config(recipe, ["optim.lr=0.3", "run.name=b", "seed=7"], variant)
        frozen = tmp_path / f"{variant or 'base'}.yaml"
        frozen.write_text(cli.resolved_text(cfg))
        read, _ = catalog.read_resolved(recipe, str(frozen))
        assert read.to_dict() == cfg.to_dict(), (recipe, variant)


def test_a_resolved_config_takes_no_other_layer_and_names_its_recipe(tmp_path):
    frozen = tmp_path / "frozen.yaml"
    frozen.write_text(cli.resolved_text(load_config("digits", ["run.name=b"])[0]))
    for extra in (["optim.lr=0.1"], ["--config", "v2"]):
        done = engine("digits", "--resolved", str(frozen), *extra, "--print-config")
        assert done.returncode == 2 and done.stdout == ""
        assert done.stderr.startswith(f"error: --resolved {frozen} is a whole config: give it")
    with pytest.raises(C.ConfigError, match="is a config of recipe 'digits', not of 'cifar10'"):
        catalog.read_resolved("cifar10", str(frozen))
