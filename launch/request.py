"""From what a command asked (its flags and the environment, read once into an Asked at the
command line's edge) and the recipe's config to one render.LaunchRequest.

The config is the engine's: launch never reads a recipe's YAML itself. A request's variables
that are config keys (SLURM's PARTITION, TIME_MIN, ...; GPUS and NODES for a SLURM job) become
overrides placed before ARGS, and the engine's own layering resolves them
(catalog.requested_sections): ARGS > variables (or their flags) > config file or variant >
recipe config.yaml > defaults. The same overrides go into the rendered command, so the run's
saved config.yaml records what the scheduler was asked for. A bad value is one UserError
naming it and the fix. train, submit, sweep and report resolve their requests here.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from engine import catalog, codeid
from engine.config import ConfigError
from engine.rundir import decide_run_name
from launch import container
from launch.errors import UserError
from launch.render import LaunchRequest, Slurm

ROOT = Path(__file__).resolve().parents[1]
OVERRIDE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*=")
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
RECIPE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")  # a folder name, never a path
ENDPOINT = re.compile(r"[^\s:]+:[0-9]{1,5}")
NCCL_SETTING = re.compile(r"NCCL_[A-Z0-9_]+")  # passed into containers by name
SLURM_INTS = ("time_min", "cpus_per_task", "mem_gb", "signal_delay_s", "max_requeues")
SLURM_FLAGS = {  # field: (flag, environment variable)
    "partition": ("--partition", "PARTITION"),
    "account": ("--account", "ACCOUNT"),
    "qos": ("--qos", "QOS"),
    "time_min": ("--time-min", "TIME_MIN"),
    "cpus_per_task": ("--cpus-per-task", "CPUS_PER_TASK"),
    "mem_gb": ("--mem-gb", "MEM_GB"),
    "constraint": ("--constraint", "CONSTRAINT"),
    "exclude": ("--exclude", "EXCLUDE"),
    "signal_delay_s": ("--signal-delay-s", "SIGNAL_DELAY_S"),
    "max_requeues": ("--max-requeues", "MAX_REQUEUES"),
}
# Targets that start the same command on every node by hand (SLURM starts its own tasks).
PER_NODE_TARGETS = ("local", "docker", "apptainer")
# Targets under SLURM, which starts the ranks without torchrun.
SLURM_TARGETS = ("pyxis", "sbatch", "submit")
# torchrun's restart budget for an elastic range run by hand (MAX_RESTARTS unset): each node
# lost costs one restart.
ELASTIC_RESTARTS = 3
# The recipe's `slurm:` keys that become the request's GPUS and NODES, not sbatch options.
RESOURCES = ("gpus_per_node", "nodes")


# (the name a setting was given under, --gpus or GPUS, for messages; its text)
Given = tuple[str, str]


@dataclasses.dataclass(frozen=True)
class Asked:
    """What one command asked for, read once from the command line and the environment
    (Asked.of, at the edge): each setting a flag or a Make variable may give, the flag first,
    as a Given or None; ARGS and the command line's overrides; and the environment itself for
    what launch passes on by name (NCCL_*, DOCKER, RECIPES_DIR, ...). Resolution reads this,
    never argparse's namespace."""

    command: str
    recipe: Given | None
    config: str  # CONFIG: a variant or a config file, "" for none
    args_text: str  # ARGS, split by split_args
    extra: tuple[str, ...]  # the command line's key=value, after ARGS
    gpus: Given | None
    nodes: Given | None
    procs: Given | None
    rdzv_endpoint: Given | None
    max_restarts: Given | None
    slurm: tuple[tuple[str, Given], ...]  # (slurm field, what gave it): SLURM_FLAGS
    target: Given | None
    image: str
    sif: str
    dry_run: bool
    allow_cpu: bool
    env: Mapping[str, str]

    @classmethod
    def of(cls, args: argparse.Namespace, env: Mapping[str, str]) -> Asked:
        slurm = ((n, pick(getattr(args, n), f, env, v)) for n, (f, v) in SLURM_FLAGS.items())
        return cls(
            command=args.command,
            recipe=pick(args.recipe, "--recipe", env, "RECIPE"),
            config=args.config or env.get("CONFIG") or "",
            args_text=env.get("ARGS", ""),
            extra=tuple(args.overrides),
            gpus=pick(args.gpus, "--gpus", env, "GPUS"),
            nodes=pick(args.nodes, "--nodes", env, "NODES"),
            procs=pick(args.procs, "--procs", env, "PROCS"),
            rdzv_endpoint=pick(args.rdzv_endpoint, "--rdzv-endpoint", env, "RDZV_ENDPOINT"),
            max_restarts=pick(args.max_restarts, "--max-restarts", env, "MAX_RESTARTS"),
            slurm=tuple((name, given) for name, given in slurm if given),
            target=pick(args.target, "--target", env, "TARGET"),
            image=args.image or env.get("IMAGE") or "",
            sif=args.sif or env.get("SIF") or "",
            dry_run=bool(args.dry_run or is_set(env, "DRY_RUN") or args.command == "dry-run"),
            allow_cpu=bool(args.allow_cpu or is_set(env, "ALLOW_CPU")),
            env=env,
        )

    def target_or_local(self) -> Given:
        return self.target or ("TARGET", "local")


