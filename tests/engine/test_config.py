import dataclasses
import typing

import pytest
import yaml

from engine import catalog as R
from engine import config as C
from engine.catalog import load_config
from tests.helpers import engine_env, engine_here, run_dir, run_engine


def test_layers_defaults_recipe_then_overrides():
    cfg, _ = load_config("digits", ["optim.lr=0.2", "train.epochs=5", "model.width=8"])
    assert cfg.optim.lr == 0.2 and cfg.train.epochs == 5 and cfg.model.width == 8
    assert cfg.optim.name == "sgd"  # from the recipe's config.yaml
    assert cfg.train.amp == "auto"  # engine default the recipe does not set
    assert isinstance(cfg.optim.lr, float)


def test_override_values_of_keys_without_a_type_are_yaml():
    tree = C.parse_overrides(["a.b=[1, 2]", "a.c=null", "d=off", "e=1e-3", "f="])
    assert tree == {"a": {"b": [1, 2], "c": None}, "d": False, "e": "1e-3", "f": ""}


YAML_SAMPLES = [
    "a: 010\nb: 1e3\nc: 1.0e-3\nd: 2001-12-14\ne: off\nf: ~\ng: [1, {h: .inf}]\ni: 0x1F\n",
    "k: 'x'\nl: \"\\u00e9\"\nm: |\n  two\n  lines\nn: &a [1]\no: *a\np: 1_000\nq: !!str 5\n",
]


def test_libyaml_reads_every_config_file_as_pythons_parser_does():
    """load_yaml goes through libyaml where PyYAML has it; a site image without it falls back
    to Python's parser: both give the same values for every file the recipes ship."""
    assert C.fields.SAFE_LOADER is yaml.CSafeLoader  # the wheels here are built with libyaml
    files = sorted(R.RECIPES_DIR.glob("*/*.y*ml"))
    assert len(files) > 10
    for text in [f.read_text() for f in files] + YAML_SAMPLES:
        assert C.load_yaml(text) == yaml.safe_load(text), text[:200]
    with pytest.raises(yaml.YAMLError, match="special characters are not allowed"):
        C.load_yaml("a: \udcff")  # undecodable bytes of an argument: Python's parser names them


@pytest.mark.parametrize("recipe", R.available())
def test_a_resolved_config_is_written_as_pythons_emitter_writes_it(recipe):
    """C.dump goes through libyaml's emitter where PyYAML has it: the text of every recipe's
    resolved config, with awkward text in its text fields, is the one yaml.safe_dump writes."""
    assert C.fields.SAFE_DUMPER is yaml.CSafeDumper
    for text in ["", "\n", "'", '"', "$(x)", "-1", "1e3", "é", "\u2028", "\x1b[31m", "x" * 300,
                 "a b " * 40, "null", "off", "0123", "2001-12-14", "a: b", "x #y", "&a", "|", "\udcff"]:  # fmt: skip
        cfg, _ = load_config(recipe, [])
        cfg.run.name = cfg.log.project = cfg.note = text
        assert C.dump(cfg) == yaml.safe_dump(cfg.to_dict(), sort_keys=False), text


TEXT_AS_WRITTEN = ["0123", "1e3", "true", "null", "0x1F", "~", "off", "[1, 2]", "a=b", "", "é"]


@pytest.mark.parametrize("text", TEXT_AS_WRITTEN)
def test_text_fields_take_the_override_as_written_not_as_yaml(text):
    cfg, _ = load_config("digits", [f"run.name={text}", f"resume={text}", f"log.project={text}"])
    assert cfg.run.name == cfg.resume == cfg.log.project == text  # YAML: 83, 1000.0, True...


@pytest.mark.parametrize(
    "text, value", [("", None), ("null", None), ("~", None), ("NULL", None), ("0123", "0123")]
)
def test_optional_text_fields_read_yaml_nulls_as_none(text, value):
    cfg, _ = load_config("digits", [f"log.entity={text}", f"slurm.partition={text}"])
    assert cfg.log.entity == cfg.slurm.partition == value  # as `entity:` in a YAML file


def test_literal_fields_take_the_override_as_written():
    cfg, _ = load_config("digits", ["train.amp=off", "device=cpu", "dist.backend=gloo"])
    assert (cfg.train.amp, cfg.device, cfg.dist.backend) == ("off", "cpu", "gloo")
    with pytest.raises(C.ConfigError, match="device: 'null' is not one of auto, cpu, cuda"):
        load_config("digits", ["device=null"])


@pytest.mark.parametrize(
    "override, read",
    [
        ("optim.lr=0.2", lambda c: c.optim.lr == 0.2),
        ("optim.lr=1e-3", lambda c: c.optim.lr == 0.001),  # exponent form without a dot
        ("optim.lr=2", lambda c: c.optim.lr == 2.0 and isinstance(c.optim.lr, float)),
        ("sched.milestones=[1,2]", lambda c: c.sched.milestones == [1, 2]),
        ("train.micro_batch_size=null", lambda c: c.train.micro_batch_size is None),
        ("train.compile=true", lambda c: c.train.compile == "on"),
        ("seed=7", lambda c: c.seed == 7),
        ("train.epochs=010", lambda c: c.train.epochs == 10),  # decimal, not YAML 1.1 octal
        ("train.micro_batch_size=08", lambda c: c.train.micro_batch_size == 8),
        ("deterministic=yes", lambda c: c.deterministic is True),
    ],
)
def test_other_fields_read_the_override_as_yaml(override, read):
    cfg, _ = load_config("digits", [override])
    assert read(cfg)


