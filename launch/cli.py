"""`python -m launch COMMAND`: parse the command, resolve its request (launch.request), render
its command, print it or run it.

Every value comes from a flag, else from the environment variable the Makefile exports, else
from the recipe's config.yaml (`slurm:` and `run.root`), else from a default. Bad input ends in
one line on stderr that names the problem and the fix, and exit code 2.

The environment variables it reads (the Makefile exports them) are listed once, with their
meanings and defaults, in launch/variables.py: `python -m launch --help` ends with them.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import hashlib
import os
import shutil
import sys
import textwrap
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NoReturn

from engine.config import description
from engine.rundir import run_config_of
from launch import check, logs, remote, render, request, snapshot, variables, watch
from launch.analysis import compare, publish, report, reproduce, sweep
from launch.errors import UserError, printable
from launch.render import LaunchRequest
from launch.request import ROOT, SLURM_FLAGS

# A command's handler: (its parsed arguments, the environment, argv as given) -> exit code.
Handler = Callable[[argparse.Namespace, Mapping[str, str], list[str]], int]
RUN_TARGETS = ("local", "docker", "pyxis", "apptainer")
RENDER_TARGETS = (*RUN_TARGETS, "sbatch", "image", "sif")
# The engine checks their config first, dry runs and printed batch scripts included, for
# every world size the run may take; only one local process that really starts skips it: it
# makes the same checks itself first (one line, nothing written). `render` alone is the pure
# renderer, unchecked: it writes nothing (no snapshot of the code, no frozen config).
CHECKED_TARGETS = (*RUN_TARGETS, "sbatch")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        if "required: command" in message:
            message = f"no command given; one of: {', '.join(COMMANDS)}"
        raise UserError(f"{message} (see: python -m launch --help)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m launch",
        formatter_class=argparse.RawDescriptionHelpFormatter,  # the variables' list as written
        description="Render the command for a training request and print it or run it.",
        epilog=textwrap.fill(
            "Overrides go last, after --: python -m launch train --gpus 0 -- optim.lr=0.2. "
            "report RUN_DIR...: a chart and a Markdown summary of the runs, written in their common "
            "parent folder as report-<run names>.png and .md (env RUNS when no RUN_DIR is given). "
            "sweep: every combination of comma-separated override values x SEEDS, e.g. "
            "sweep --seeds 3 -- optim.lr=0.05,0.1 run.name=lr; compare RUN_DIR...: runs grouped by "
            "what differs, each group against the first by Welch's t-test. reproduce (env RECIPE): "
            "rerun the results recipes/<recipe>/results.yaml records and check them, bit for bit "
            "on the recorded hardware, else by Welch's t-test. status (env RUNS, "
            "RECIPE): each run's state, job, step, evaluation and last log line; logs (env RUN, "
            "FOLLOW=1): its last log lines; cancel (env RUN): stop it with a checkpoint. "
            "publish RUN_DIR... (env RUNS, TO=tensorboard[:DIR]|mlflow[:URI]): every scalar at its "
            "step, the config, summary and charts, to TensorBoard or MLflow; again: nothing added.",
            92,
        )
        + "\n\nEnvironment (make's variables; flags above override them):\n"
        + variables.help_text(),
    )
    p.add_argument("command", choices=COMMANDS)
    p.add_argument("--recipe", help="recipe name (env RECIPE, default digits)")
    p.add_argument("--config", help="the recipe's variant, e.g. v2 (env CONFIG; `recipes` lists)")
    p.add_argument("--gpus", help="GPUs per node, 0 = CPU (env GPUS, default: auto)")
    p.add_argument("--nodes", help="nodes, or MIN:MAX for an elastic range (env NODES, default 1)")
    p.add_argument("--procs", help="processes per node when GPUS=0 (env PROCS, default 1)")
    p.add_argument("--image", help="container image (env IMAGE)")
    p.add_argument("--sif", help="apptainer image file (env SIF, default recipes.sif)")
    p.add_argument("--rdzv-endpoint", help="HOST:PORT of the first node (env RDZV_ENDPOINT)")
    p.add_argument("--max-restarts", help="torchrun restarts after a failure (env MAX_RESTARTS)")
    p.add_argument(
        "--target", help=f"train: {'|'.join(RUN_TARGETS)}; render: also sbatch|image|sif"
    )
    p.add_argument("--dry-run", action="store_true", help="print the command (env DRY_RUN=1)")
    p.add_argument(
        "--allow-cpu",
        action="store_true",
        help="submit with GPUS=0 a recipe that declares GPUs (env ALLOW_CPU=1)",
    )
    p.add_argument("--seeds", help="sweep: number of seeds 0..N-1 (env SEEDS, default 3)")
    p.add_argument(
        "--sweep", metavar="FILE", help="sweep: a sweep file, grid: zip: ... (env SWEEP)"
    )
    p.add_argument(
        "--baseline", help="sweep, compare: the baseline cell, 'key=value ...' (env BASELINE)"
    )
    p.add_argument("--parallel", help="sweep --slurm: at most N array tasks at once (env PARALLEL)")
    p.add_argument("--slurm", action="store_true", help="sweep: submit a SLURM job array")
    p.add_argument("--no-wait", action="store_true", help="sweep --slurm: submit and return")
    p.add_argument("--report", metavar="NAME", help="sweep: only (re)write sweep NAME's report")
    p.add_argument("--to", help="publish: tensorboard[:DIR] or mlflow[:URI] (env TO)")
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


# ---------------------------------------------------------------- printing and running


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


def image_argv(req: LaunchRequest) -> list[str]:
    full = request.git(ROOT, "rev-parse", "HEAD")
    if not full:
        raise UserError("the image records the git commit, but this is not a git checkout")
    return render.image_build(req, full, lock_sha256(ROOT))


def render_target(req: LaunchRequest, target: str) -> list[str] | str:
    if target == "sbatch":
        return render.sbatch_script(req)
    if target == "image":
        return image_argv(req)
    return render.TARGETS[target](req)


def rendered(req: LaunchRequest, target: str) -> list[str] | str:
    try:
        return render_target(req, target)
    except ValueError as e:
        raise UserError(str(e)) from None


def command_target(asked: request.Asked) -> str:
    """Where the command runs: its own target (make docker-train, eval, ...), else TARGET."""
    fixed = {"docker-train": "docker", "image": "image", "sif": "sif", "sbatch": "sbatch"}
    fixed["eval"] = "local"  # scores here, on this machine's processes
    target = fixed.get(asked.command)
    if target is None:
        label, target = asked.target_or_local()
        allowed = RENDER_TARGETS if asked.command == "render" else RUN_TARGETS
        if target not in allowed:
            raise UserError(f"{label}={target!r} is not one of {', '.join(allowed)}")
    return target


def cmd_run(args: argparse.Namespace, env: Mapping[str, str], argv: list[str]) -> int:
    asked = request.Asked.of(args, env)
    target = command_target(asked)
    req = run_request(asked, target)
    out = rendered(req, target)
    dry = asked.dry_run
    starts_alone = target == "local" and render.is_one_process(req) and not dry
    queued = bool(req.code)  # sbatch, pyxis: the code and config are frozen
    frozen = queued or freezes(req, target, asked.command)
    config = ""
    if target in CHECKED_TARGETS and asked.command != "render" and not starts_alone:
        # A dry run or a batch script may be meant for another machine: its data too.
        config = check.engine_check(req, data_here=target == "local" and not dry, resolved=frozen)
        if frozen:
            req = snapshot.freeze(req, config)
            out = rendered(req, target)
    for line in req.warnings:  # after every check: a warning never precedes an error
        print(line, file=sys.stderr)
    if queued and not dry:
        snapshot.take(req)
    if frozen and not dry:
        snapshot.write_frozen(req, config)
    if isinstance(out, str):
        print(out, end="")
        return 0
    if asked.command == "render" or dry:
        if frozen:  # the file is written when it runs; what it will hold, said apart
            print(f"launch: note: {render.resolved_from(req)}", file=sys.stderr)
        print(render.shell_join(out))
        return 0
    if target == "image":  # argv[0] is `env`: the docker client must be found first
        find_program(req.docker.client)
    execute(out)


def freezes(req: LaunchRequest, target: str, command: str) -> bool:
    """A training launch of several processes (or one under torchrun) resolves its request
    once, in launch's check, and every process reads that file (launch.snapshot.freeze); one
    plain process resolves it itself. make eval claims no run directory to freeze into."""
    runs_here = target in ("local", "docker", "apptainer") and command not in ("render", "eval")
    return runs_here and not render.is_one_process(req)


def run_request(asked: request.Asked, target: str) -> LaunchRequest:
    """The request a run target renders: make eval's with the run's config and its flags, a
    batch script's and pyxis's srun's with the snapshot of the code they run when SLURM
    starts them."""
    if asked.command == "eval":
        asked = with_run_config(asked)
    req = request.resolve(asked, target=target)
    if asked.command == "eval":
        req = dataclasses.replace(req, engine_flags=eval_flags(asked.env))
    # May wait for SLURM: runs a snapshot of the code and a frozen config (`render` alone,
    # the pure renderer, shows the command from the checkout and writes nothing).
    queued = target in ("sbatch", "pyxis") and asked.command != "render"
    return snapshot.attach(req) if queued else req


def with_run_config(asked: request.Asked) -> request.Asked:
    """make eval CKPT=<a run, or a checkpoint of one>: the run's saved config (its recipe,
    variant and overrides) unless CONFIG is given, so the model is the one it trained; a
    RECIPE that is not the run's is refused in one line."""
    env = asked.env
    saved = run_config_of(Path(env["CKPT"])) if env.get("CKPT") else None
    if saved is None or asked.config:
        return asked
    recorded = request.config_file_recipe(str(saved))
    picked = asked.recipe
    if picked and recorded and picked[1] != recorded:
        raise UserError(
            f"CKPT={env['CKPT']} is a checkpoint of recipe {recorded!r} (its run's {saved}), "
            f"but {picked[0]}={picked[1]!r}; leave {picked[0]} unset to score it as it trained"
        )
    return dataclasses.replace(asked, config=str(saved))