# ---------------------------------------------------------------- single values


def pick(value: str | None, flag: str, env: Mapping[str, str], name: str):
    """(label, text) of the first one set: the flag, else the environment variable."""
    if value is not None:
        return flag, value
    if env.get(name, "") != "":
        return name, env[name]
    return None


def whole(label: str, text: str, minimum: int, fix: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise UserError(f"{label}={text!r} is not a whole number >= {minimum}; {fix}")
    return value


def is_set(env: Mapping[str, str], name: str) -> bool:
    """A yes/no variable (DRY_RUN=1, ALLOW_CPU=true) says yes."""
    return env.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def is_dry(args: argparse.Namespace, env: Mapping[str, str]) -> bool:
    """DRY_RUN for the commands that resolve no request (report, compare, publish, ...)."""
    return bool(args.dry_run or is_set(env, "DRY_RUN") or args.command == "dry-run")


# ---------------------------------------------------------------- this machine


def installed_gpu_count() -> int:
    """GPUs on this machine, without importing torch: nvidia-smi's list, else the device
    files (a container may have the files without nvidia-smi)."""
    try:
        probe = subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=20)
        if probe.returncode == 0:
            return sum(line.startswith(b"GPU ") for line in probe.stdout.splitlines())
    except (OSError, subprocess.SubprocessError):
        pass
    return sum(bool(re.fullmatch(r"nvidia[0-9]+", p.name)) for p in Path("/dev").glob("nvidia*"))


def visible_gpu_count() -> int:
    """CUDA devices a process started from here sees: CUDA_VISIBLE_DEVICES narrows the
    installed ones, and CUDA ignores everything from its first empty or -1 entry on."""
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    if mask is None:
        return installed_gpu_count()
    entries = [e.strip() for e in mask.split(",")]
    listed = next((i for i, e in enumerate(entries) if e in ("", "-1")), len(entries))
    return min(listed, installed_gpu_count()) if listed else 0


def check_gpus_visible(label: str, gpus: int, dry: bool) -> tuple[str, ...]:
    """More GPUs than are visible would quietly train that many CPU processes (the engine's
    device=auto falls back to the CPU); a dry run may be meant for another machine: a warning,
    returned to be said once the request has passed its checks (never before an error)."""
    visible = visible_gpu_count()
    if gpus <= visible:
        return ()
    fewer = f"GPUS={visible} or fewer, or " if visible else ""
    problem = f"{label}={gpus} but {visible} CUDA device(s) are visible here"
    fix = f"set {fewer}GPUS=0 for CPU processes (PROCS=N for N of them)"
    if not dry:
        raise UserError(f"{problem}; {fix}")
    return (f"launch: warning: {problem}; to run it here, {fix}",)


def git(src: Path, *words: str) -> str | None:
    """`git WORDS`'s output in src, or None where git or the history is missing."""
    return codeid.git_text(src, *words)


def git_short_sha(src: Path) -> str | None:
    return git(src, "rev-parse", "--short=12", "HEAD")


def default_image(src: Path) -> str:
    """recipes:<git short sha> names the source an image was built from; recipes:dev when
    there is no git history."""
    sha = git_short_sha(src)
    return f"recipes:{sha}" if sha else "recipes:dev"


# ---------------------------------------------------------------- the recipe


def recipes_dir(env: Mapping[str, str]) -> Path:
    return Path(env.get("RECIPES_DIR") or catalog.RECIPES_DIR)