def test_nested_section_overrides_are_typed_too():
    cfg, _ = load_config("imagenet", ["data.augment.train_size=64", "data.index_cache=0123"])
    assert cfg.data.augment.train_size == 64 and cfg.data.index_cache == "0123"


def test_a_number_where_a_yaml_file_expects_text_is_an_error_not_a_silent_conversion():
    sections = {"model": R.load("digits").model_config, "data": R.load("digits").data_config}
    unquoted = yaml.safe_load("run: {name: 0123}")  # YAML 1.1: the octal int 83
    with pytest.raises(C.ConfigError, match="run.name: expected str, got 83; .* quote the value"):
        C.resolve("digits", unquoted, [], sections)
    quoted = yaml.safe_load("run: {name: '0123'}")
    assert C.resolve("digits", quoted, [], sections).run.name == "0123"


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.lrr=1", "unknown config key 'optim.lrr'; did you mean 'optim.lr'?"),
        ("trian.epochs=2", "unknown config key 'trian'; did you mean 'train'?"),
        ("train.epochs=abc", "train.epochs: expected int, got 'abc'"),
        ("train.epochs=true", "train.epochs: expected int, got True"),
        ("optim.name=adam", "optim.name: 'adam' is not one of sgd, adamw"),
        ("optim.lr=-1", "optim.lr must be > 0"),
        ("foo", "override 'foo' is not key=value"),
        ("optim=3", "optim: expected a mapping"),
    ],
)
def test_bad_overrides_name_the_problem(override, message):
    with pytest.raises(C.ConfigError) as err:
        load_config("digits", [override])
    assert message in str(err.value)


RANGE_ERRORS = [
    ("eval.batch_size=0", "eval.batch_size must be >= 1, got 0"),
    ("train.batch_size=0", "train.batch_size must be >= 1, got 0"),
    ("train.micro_batch_size=0", "train.micro_batch_size must be >= 1, got 0"),
    ("sched.warmup_steps=-1", "sched.warmup_steps must be >= 0, got -1"),
    ("train.grad_clip=-1", "train.grad_clip must be >= 0, got -1.0"),
    ("train.label_smoothing=1", "train.label_smoothing must be in [0, 1), got 1.0"),
    ("optim.lr=0", "optim.lr must be > 0, got 0.0"),
    ("optim.betas=[0.9, 1.0]", "optim.betas[1] must be in [0, 1), got 1.0"),
    ("sched.milestones=[5, -1]", "sched.milestones[1] must be >= 0, got -1"),
    ("sched.gamma=2", "sched.gamma must be in (0, 1], got 2.0"),
    ("ema.decay=1", "ema.decay must be in [0, 1), got 1.0"),
    ("ckpt.keep=0", "ckpt.keep must be >= 1, got 0"),
    ("slurm.mem_gb=0", "slurm.mem_gb must be >= 1, got 0"),
    ("seed=-1", "seed must be in [0, 2**64), got -1"),
    ("optim.lr=nan", "optim.lr must be a finite number, got nan"),
    ("dist.timeout_s=.inf", "dist.timeout_s must be a finite number, got inf"),
    ("model.dropout=1.5", "model.dropout must be in [0, 1), got 1.5"),
    ("model.width=0", "model.width must be >= 1, got 0"),
    ("data.test_fraction=0", "data.test_fraction must be in (0, 1), got 0.0"),
]


@pytest.mark.parametrize("override, message", RANGE_ERRORS)
def test_a_value_out_of_its_declared_range_is_one_line_naming_key_value_and_range(
    override, message
):
    with pytest.raises(C.ConfigError) as err:
        load_config("digits", [override])
    assert str(err.value) == message


@pytest.mark.parametrize(
    "recipe, override, message",
    [
        ("imagenet", "data.augment.eval_size=0", "data.augment.eval_size must be >= 1, got 0"),
        ("imagenet", "data.augment.scale_min=0", "data.augment.scale_min must be in (0, 1]"),
        ("imagenet", "data.synthetic_classes=0", "data.synthetic_classes must be >= 1, got 0"),
        ("cifar10", "model.widths=[8, 0, 8]", "model.widths[1] must be >= 1, got 0"),
        ("cifar10", "data.padding=-1", "data.padding must be >= 0, got -1"),
    ],
)
def test_recipe_sections_check_their_declared_ranges_too(recipe, override, message):
    with pytest.raises(C.ConfigError) as err:
        load_config(recipe, [override])
    assert str(err.value).startswith(message)