def eval_flags(env: Mapping[str, str]) -> tuple[str, ...]:
    """make eval's CKPT, EMA and OUT as the engine's --eval flags (read from the environment,
    never pasted into a shell line)."""
    weights = env.get("CKPT", "")
    if not weights:
        raise UserError(
            "eval needs CKPT=<checkpoint, run directory, export or weights file>, e.g. "
            "make eval RECIPE=digits CKPT=runs/digits/NAME"
        )
    flags = ["--eval", weights]
    if request.is_set(env, "EMA"):
        flags.append("--ema")
    return (*flags, *(["--out", env["OUT"]] if env.get("OUT") else []))


def cmd_submit(args: argparse.Namespace, env: Mapping[str, str], argv: list[str]) -> int:
    """What submitit submits: printed by a dry run, else checked by the engine and queued."""
    asked = request.Asked.of(args, env)
    req = snapshot.attach(request.resolve(asked, target="submit"))
    slurm = check.slurm_support()
    dry = asked.dry_run
    if not dry:
        slurm.require_sbatch()
        slurm.check_fits(req)  # before the engine's check: seconds sooner
        watch.check_no_live_job(Path(req.src) / req.run_dir, req.run_name)
    config = check.engine_check(req, resolved=True)
    req = snapshot.freeze(req, config)  # the job reads this config alone
    if dry:
        print(slurm.dry_run([req], slurm.job_folder(req), req.run_name), end="")
        return 0
    return slurm.submit(req, config)