def recipe_names(env: Mapping[str, str]) -> list[str]:
    """The recipes: folders of RECIPES_DIR holding a config.yaml."""
    return catalog.available(recipes_dir(env))


def _names(env: Mapping[str, str]) -> str:
    return ", ".join(recipe_names(env)) or "none"


def recipe_name(asked: Asked, config: str) -> str:
    """RECIPE, else the recipe a config file records (CONFIG=runs/digits/b/config.yaml),
    else digits."""
    env = asked.env
    recorded = config_file_recipe(config) if catalog.is_config_file(config) else ""
    picked = asked.recipe
    if picked and recorded and picked[1] != recorded:
        raise UserError(
            f"CONFIG={config} is a config of recipe {recorded!r}, but {picked[0]}={picked[1]!r}; "
            "leave the recipe unset to run the file's"
        )
    label, recipe = picked or ("CONFIG", recorded or "digits")
    if not RECIPE_NAME.fullmatch(recipe):
        raise UserError(
            f"{label}={recipe!r} is not a recipe name (letters, digits, '_', '.', '-'; "
            f"no path); use one of: {_names(env)}"
        )
    return recipe


def recipe_variants(recipe: str, env: Mapping[str, str]) -> list[str]:
    """The recipe's configs besides config.yaml (CONFIG=NAME)."""
    try:
        return catalog.variants(recipe, recipes_dir(env))
    except ConfigError as err:
        raise UserError(f"{err} (set RECIPE=NAME)") from None


def config_file_recipe(path: str) -> str:
    try:
        return catalog.file_recipe(path)
    except ConfigError as err:
        raise UserError(f"CONFIG={path}: {err}") from None


def config_argument(config: str) -> str:
    """A config file as the engine is given it: relative to the checkout where it lies
    inside (as a container, which mounts the checkout, sees it too), else absolute."""
    if not catalog.is_config_file(config):
        return config
    path = Path(config).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def requested_sections(
    recipe: str, variant: str, overrides: tuple[str, ...], env: Mapping[str, str]
) -> tuple[str, dict]:
    """(the variant, the engine's sections as the engine resolves them for this request):
    what launch renders the run directory and the scheduler's request from."""
    folder = recipes_dir(env)
    try:
        catalog.config_path(recipe, folder)
    except ConfigError:
        raise UserError(
            f"unknown recipe {recipe!r}; available: {_names(env)} (set RECIPE=NAME)"
        ) from None
    if variant and not catalog.is_config_file(variant):
        try:
            catalog.variant_path(recipe, variant, folder)
        except ConfigError as err:
            raise UserError(str(err)) from None
    try:
        return catalog.requested_sections(recipe, variant, overrides, folder)
    except ConfigError as err:  # a file that is not YAML, or a bad run.* or slurm.* value
        raise UserError(f"{err}; fix the value or the file") from None


# ---------------------------------------------------------------- overrides and counts


def split_args(args_text: str, extra: list[str]) -> tuple[str, ...]:
    try:
        words = shlex.split(args_text)
    except ValueError as e:
        raise UserError(f"ARGS cannot be split into words ({e}); check its quotes") from None
    overrides = (*words, *extra)
    for o in overrides:
        if not OVERRIDE.match(o):
            raise UserError(
                f"override {o!r} is not key=value; write e.g. ARGS='optim.lr=0.2 train.epochs=5'"
            )
    return overrides


def override_value(overrides: tuple[str, ...], key: str) -> str | None:
    values = [o.partition("=")[2] for o in overrides if o.partition("=")[0] == key]
    return values[-1] if values else None


def run_name(overrides: tuple[str, ...]) -> str | None:
    """run.name from the overrides, if given: a folder name."""
    name = override_value(overrides, "run.name")
    if name is not None and not RUN_NAME.fullmatch(name):
        raise UserError(f"run.name={name!r}: use letters, digits, '.', '_' and '-' only")
    return name


def gpu_count(asked: Asked, declared: int | None):
    """(GPUS's (label, text) if given, GPUs per node): GPUS, else the recipe's declared
    GPUs for a SLURM job, else 1 if this machine shows a GPU (a local run)."""
    picked = asked.gpus
    if picked:
        return picked, whole(*picked, 0, "use GPUS=0 for CPU or GPUS=N for N GPUs per node")
    return None, declared if declared is not None else int(visible_gpu_count() > 0)


