"""One resolved request: what every target runs, and what it asks the scheduler for, is the
config the engine resolves from the same request, field by field (launch/request.py)."""

import dataclasses
import shlex
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import cli as engine_cli
from engine import config as C
from engine.catalog import load_config
from engine.rundir import decide_run_dir
from launch import cli, render, request, slurm
from launch.errors import UserError
from launch.render import Slurm

# target -> the launch command that renders it (and TARGET where the command takes one)
TARGETS = {
    "local": ("train", "local"),
    "docker": ("docker-train", None),
    "apptainer": ("train", "apptainer"),
    "pyxis": ("train", "pyxis"),
    "sbatch": ("sbatch", None),
    "submit": ("submit", None),
}
SLURM_VARIABLES = {
    "PARTITION": "vp",
    "ACCOUNT": "acc",
    "QOS": "q",
    "TIME_MIN": "45",
    "CPUS_PER_TASK": "4",
    "MEM_GB": "16",
    "CONSTRAINT": "h100",
    "EXCLUDE": "n1",
    "SIGNAL_DELAY_S": "90",
    "MAX_REQUEUES": "5",
}
ARGS = [
    "slurm.partition=ap",
    "slurm.time_min=30",
    "slurm.constraint=a100",
    "slurm.mem_gb=32",
    "slurm.gpus_per_node=2",
    "slurm.nodes=2",
    "device=cpu",
    "device=cuda",
    "train.epochs=2",
    "run.root=elsewhere",
    "run.name=named",
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, str]:
    """Configs saved on a CPU host: one by a run that pinned device=cpu (as launches once
    did), one as a run saves it now; each names its run and a partition."""
    folder = tmp_path_factory.mktemp("saved")
    files = {}
    for name, device in (("pinned", "cpu"), ("asked", "auto")):
        args = ["run.name=old", "slurm.partition=saved", "slurm.time_min=20", f"device={device}"]
        path = folder / f"{name}.yaml"
        path.write_text(C.dump(load_config("digits", args)[0]))
        files[name] = str(path)
    return files


def resolve(target: str, env: dict[str, str]) -> render.LaunchRequest:
    command, target_var = TARGETS[target]
    base = {"DRY_RUN": "1", "ALLOW_CPU": "1", "RDZV_ENDPOINT": "node1:29400"}
    env = {**base, **({"TARGET": target_var} if target_var else {}), **env}
    args = cli.parse_args([command])
    return request.resolve(request.Asked.of(args, env), target=target)


def engine_argv(req: render.LaunchRequest, target: str) -> list[str]:
    """The engine's arguments exactly as the target would start it."""
    if target == "submit":
        job = slurm.engine_job(req)
        return [job.recipe, *job.args]
    if target == "sbatch":
        (line,) = [x for x in render.sbatch_script(req).splitlines() if "engine.train" in x]
        argv = shlex.split(line)
    else:
        argv = render.TARGETS[target](req)
    return argv[argv.index("engine.train") + 1 :]


def engine_config(argv: list[str]) -> C.Config:
    return engine_cli.load(engine_cli.parse_argv(argv))[0]


def expected_slurm(cfg: C.Config) -> dict:
    """What a job of this config asks SLURM for, by render.job_options's names."""
    s = cfg.slurm
    return {
        "time": s.time_min,
        "partition": s.partition,
        "account": s.account,
        "qos": s.qos,
        "constraint": s.constraint,
        "exclude": s.exclude,
        "cpus_per_task": s.cpus_per_task,
        "mem": f"{s.mem_gb}G" if s.mem_gb else None,
        "gpus_per_node": s.gpus_per_node or None,
    }


