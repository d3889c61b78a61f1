"""`python -m launch COMMAND`: resolve a request, render its command, print it or run it.

Every value comes from a flag, else from the environment variable the Makefile exports, else
from the recipe's config.yaml (`slurm:` and `run.root`), else from a default. Bad input ends in
one line on stderr that names the problem and the fix, and exit code 2.

Environment (all optional):
  RECIPE (digits)  CONFIG (a variant of the recipe, e.g. v2: recipes/<recipe>/v2.yaml)  GPUS (1 if a GPU is visible, else 0)  NODES (1)  PROCS (1)  ARGS
  IMAGE (recipes:<git short sha>)  SIF (recipes.sif)  DRY_RUN (1: print, don't run)  SEEDS (3)
  TARGET (local; train: local|docker|pyxis|apptainer, sweep: local|submit)
  RDZV_ENDPOINT (HOST:PORT of the first node; required when NODES > 1 outside SLURM)
  MAX_RESTARTS (0; torchrun restarts the workers this often after a failure, resuming from
  the last checkpoint: local, docker and apptainer targets, not SLURM, which requeues)
  RECIPES_DATA (data root on the host, ./data; /data inside containers)
  PARTITION ACCOUNT QOS TIME_MIN CPUS_PER_TASK MEM_GB CONSTRAINT EXCLUDE SIGNAL_DELAY_S
  MAX_REQUEUES (SLURM options; over the recipe's `slurm:` section)
  RECIPES_DIR (where recipes are looked up; default <repo>/recipes)
  RUNS (report: the run directories, space-separated, when none are given as arguments)
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import NoReturn

import yaml

from engine.config import ConfigError, SlurmConfig, build_section, description, merge
from launch import render
from launch.errors import UserError
from launch.render import Request, Slurm

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = (
    "train",
    "dry-run",
    "submit",
    "sweep",
    "docker-train",
    "image",
    "sif",
    "render",
    "recipes",
    "report",
)
RUN_TARGETS = ("local", "docker", "pyxis", "apptainer")
RENDER_TARGETS = (*RUN_TARGETS, "sbatch", "image", "sif")
OVERRIDE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*=")
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
RECIPE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")  # a folder name, never a path
ENDPOINT = re.compile(r"[^\s:]+:[0-9]{1,5}")
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


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        if "required: command" in message:
            message = f"no command given; one of: {', '.join(COMMANDS)}"
        raise UserError(f"{message} (see: python -m launch --help)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m launch",
        description="Render the command for a training request and print it or run it.",
        epilog="Overrides go last, after --: python -m launch train --gpus 0 -- optim.lr=0.2. "
        "report RUN_DIR...: a chart and a Markdown summary of the runs, written in their common "
        "parent folder as report-<run names>.png and .md (env RUNS when no RUN_DIR is given).",
    )
    p.add_argument("command", choices=COMMANDS)
    p.add_argument("--recipe", help="recipe name (env RECIPE, default digits)")
    p.add_argument("--config", help="the recipe's variant, e.g. v2 (env CONFIG; `recipes` lists)")
    p.add_argument("--gpus", help="GPUs per node, 0 = CPU (env GPUS, default: auto)")
    p.add_argument("--nodes", help="nodes (env NODES, default 1)")
    p.add_argument("--procs", help="processes per node when GPUS=0 (env PROCS, default 1)")
    p.add_argument("--image", help="container image (env IMAGE)")
    p.add_argument("--sif", help="apptainer image file (env SIF, default recipes.sif)")
    p.add_argument("--rdzv-endpoint", help="HOST:PORT of the first node (env RDZV_ENDPOINT)")
    p.add_argument("--max-restarts", help="torchrun restarts after a failure (env MAX_RESTARTS)")
    p.add_argument(
        "--target", help=f"train: {'|'.join(RUN_TARGETS)}; render: also sbatch|image|sif"
    )
    p.add_argument("--dry-run", action="store_true", help="print the command (env DRY_RUN=1)")
    p.add_argument("--seeds", help="sweep: number of seeds 0..N-1 (env SEEDS, default 3)")
    p.add_argument("--slurm", action="store_true", help="sweep: submit a SLURM job array")
    p.add_argument("--no-wait", action="store_true", help="sweep --slurm: submit and return")
    p.add_argument("--report", metavar="BASE", help="sweep: only (re)write BASE's report")
    for name, (flag, env) in SLURM_FLAGS.items():
        p.add_argument(flag, dest=name, help=f"SLURM (env {env})")
    p.add_argument(
        "overrides", nargs="*", help="config overrides key=value (after ARGS); report: run dirs"
    )
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Everything after the first `--` is an override, whatever it looks like."""
    before, after = argv, []
    if "--" in argv:
        cut = argv.index("--")
        before, after = argv[:cut], argv[cut + 1 :]
    args = build_parser().parse_intermixed_args(before)
    args.overrides = [*args.overrides, *after]
    return args