def process_counts(asked: Asked, declared: tuple[int, int] | None = None):
    """(GPUS's (label, text) if given, GPUs per node, (nodes, max_nodes), CPU processes per
    node).
    `declared`: the recipe's (gpus_per_node, nodes) for a SLURM job, None for a local run."""
    picked, gpus = gpu_count(asked, declared[0] if declared else None)
    given = asked.nodes
    nodes = node_range(*given) if given else (declared[1] if declared else 1, 0)
    procs = asked.procs or ("PROCS", "1")
    procs = whole(*procs, 1, "use PROCS=N for N CPU processes")
    if procs > 1 and gpus > 0:
        raise UserError(
            f"PROCS={procs} is for CPU runs, but GPUS={gpus}: GPU runs start one process per "
            f"GPU, so use GPUS=N alone, or GPUS=0 PROCS={procs} for CPU processes"
        )
    return picked, gpus, nodes, procs


def node_range(label: str, text: str) -> tuple[int, int]:
    """(nodes, max_nodes): NODES=N is (N, 0); an elastic range NODES=MIN:MAX is (MIN, MAX)."""
    if ":" not in text:
        return whole(label, text, 1, "use NODES=1 for one machine"), 0
    low, _, high = text.partition(":")
    if not (low.isdigit() and high.isdigit() and 1 <= int(low) < int(high)):
        raise UserError(
            f"{label}={text!r} is not a node range; an elastic range is NODES=MIN:MAX with "
            "1 <= MIN < MAX, e.g. NODES=2:4"
        )
    return int(low), int(high)


def gpus_source(recipe: str, variant: str, user: tuple[str, ...], env: Mapping[str, str]) -> str:
    """Who set slurm.gpus_per_node, for a message: ARGS, the config file, the variant, else
    the recipe's config.yaml."""
    if override_value(user, "slurm.gpus_per_node") is not None:
        return "ARGS sets"
    if not variant:
        return f"recipe {recipe} declares"
    if catalog.is_config_file(variant):
        layer, who = catalog.read_config_file(variant), f"CONFIG={variant} sets"
    else:
        layer = catalog.read_yaml(catalog.variant_path(recipe, variant, recipes_dir(env)))
        who = f"variant {variant} of recipe {recipe} sets"
    slurm = layer.get("slurm")
    return (
        who if isinstance(slurm, dict) and "gpus_per_node" in slurm else f"recipe {recipe} declares"
    )


def check_cpu_job(
    asked: Asked,
    recipe: str,
    declared: int,
    gpus: int,
    variant: str = "",
    user: tuple[str, ...] = (),
) -> None:
    """A recipe that needs GPUs, submitted with GPUS=0, would queue a CPU job that runs for
    days: only on an explicit yes. The message names who set the GPUs (gpus_source)."""
    if declared and not gpus and not asked.allow_cpu:
        raise UserError(
            f"{gpus_source(recipe, variant, user, asked.env)} slurm.gpus_per_node={declared}, but "
            "GPUS=0 asks SLURM for CPU tasks; leave GPUS unset for "
            f"{declared} GPU(s) per node, or set ALLOW_CPU=1 (--allow-cpu) to submit it on CPU "
            "anyway"
        )


def rendezvous(asked: Asked, nodes: str, name: str | None, target: str) -> str | None:
    """HOST:PORT of the first node, required where the same command runs on every node."""
    rdzv = asked.rdzv_endpoint
    if rdzv and not ENDPOINT.fullmatch(rdzv[1]):
        raise UserError(f"{rdzv[0]}={rdzv[1]!r} is not HOST:PORT; e.g. RDZV_ENDPOINT=node1:29500")
    # The same command runs on every node: they must agree on the rendezvous and the run.
    if nodes != "1" and target in PER_NODE_TARGETS and (not rdzv or name is None):
        raise UserError(
            f"NODES={nodes} runs this command on each node; set RDZV_ENDPOINT=HOST:PORT "
            "(the first node) and one run name for all, ARGS='run.name=NAME'"
        )
    return rdzv[1] if rdzv else None