@settings(max_examples=60, deadline=None)
@given(
    target=st.sampled_from(sorted(TARGETS)),
    config=st.sampled_from(["", "tiny", "pinned", "asked"]),
    gpus=st.sampled_from([None, "0", "1", "4"]),
    nodes=st.sampled_from([None, "1", "2", "2:3"]),
    variables=st.dictionaries(st.sampled_from(sorted(SLURM_VARIABLES)), st.just(""), max_size=4),
    args=st.lists(st.sampled_from(ARGS), unique=True, max_size=4),
)
def test_every_target_runs_and_asks_for_the_resolved_config(
    saved, target, config, gpus, nodes, variables, args
):
    env = {k: SLURM_VARIABLES[k] for k in variables}
    env |= {"GPUS": gpus} if gpus else {}
    env |= {"NODES": nodes} if nodes else {}
    env |= {"CONFIG": saved.get(config, config)} if config else {}
    env["ARGS"] = " ".join(args)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CUDA_VISIBLE_DEVICES", "")  # a login node: no GPU here
        try:
            req = resolve(target, env)
        except UserError as err:  # a request refused before anything renders: one line
            assert "\n" not in str(err)
            return
        cfg = engine_config(engine_argv(req, target))

    # The run: its name and directory, one rule.
    assert cfg.run.name == req.run_name and cfg.run.root == req.run_root
    assert decide_run_dir(cfg.run.root, cfg.recipe, cfg.run.name) == Path(req.run_dir)
    assert cfg.variant == ("tiny" if config == "tiny" else "")
    # The device: pinned to the CPU only when the request asks for CPU processes.
    if gpus == "0":
        assert cfg.device == "cpu"
    elif req.gpus > 0:
        assert cfg.device != "cpu"
    elif target == "local" and gpus is None:
        layered = next(
            (a.partition("=")[2] for a in reversed(args) if a.startswith("device=")), None
        )
        assert cfg.device == (layered or ("cpu" if config == "pinned" else "auto"))
    if target not in request.SLURM_TARGETS:
        return
    # What SLURM is asked for is the saved slurm section, field by field.
    asked = render.job_options(req)
    assert {k: asked.get(k) for k in expected_slurm(cfg)} == expected_slurm(cfg)
    assert asked["nodes"] == (f"{req.nodes}-{req.max_nodes}" if req.elastic else cfg.slurm.nodes)
    assert cfg.slurm.nodes == req.nodes and cfg.slurm.gpus_per_node == req.gpus
    for field in dataclasses.fields(Slurm):
        mine = getattr(req.slurm, field.name)
        assert mine == (tuple(x) if isinstance(x := getattr(cfg.slurm, field.name), list) else x)
    # The precedence: ARGS > variables > config file > recipe (with its variant) > defaults.
    recipe = load_config("digits", [], "tiny" if config == "tiny" else "")[0].slurm
    from_file = config in ("pinned", "asked")
    partition = "ap" if "slurm.partition=ap" in args else None
    partition = partition or ("vp" if "PARTITION" in env else None)
    assert cfg.slurm.partition == (partition or ("saved" if from_file else recipe.partition))
    time_min = 30 if "slurm.time_min=30" in args else 45 if "TIME_MIN" in env else None
    assert cfg.slurm.time_min == (time_min or (20 if from_file else recipe.time_min))


LAYERS = ("file", "variable", "args")  # over the recipe's config.yaml, each over the one before


def layer_value(key: str, layer: str) -> str:
    """A value of `key` that tells the layer it came from."""
    if key in request.SLURM_INTS:
        return str({"file": 7, "variable": 8, "args": 9}[layer])
    return f"{layer}-{key.replace('_', '-')}"


@pytest.mark.slow
@settings(max_examples=80, deadline=None)
@given(
    key=st.sampled_from(sorted(request.SLURM_FLAGS)),
    layers=st.sets(st.sampled_from(LAYERS)),
    target=st.sampled_from(["sbatch", "submit"]),
)
def test_each_slurm_key_takes_the_highest_layer_that_sets_it(tmp_path_factory, key, layers, target):
    """Every key, every combination of the layers that set it: ARGS > the request variable >
    the config file > the recipe. The job's config (what the engine resolves from the
    rendered command) agrees with what the scheduler is asked for."""
    env = {"GPUS": "0", "ALLOW_CPU": "1"}
    if "file" in layers:
        path = tmp_path_factory.getbasetemp() / f"layer-{key}.yaml"
        path.write_text(f"recipe: digits\nslurm:\n  {key}: {layer_value(key, 'file')}\n")
        env["CONFIG"] = str(path)
    if "variable" in layers:
        env[request.SLURM_FLAGS[key][1]] = layer_value(key, "variable")
    if "args" in layers:
        env["ARGS"] = f"slurm.{key}={layer_value(key, 'args')}"
    req = request.resolve(request.Asked.of(cli.parse_args([target]), env), target=target)
    highest = next((layer for layer in reversed(LAYERS) if layer in layers), None)
    recipe = getattr(load_config("digits", [])[0].slurm, key)
    expected = layer_value(key, highest) if highest else str(recipe)
    assert str(getattr(req.slurm, key)) == expected, (key, layers)
    assert str(getattr(engine_config(engine_argv(req, target)).slurm, key)) == expected