def cmd_config(args: argparse.Namespace, env: Mapping[str, str], argv: list[str]) -> int:
    """The resolved config of a request, as the run would save it (a file CONFIG= reruns);
    like --print-config, it names no run unless run.name is given."""
    return engine_here(args, env, "--print-config", target="config")


def cmd_shards(args: argparse.Namespace, env: Mapping[str, str], argv: list[str]) -> int:
    """make shards: the recipe's data written as shards by the engine (--make-shards), here."""
    return engine_here(args, env, "--make-shards")


def engine_here(
    args: argparse.Namespace, env: Mapping[str, str], flag: str, target: str = "local"
) -> int:
    """The engine with the request's config and `flag`, on this machine in one process and
    naming no run (a dry run prints the command). target "config": a file for any machine
    and target, not a command for this one."""
    asked = request.Asked.of(args, env)
    req = dataclasses.replace(request.resolve(asked, target=target), run_name="")
    argv = [req.python, "-m", "engine.train", *render.engine_args(req), flag]
    if asked.dry_run:
        print(render.shell_join(argv))
        return 0
    execute(argv)


def cmd_sweep(args: argparse.Namespace, env: Mapping[str, str], argv: list[str]) -> int:
    return sweep.main(args, env, argv)


def cmd_report(args: argparse.Namespace, env: Mapping[str, str], argv: list[str]) -> int:
    return report.main(args, env, dry=request.is_dry(args, env))