def max_restarts(asked: Asked, target: str, elastic: str | None = None) -> int:
    """torchrun's restart budget; an elastic range (`elastic`: its NODES text) run by hand
    needs one, for each node lost restarts the workers (a node joining does not count)."""
    picked = asked.max_restarts
    per_node = elastic and target in PER_NODE_TARGETS
    if not picked:
        return ELASTIC_RESTARTS if per_node else 0
    restarts = whole(*picked, 0, "use MAX_RESTARTS=N to restart failed workers N times, or 0")
    if per_node and not restarts:
        raise UserError(
            f"NODES={elastic} restarts the workers when a node is lost, but {picked[0]}=0 "
            f"allows no restart; leave it unset ({ELASTIC_RESTARTS}) or give N >= 1"
        )
    if restarts and target in SLURM_TARGETS:
        raise UserError(
            f"{picked[0]}={restarts} restarts torchrun's workers, but SLURM starts this run "
            "without torchrun; leave it 0 (SLURM requeues a preempted job: MAX_REQUEUES)"
        )
    return restarts


def variable_overrides(asked: Asked) -> tuple[str, ...]:
    """The SLURM variables (or their flags) as the config keys they set, e.g. TIME_MIN=30 as
    slurm.time_min=30: placed before ARGS, over the config file and the recipe."""
    keys = []
    for name, (label, text) in asked.slurm:
        if name in SLURM_INTS:
            minimum = 0 if name == "signal_delay_s" else 1
            text = str(whole(label, text, minimum, "fix that value"))
        if "\n" in text or "\r" in text:
            raise UserError(f"{label} cannot contain a line break; give one line")
        keys.append(f"slurm.{name}={text}")
    return tuple(keys)


def slurm_options(section) -> Slurm:
    """The scheduler's options from the resolved slurm section (GPUs and nodes are the
    request's own fields)."""
    values = {f.name: getattr(section, f.name) for f in dataclasses.fields(Slurm)}
    values["setup"] = tuple(section.setup)
    for name, value in values.items():
        if isinstance(value, str) and ("\n" in value or "\r" in value):
            raise UserError(f"slurm.{name} cannot contain a line break; give one line")
    return Slurm(**values)


def request_warnings(asked: Asked, target: str, picked, gpus: int, slurm) -> tuple[str, ...]:
    """What is said about a request that is still run: GPUs asked but not visible here, a
    checkpoint warning as long as the job."""
    if picked and target == "local":
        return check_gpus_visible(picked[0], gpus, asked.command == "render" or asked.dry_run)
    return signal_lead_note(slurm) if target in SLURM_TARGETS else ()


def signal_lead_note(slurm) -> tuple[str, ...]:
    """SLURM's warning comes slurm.signal_delay_s before the time limit: with a lead as long
    as the job, it comes at once (or never), and the job is killed at its limit unwarned."""
    if not slurm.time_min or slurm.signal_delay_s < slurm.time_min * 60:
        return ()
    return (
        f"launch: warning: SIGNAL_DELAY_S={slurm.signal_delay_s} is not shorter than "
        f"TIME_MIN={slurm.time_min} ({slurm.time_min * 60} s): the checkpoint warning would come "
        "as the job starts; lower SIGNAL_DELAY_S or raise TIME_MIN",
    )


def agreed(label: str, given: int, key: str, user: tuple[str, ...]) -> None:
    """GPUS or NODES and the same key in ARGS must not ask for two different things."""
    said = override_value(user, key)
    if said is not None and said.strip() != str(given):
        raise UserError(
            f"{label}={given} but ARGS sets {key}={said}; give one of them (they ask SLURM "
            "for the same thing)"
        )


def resources(asked: Asked, gpus: int, nodes: tuple[int, int], sections, user):
    """Overrides that make the saved slurm section say what the job asks for, where GPUS or
    NODES differ from what the layers give."""
    picked = asked.gpus
    out = []
    slurm = sections["slurm"]
    if picked:
        agreed(picked[0], gpus, "slurm.gpus_per_node", user)
        if gpus != slurm.gpus_per_node:
            out.append(f"slurm.gpus_per_node={gpus}")
    given = asked.nodes
    if given and not nodes[1]:
        agreed(given[0], nodes[0], "slurm.nodes", user)
    if given and nodes[0] != slurm.nodes:
        out.append(f"slurm.nodes={nodes[0]}")  # a range: its fewest
    return tuple(out)