@pytest.mark.parametrize("value", [0, "", [], False])
def test_a_section_is_a_mapping_or_empty_never_a_falsy_scalar(value):
    sections = {"model": R.load("digits").model_config, "data": R.load("digits").data_config}
    assert C.resolve("digits", {"optim": None}, [], sections).optim == C.OptimConfig()
    with pytest.raises(C.ConfigError, match="optim: expected a mapping of keys"):
        C.resolve("digits", {"optim": value}, [], sections)


def test_a_yaml_file_value_out_of_range_is_refused_like_an_override():
    sections = {"model": R.load("digits").model_config, "data": R.load("digits").data_config}
    with pytest.raises(C.ConfigError, match="eval.batch_size must be >= 1, got 0"):
        C.resolve("digits", {"eval": {"batch_size": 0}}, [], sections)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.epochs=0", "train.max_steps=0"], "set train.epochs >= 1 or train.max_steps >= 1"),
        (["sched.warmup_steps=5", "sched.warmup_epochs=1"], "in steps or in epochs, not both"),
        (["optim.betas=[0.9]"], "optim.betas needs two values"),
    ],
)
def test_rules_across_fields_stay_in_validate(overrides, message):
    with pytest.raises(C.ConfigError, match=message):
        load_config("digits", overrides)


def every_section() -> dict[str, type]:
    """The engine's sections and every recipe's model and data sections, by dotted prefix."""
    sections = {name: cls for name, cls in C.ENGINE_SECTIONS.items()}
    for recipe in R.available():
        loaded = R.load(recipe)
        sections[f"{recipe}:model"] = loaded.model_config
        sections[f"{recipe}:data"] = loaded.data_config
    return sections


def leaf_fields(prefix: str, cls: type):
    """(dotted key, type, dataclass field) of each field, through nested sections."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from leaf_fields(f"{prefix}.{f.name}", hints[f.name])
        else:
            yield f"{prefix}.{f.name}", hints[f.name], f


def is_numeric(annotation) -> bool:
    """int or float, alone, optional or in a list (bool is not a number here)."""
    members = [m for m in typing.get_args(annotation) or [annotation] if m is not type(None)]
    if typing.get_origin(annotation) is list:
        members = list(typing.get_args(annotation))
    return any(m in (int, float) for m in members)


def test_every_numeric_field_of_every_section_declares_a_range_its_default_meets():
    checked = 0
    for prefix, cls in every_section().items():
        for key, annotation, f in leaf_fields(prefix, cls):
            if not is_numeric(annotation):
                continue
            allowed = f.metadata.get("range")
            assert allowed is not None, f"{key} declares no range: use bounded(...)"
            default = f.default_factory() if callable(f.default_factory) else f.default
            for value in default if isinstance(default, list) else [default]:
                assert value is None or allowed.admits(value), f"{key} default {value}"
            checked += 1
    assert checked > 60  # every section was walked
    assert C.TOP_RANGES.keys() == {k for k, t in C.TOP_TYPES.items() if t is int}


def test_resolved_config_is_itself_a_valid_config():
    cfg, recipe = load_config("digits", ["optim.lr=0.3", "log.wandb=off", "slurm.setup=[a, b]"])
    saved = yaml.safe_load(C.dump(cfg))
    again = C.resolve(
        "digits", saved, [], {"model": recipe.model_config, "data": recipe.data_config}
    )
    assert again.to_dict() == cfg.to_dict()


@pytest.mark.parametrize(
    "args, expected",
    [
        (["digits", "optim.lrr=1"], "did you mean 'optim.lr'"),
        (["digits", "train.batch_size=0"], "train.batch_size must be >= 1"),
        (["digits", "train.batch_size=63", "--spawn", "2"], "does not divide over 2 processes"),
        (["digits", "train.amp=fp16", "device=cpu"], "train.amp=fp16 needs a CUDA device"),
        (["nosuch"], f"unknown recipe 'nosuch'; available: {', '.join(R.available())}"),
        ([], "no recipe given"),
    ],
)
def test_cli_errors_exit_2_with_one_line_and_write_nothing(tmp_path, args, expected):
    out = engine_here(*args, f"run.root={tmp_path}", "log.wandb=off")
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], out.stderr
    assert list(tmp_path.iterdir()) == []  # no run directory, nothing written


def test_half_set_distributed_env_is_an_error(tmp_path):
    out = engine_here("digits", f"run.root={tmp_path}", env=engine_env(RANK="0", WORLD_SIZE="2"))
    assert out.returncode == 2
    assert "LOCAL_RANK, MASTER_ADDR, MASTER_PORT missing" in out.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_resuming_a_run_with_another_model_is_a_one_line_error(tmp_path, train_here):
    train_here(tmp_path, "w8", "model.width=8", "train.max_steps=2")  # tests/engine/conftest.py
    before = sorted(p.name for p in (run_dir(tmp_path, "w8") / "checkpoints").iterdir())
    out = run_engine(tmp_path, "w8", "model.width=16", "train.max_steps=4", check=False)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    # the config drift check names the change before any weights are loaded
    assert len(lines) == 1 and "model.width 8 -> 16" in lines[0], out.stderr
    after = sorted(p.name for p in (run_dir(tmp_path, "w8") / "checkpoints").iterdir())
    assert after == before  # nothing lost or overwritten