def cmd_publish(args: argparse.Namespace, env: Mapping[str, str], argv: list[str]) -> int:
    return publish.main(args, env, dry=request.is_dry(args, env))


def cmd_compare(args: argparse.Namespace, env: Mapping[str, str], argv: list[str]) -> int:
    return compare.main(args, env, dry=request.is_dry(args, env))


def cmd_reproduce(args: argparse.Namespace, env: Mapping[str, str], argv: list[str]) -> int:
    return reproduce.main(args, env)


def cmd_watch(args: argparse.Namespace, env: Mapping[str, str], argv: list[str]) -> int:
    return logs.main(args, env)


def cmd_recipes(args: argparse.Namespace, env: Mapping[str, str], argv: list[str]) -> int:
    """Each recipe with its configs and what they train, ready to copy as RECIPE/CONFIG."""
    names = request.recipe_names(env)
    if not names:
        raise UserError(f"no recipes under {request.recipes_dir(env)}")
    for recipe in names:
        folder = request.recipes_dir(env) / recipe
        print(f"{recipe:<10} {'':<8} {description(folder / 'config.yaml')}")
        for variant in request.recipe_variants(recipe, env):
            print(f"{'':<10} {variant:<8} {description(folder / f'{variant}.yaml')}")
    print("\nUse: make train RECIPE=NAME [CONFIG=VARIANT], or python -m launch train --recipe NAME")
    return 0


# Every command and its handler, in the order --help and the one-line errors list them.
HANDLERS: dict[str, Handler] = {
    "train": cmd_run,
    "eval": cmd_run,
    "dry-run": cmd_run,
    "submit": cmd_submit,
    "sweep": cmd_sweep,
    "docker-train": cmd_run,
    "image": cmd_run,
    "sif": cmd_run,
    "render": cmd_run,
    "sbatch": cmd_run,
    "config": cmd_config,
    "shards": cmd_shards,
    "recipes": cmd_recipes,
    "report": cmd_report,
    "compare": cmd_compare,
    "publish": cmd_publish,
    "reproduce": cmd_reproduce,
    "status": cmd_watch,
    "logs": cmd_watch,
    "cancel": cmd_watch,
}
COMMANDS = tuple(HANDLERS)


def main(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    if hasattr(sys.stdout, "reconfigure"):  # argv bytes that are not UTF-8 print as they came
        sys.stdout.reconfigure(errors="surrogateescape")
    try:
        argv = sys.argv[1:] if argv is None else argv
        args = parse_args(argv)
        variables.check_make_variables(env)
        if remote.forwards(args, env):  # REMOTE=user@login: the same command there, over ssh
            return remote.main(args, argv, env)
        return HANDLERS[args.command](args, env, argv)
    except UserError as e:
        print(f"launch: {printable(str(e))}", file=sys.stderr)
        return e.code
    except OSError as e:  # a path given (RUN=, TO=, run.name=...) the file system cannot hold
        if e.errno != errno.ENAMETOOLONG:
            raise
        name = printable(str(e.filename))
        name = name if len(name) <= 60 else f"{name[:40]}...{name[-12:]}"
        print(f"launch: a name too long for the file system: {name}; shorten it", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