# ---------------------------------------------------------------- resolving a request


def _pick(value: str | None, flag: str, env: Mapping[str, str], name: str):
    """(label, text) of the first one set: the flag, else the environment variable."""
    if value is not None:
        return flag, value
    if env.get(name, "") != "":
        return name, env[name]
    return None


def _whole(label: str, text: str, minimum: int, fix: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise UserError(f"{label}={text!r} is not a whole number >= {minimum}; {fix}")
    return value


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


def check_gpus_visible(label: str, gpus: int, dry: bool) -> None:
    """More GPUs than are visible would quietly train that many CPU processes (the engine's
    device=auto falls back to the CPU); a dry run may be meant for another machine: a warning."""
    visible = visible_gpu_count()
    if gpus <= visible:
        return
    fewer = f"GPUS={visible} or fewer, or " if visible else ""
    problem = f"{label}={gpus} but {visible} CUDA device(s) are visible here"
    fix = f"set {fewer}GPUS=0 for CPU processes (PROCS=N for N of them)"
    if not dry:
        raise UserError(f"{problem}; {fix}")
    print(f"launch: warning: {problem}; to run it here, {fix}", file=sys.stderr)


def recipes_dir(env: Mapping[str, str]) -> Path:
    return Path(env.get("RECIPES_DIR") or ROOT / "recipes")


def available_recipes(env: Mapping[str, str]) -> list[str]:
    folder = recipes_dir(env)
    if not folder.is_dir():
        return []
    return sorted(p.parent.name for p in folder.glob("*/config.yaml"))


def recipe_variants(recipe: str, env: Mapping[str, str]) -> list[str]:
    folder = recipes_dir(env) / recipe
    return sorted(p.stem for p in folder.glob("*.yaml") if p.stem != "config")


def load_recipe_config(recipe: str, env: Mapping[str, str], variant: str = "") -> dict:
    """config.yaml with the variant's file layered on it, as the engine layers them."""
    path = recipes_dir(env) / recipe / "config.yaml"
    if not RECIPE_NAME.fullmatch(recipe) or not path.is_file():
        names = ", ".join(available_recipes(env)) or "none"
        raise UserError(f"unknown recipe {recipe!r}; available: {names} (set RECIPE=NAME)")
    config = _read_config(path)
    if not variant:
        return config
    known = recipe_variants(recipe, env)
    if variant not in known:
        have = ", ".join(known) or "none (only config.yaml)"
        raise UserError(f"recipe {recipe!r} has no variant {variant!r}; available: {have}")
    return merge(config, _read_config(path.with_name(f"{variant}.yaml")))


def _read_config(path: Path) -> dict:
    try:
        config = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        line = f" line {where.line + 1}" if where else ""
        raise UserError(f"{path}:{line} is not valid YAML; fix the file") from None
    if not isinstance(config, dict):
        raise UserError(f"{path} must be a mapping of sections; fix the file")
    return config


def parse_overrides(args_text: str, extra: list[str]) -> tuple[str, ...]:
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


def new_run_name(recipe: str, variant: str = "") -> str:
    """A new name per launch: time stamp, recipe (and variant), and a random suffix (two
    launches in the same second never share a run directory)."""
    what = f"{recipe}-{variant}" if variant else recipe
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{what}-{secrets.token_hex(2)}"


def resolve_slurm(args: argparse.Namespace, env: Mapping[str, str], config: dict) -> Slurm:
    section = config.get("slurm") or {}
    try:  # the same schema and messages as the engine, which validates the section too
        build_section("slurm", SlurmConfig, section)
    except ConfigError as err:
        raise UserError(f"recipe config.yaml: {err}") from None
    values = {k: v for k, v in section.items() if v is not None}
    labels = {k: f"slurm.{k}" for k in values}
    for name, (flag, var) in SLURM_FLAGS.items():
        picked = _pick(getattr(args, name), flag, env, var)
        if picked:
            labels[name], values[name] = picked
    for name in SLURM_INTS:
        if name in values:
            minimum = 0 if name == "signal_delay_s" else 1
            values[name] = _whole(labels[name], str(values[name]), minimum, "fix that value")
    setup = values.get("setup", ())
    if isinstance(setup, str) or not all(isinstance(x, str) for x in setup):
        raise UserError("slurm.setup must be a list of shell lines; fix config.yaml")
    values["setup"] = tuple(setup)
    for name, value in values.items():
        if isinstance(value, str) and ("\n" in value or "\r" in value):
            raise UserError(f"{labels[name]} cannot contain a line break; give one line")
    return Slurm(**values)


def git_short_sha(src: Path) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(src), "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def default_image(src: Path) -> str:
    """recipes:<git short sha> names the source an image was built from; recipes:dev when
    there is no git history."""
    sha = git_short_sha(src)
    return f"recipes:{sha}" if sha else "recipes:dev"


def recipe_name(args: argparse.Namespace, env: Mapping[str, str]) -> str:
    label, recipe = _pick(args.recipe, "--recipe", env, "RECIPE") or ("RECIPE", "digits")
    if not RECIPE_NAME.fullmatch(recipe):
        names = ", ".join(available_recipes(env)) or "none"
        raise UserError(
            f"{label}={recipe!r} is not a recipe name (letters, digits, '_', '.', '-'; "
            f"no path); use one of: {names}"
        )
    return recipe


def max_restarts(args: argparse.Namespace, env: Mapping[str, str], target: str) -> int:
    picked = _pick(args.max_restarts, "--max-restarts", env, "MAX_RESTARTS")
    if not picked:
        return 0
    restarts = _whole(*picked, 0, "use MAX_RESTARTS=N to restart failed workers N times, or 0")
    if restarts and target in ("pyxis", "sbatch", "submit"):
        raise UserError(
            f"{picked[0]}={restarts} restarts torchrun's workers, but SLURM starts this run "
            "without torchrun; leave it 0 (SLURM requeues a preempted job: MAX_REQUEUES)"
        )
    return restarts


def resolve(args: argparse.Namespace, env: Mapping[str, str], *, target: str) -> Request:
    recipe = recipe_name(args, env)
    variant = args.config or env.get("CONFIG") or ""
    config = load_recipe_config(recipe, env, variant)
    overrides = parse_overrides(env.get("ARGS", ""), args.overrides)

    picked = _pick(args.gpus, "--gpus", env, "GPUS")
    fix = "use GPUS=0 for CPU or GPUS=N for N GPUs per node"
    gpus = _whole(*picked, 0, fix) if picked else int(visible_gpu_count() > 0)
    nodes = _whole(
        *(_pick(args.nodes, "--nodes", env, "NODES") or ("NODES", "1")),
        1,
        "use NODES=1 for one machine",
    )
    procs = _whole(
        *(_pick(args.procs, "--procs", env, "PROCS") or ("PROCS", "1")),
        1,
        "use PROCS=N for N CPU processes",
    )
    if procs > 1 and gpus > 0:
        raise UserError(
            f"PROCS={procs} is for CPU runs, but GPUS={gpus}: GPU runs start one process per "
            f"GPU, so use GPUS=N alone, or GPUS=0 PROCS={procs} for CPU processes"
        )

    name = override_value(overrides, "run.name")
    if name is not None and not RUN_NAME.fullmatch(name):
        raise UserError(f"run.name={name!r}: use letters, digits, '.', '_' and '-' only")
    rdzv = _pick(args.rdzv_endpoint, "--rdzv-endpoint", env, "RDZV_ENDPOINT")
    if rdzv and not ENDPOINT.fullmatch(rdzv[1]):
        raise UserError(f"{rdzv[0]}={rdzv[1]!r} is not HOST:PORT; e.g. RDZV_ENDPOINT=node1:29500")
    if nodes > 1 and target in ("local", "docker", "apptainer"):
        # The same command runs on every node: they must agree on the rendezvous and the run.
        if not rdzv or name is None:
            raise UserError(
                f"NODES={nodes} runs this command on each node; set RDZV_ENDPOINT=HOST:PORT "
                "(the first node) and one run name for all, ARGS='run.name=NAME'"
            )

    restarts = max_restarts(args, env, target)
    run_root = override_value(overrides, "run.root") or (config.get("run") or {}).get("root")
    image = args.image or env.get("IMAGE") or ""
    if not image and target in ("docker", "pyxis", "image", "sif"):
        image = default_image(ROOT)
    slurm = resolve_slurm(args, env, config)
    if picked and target == "local":  # last: a warning never precedes an error
        check_gpus_visible(picked[0], gpus, args.command == "render" or is_dry(args, env))
    return Request(
        recipe=recipe,
        run_name=name or new_run_name(recipe, variant),
        variant=variant,
        gpus=gpus,
        nodes=nodes,
        procs=procs,
        overrides=overrides,
        python=sys.executable,
        image=image or "recipes:dev",
        sif=args.sif or env.get("SIF") or "recipes.sif",
        rdzv_endpoint=rdzv[1] if rdzv else None,
        max_restarts=restarts,
        src=str(ROOT),
        data=env.get("RECIPES_DATA") or "data",
        run_root=str(run_root or "runs"),
        uid_gid=f"{os.getuid()}:{os.getgid()}",
        slurm=slurm,
    )


# ---------------------------------------------------------------- printing and running


def is_dry(args: argparse.Namespace, env: Mapping[str, str]) -> bool:
    flag = env.get("DRY_RUN", "").strip().lower() in ("1", "true", "yes", "on")
    return bool(args.dry_run or flag or args.command == "dry-run")


def find_program(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise UserError(
            f"{name} is not on PATH; install it, or print the command with DRY_RUN=1 (make dry-run)"
        )
    return path


def execute(argv: list[str]) -> NoReturn:
    """Replace this process with argv: signals reach the command directly and its exit code
    is ours. The line printed first is the exact command."""
    program = find_program(argv[0])
    print(f"+ {render.shell_join(argv)}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os.chdir(ROOT)
    os.execv(program, argv)


def lock_sha256(src: Path) -> str:
    path = src / "requirements.lock"
    if not path.is_file():
        raise UserError(f"{path} is missing; the image is built from the lock (make lock)")
    return hashlib.sha256(path.read_bytes()).hexdigest()


def image_argv(req: Request) -> list[str]:
    sha = git_short_sha(ROOT)
    full = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    if sha is None or full.returncode != 0:
        raise UserError("the image records the git commit, but this is not a git checkout")
    return render.image_build(req, full.stdout.strip(), lock_sha256(ROOT))


def render_target(req: Request, target: str) -> list[str] | str:
    if target == "sbatch":
        return render.sbatch_script(req)
    if target == "image":
        return image_argv(req)
    return render.TARGETS[target](req)


def pick_target(args: argparse.Namespace, env: Mapping[str, str]) -> tuple[str, str]:
    return _pick(args.target, "--target", env, "TARGET") or ("TARGET", "local")


def cmd_run(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    target = {"docker-train": "docker", "image": "image", "sif": "sif"}.get(args.command)
    if target is None:
        label, target = pick_target(args, env)
        allowed = RENDER_TARGETS if args.command == "render" else RUN_TARGETS
        if target not in allowed:
            raise UserError(f"{label}={target!r} is not one of {', '.join(allowed)}")
    req = resolve(args, env, target=target)
    try:
        out = render_target(req, target)
    except ValueError as e:
        raise UserError(str(e)) from None
    if isinstance(out, str):
        print(out, end="")
        return 0
    if args.command == "render" or is_dry(args, env):
        print(render.shell_join(out))
        return 0
    execute(out)


def cmd_submit(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    req = resolve(args, env, target="submit")
    if is_dry(args, env):
        print(render.sbatch_script(req), end="")
        return 0
    from launch import slurm

    return slurm.submit(req)


def cmd_sweep(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    from launch import sweep

    return sweep.main(args, env)


def cmd_report(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    from launch import report

    return report.main(args, env, dry=is_dry(args, env))


def cmd_recipes(env: Mapping[str, str]) -> int:
    """Each recipe with its configs and what they train, ready to copy as RECIPE/CONFIG."""
    names = available_recipes(env)
    if not names:
        raise UserError(f"no recipes under {recipes_dir(env)}")
    for recipe in names:
        folder = recipes_dir(env) / recipe
        print(f"{recipe:<10} {'':<8} {description(folder / 'config.yaml')}")
        for variant in recipe_variants(recipe, env):
            print(f"{'':<10} {variant:<8} {description(folder / f'{variant}.yaml')}")
    print("\nUse: make train RECIPE=NAME [CONFIG=VARIANT], or python -m launch train --recipe NAME")
    return 0


def printable(text: str) -> str:
    """Control characters escaped as repr writes them: a value with a line break or a terminal
    escape sequence cannot split a message or hide part of it."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def main(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    if hasattr(sys.stdout, "reconfigure"):  # argv bytes that are not UTF-8 print as they came
        sys.stdout.reconfigure(errors="surrogateescape")
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        if args.command == "submit":
            return cmd_submit(args, env)
        if args.command == "sweep":
            return cmd_sweep(args, env)
        if args.command == "recipes":
            return cmd_recipes(env)
        if args.command == "report":
            return cmd_report(args, env)
        return cmd_run(args, env)
    except UserError as e:
        print(f"launch: {printable(str(e))}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        return 130