def asked_device(
    picked, gpus: int, cpu_asked: bool, gpus_asked: bool, device: str, user: tuple[str, ...]
) -> str:
    """The device the request asks for, when it asks: CPU processes (GPUS=0, or a SLURM job
    of a recipe declaring no GPUs) run with device=cpu; GPUs asked for (GPUS=N, or a SLURM
    job's GPUs) run with device=cuda, so a task that sees no GPU stops in one line instead of
    training on the CPU. "" when this machine alone decided (no GPUS given for a local run):
    the config keeps device=auto, and env.json records the device."""
    said = override_value(user, "device")
    if gpus and said == "cpu":
        raise UserError(f"GPUS={gpus} but ARGS sets device=cpu; use GPUS=0 for CPU processes")
    if cpu_asked and picked and said == "cuda":
        raise UserError("GPUS=0 asks for CPU processes but ARGS sets device=cuda; give GPUS=N")
    if said is not None:
        return ""
    if cpu_asked:
        return "cpu" if device != "cpu" else ""
    if gpus and (gpus_asked or (picked and device == "cpu")) and device != "cuda":
        return "cuda"
    return ""


# ---------------------------------------------------------------- the request


def container_image(asked: Asked, target: str) -> str:
    """IMAGE, else recipes:<git short sha> where a container runs or is built."""
    image = asked.image
    if not image and target in ("docker", "pyxis", "image", "sif"):
        image = default_image(ROOT)
    return image or "recipes:dev"


def check_node_range(node_text: str, target: str) -> None:
    if ":" in node_text and target == "pyxis":
        raise UserError(
            f"NODES={node_text}: a node range needs a batch job, which SLURM can requeue onto "
            "the nodes it has; use TARGET=submit (or make sbatch), or a fixed NODES=N"
        )


def resolve(asked: Asked, *, target: str) -> LaunchRequest:
    variant = config_argument(asked.config)
    recipe = recipe_name(asked, variant)
    user = split_args(asked.args_text, list(asked.extra))
    slurm_job = target in SLURM_TARGETS
    # A saved config (make config) records the scheduler's request as a submission would.
    records_request = slurm_job or target == "config"
    keys = variable_overrides(asked)  # checked on every target, used by SLURM's
    keys = keys if records_request else ()
    _, sections = requested_sections(recipe, variant, (*keys, *user), asked.env)
    slurm = sections["slurm"]
    declared = (slurm.gpus_per_node, slurm.nodes) if records_request else None
    picked, gpus, (nodes, most), procs = process_counts(asked, declared)
    if slurm_job:
        check_cpu_job(asked, recipe, declared[0], gpus, variant, user)
    if declared:
        keys += resources(asked, gpus, (nodes, most), sections, user)
    cpu_asked = gpus == 0 and (picked is not None or slurm_job)
    gpus_asked = slurm_job or picked is not None
    device = asked_device(picked, gpus, cpu_asked, gpus_asked, sections["device"], user)
    overrides = (*keys, *user)
    recorded_variant, sections = requested_sections(recipe, variant, overrides, asked.env)
    name = run_name(user)
    node_text = f"{nodes}:{most}" if most else str(nodes)
    check_node_range(node_text, target)
    rdzv = rendezvous(asked, node_text, name, target)
    restarts = max_restarts(asked, target, node_text if most else None)
    image = container_image(asked, target)
    warnings = request_warnings(asked, target, picked, gpus, slurm)
    docker = container.docker_settings(asked.env, target)
    return LaunchRequest(
        recipe=recipe,
        device=device,
        run_name=decide_run_name(name or "", recipe, recorded_variant),
        variant=variant,
        gpus=gpus,
        nodes=nodes,
        max_nodes=most,
        procs=procs,
        overrides=overrides,
        python=sys.executable,
        image=image,
        sif=asked.sif or "recipes.sif",
        rdzv_endpoint=rdzv,
        max_restarts=restarts,
        src=str(ROOT),
        data=asked.env.get("RECIPES_DATA") or "data",
        run_root=sections["run"].root,
        uid_gid=f"{os.getuid()}:{os.getgid()}",
        passthrough_env=tuple(sorted(k for k in asked.env if NCCL_SETTING.fullmatch(k))),
        infiniband=Path("/dev/infiniband").exists(),
        docker=docker,
        slurm=slurm_options(sections["slurm"]),
        warnings=(*warnings, *container.build_note(docker, asked.env)),
    )
