"""The engine's command line (also `python -m engine`):

    python -m engine.train RECIPE [--config VARIANT|FILE] [key=value ...] [--spawn N]
    python -m engine.train --config FILE [key=value ...]    (the file names its recipe)
    python -m engine.train RECIPE [...] --print-config | --check N[,M...]
    python -m engine.train RECIPE [...] --eval PATH [--ema] [--out FILE] [--spawn N]
    python -m engine.train RECIPE [...] --make-shards
    python -m engine.train [RECIPE] --help

The config: engine defaults < the recipe's config.yaml < the variant or config file < W&B's
environment variables < key=value overrides. `--help` lists every key, generated from the
config dataclasses. `--print-config` prints the resolved config as a run would save it and
`--check N` runs the checks for N processes (`--check 2,4,6`: for each world size an elastic
run may take); neither writes anything.

Exit codes: 0 done, 1 failure, 2 bad request (one line on stderr), 75 stopped on a
preemption signal with a checkpoint saved (rerun the same command to resume)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import torch

from engine import catalog, preempt, rundir
from engine import config as C
from engine import distributed as D
from engine import parallel as P
from engine import recipe as contract
from engine import weights as home
from engine.assemble import amp_dtype
from engine.data.sampler import check_batch_fits, check_elastic
from engine.eval_only import score
from engine.faults import RunError
from engine.lifecycle import PeerFailure, check_one_request, train
from engine.recipe import Recipe
from engine.spawn import spawn_local
from engine.tasks import check_supported, task_of
from engine.tracking import (
    redact,
    tensorboard_check,
    wandb_env_overrides,
    wandb_missing_note,
    wandb_mode,
)
from engine.weights import sources

USAGE = (
    "usage: python -m engine.train RECIPE [--config VARIANT|FILE] [key=value ...] "
    "[--resolved FILE] [--spawn N | --check N[,M...] | --print-config | --eval PATH [--ema] [--out FILE] | "
    "--make-shards | --help]"
)

OPTIONS = f"""{USAGE}
       python -m engine.train --config FILE [key=value ...]  (FILE names its recipe)

Train RECIPE with its config.yaml, a variant or config file layered on it, then overrides.

options:
  --config NAME|FILE  NAME: the variant recipes/RECIPE/NAME.yaml. FILE (holds a '/' or ends
                      in .yaml/.yml): a config file, e.g. a run's saved config.yaml; it may
                      stand in for RECIPE. A saved run.name is dropped (a new run) unless
                      run.name=... is given again.
  --resolved FILE     FILE is a config resolved before, whole (a launch's frozen request,
                      <run dir>/request/<hash>.yaml): read alone, no layer under or over
                      it, no --config and no key=value
  --spawn N           run N local processes (gloo on CPU, one GPU each on CUDA)
  --print-config      print the resolved config (what the run saves as config.yaml), then exit
  --check N[,M...]    resolve the config and check it for N processes, then exit; writes
                      nothing. The data too, where its location exists on this machine.
                      Several counts: every world size of an elastic run (NODES=MIN:MAX)
  --data-here         with --check: the data must be on this machine (a local launch)
  --eval PATH         evaluate only: score a checkpoint, run folder, export or weights file
                      on the held-out split (any number of processes) and write the result
                      as JSON beside it (<name>.eval.json); no training, no run directory
  --ema               with --eval: the checkpoint's averaged weights (EMA)
  --out FILE          with --eval: write the result here instead
  --make-shards       write the recipe's data as shards (data.shards) that data.format=shards
                      reads, then exit; rerun after a stop, it continues (make shards)
  -h, --help          this help; after RECIPE, the recipe's values and its model and data
                      keys
  --help-all          also the sections for tests (fault.*)
  key=value           a config key below, e.g. optim.lr=0.2 train.epochs=5

Layers, each over the one before: engine defaults < recipes/RECIPE/config.yaml < the variant
or config file < W&B's environment variables < key=value. WANDB_MODE (disabled, offline,
online, dryrun) sets log.wandb, WANDB_PROJECT log.project, WANDB_ENTITY log.entity;
WANDB_DIR is where W&B writes (else the run directory); WANDB_RUN_GROUP the run's group.

Exit codes: 0 done, 1 failure, 2 bad request (one line on stderr), 75 preempted with a
checkpoint saved (rerun the same command to resume)."""


@dataclass
class EngineRequest:
    """What the engine's command line asks of this process (launch's side is
    launch.render.LaunchRequest)."""

    recipe: str  # "" only with --help
    config: str = ""  # a variant's name or a config file's path (catalog.is_config_file)
    overrides: list[str] = field(default_factory=list)
    spawn: int = 0  # > 1: start this many local processes
    check: tuple[int, ...] = ()  # check the config for these world sizes, then exit
    data_here: bool = False  # --check: missing data is an error, not "on another machine"
    print_config: bool = False
    resolved: str = ""  # --resolved FILE: the whole config, resolved before (read, not layered)
    help: bool = False
    help_all: bool = False  # --help-all: test-only sections too
    evaluate: str = ""  # --eval PATH: score these weights, train nothing
    ema: bool = False  # --eval --ema
    out: str = ""  # --eval --out FILE
    make_shards: bool = False  # --make-shards: write the data's shards, train nothing

    def eval_flags(self) -> list[str]:
        """--eval and its options as given, for the processes --spawn starts."""
        if not self.evaluate:
            return []
        flags = ["--eval", self.evaluate, *(["--ema"] if self.ema else [])]
        return flags + (["--out", self.out] if self.out else [])


SWITCHES = (
    ("-h", "--help"),
    ("--help-all",),
    ("--print-config",),
    ("--data-here",),
    ("--ema",),
    ("--make-shards",),
)
# Value flags in the order their values are checked: the first problem found is the one told.
VALUE_FLAGS = ("--eval", "--out", "--spawn", "--check", "--config", "--resolved")
_NO_VALUE = object()  # a value flag given last, or followed by a flag or a `--`


class _Parser(argparse.ArgumentParser):
    """The engine's flags. A refused command line ends in the engine's one line (main prints
    it and exits 2), never in argparse's usage dump; the help is help_text, not argparse's."""

    def error(self, message: str) -> NoReturn:
        flag, _, problem = message.removeprefix("argument ").partition(": ")
        value = problem.removeprefix("ignored explicit argument ")  # --ema=1, -hx
        if value != problem:
            message = f"{flag} takes no value, got {value}"
        raise C.ConfigError(f"{message}; {USAGE}")


def _parser() -> _Parser:
    """Flags go anywhere among RECIPE and the overrides, as `--flag VALUE` or `--flag=VALUE`.
    What is not a flag of this parser (the recipe, key=value, an unknown --flag, a `--` and
    what follows it) is left in order for parse_argv, which reads the first word as RECIPE
    and hands the rest to the config as overrides; an unknown flag is refused there."""
    parser = _Parser(prog="python -m engine.train", add_help=False, allow_abbrev=False)
    for names in SWITCHES:  # given twice is given
        parser.add_argument(*names, action="store_true")
    for flag in VALUE_FLAGS:  # every occurrence, so that one given twice is told
        parser.add_argument(flag, action="append", nargs="?", const=_NO_VALUE)
    return parser


def _given(flags: argparse.Namespace, flag: str) -> list:
    """Each value a value flag was given, in order ([] when it is absent)."""
    return getattr(flags, flag.removeprefix("--")) or []


def _value(flags: argparse.Namespace, flag: str) -> str | None:
    """A value flag's value (None when the flag is absent)."""
    if not (given := _given(flags, flag)):
        return None
    value = given[0]
    if value is _NO_VALUE or value.startswith("-"):
        raise C.ConfigError(f"{flag} needs a value; {USAGE}")
    return value


def _count(flag: str, text: str | None, least: int) -> int:
    """A flag's process count (0 when the flag is absent)."""
    if text is None:
        return 0
    try:
        count = int(text)
    except ValueError:
        count = least - 1
    if count < least:
        raise C.ConfigError(f"{flag} needs a process count, got {text!r}; {USAGE}")
    return count


def _counts(flag: str, text: str | None) -> tuple[int, ...]:
    """`N` or `N,M,...`: process counts, each at least 1; () when the flag is absent."""
    if text is None:
        return ()
    return tuple(_count(flag, part, least=1) for part in text.split(","))


def parse_argv(argv: list[str]) -> EngineRequest:
    """The request, or a ConfigError of one line. With --help every other word is ignored,
    but a flag's missing or bad value is still refused."""
    flags, args = _parser().parse_known_args(argv)
    wants_help = flags.help or flags.help_all
    evaluate = _value(flags, "--eval") or ""
    out = _value(flags, "--out") or ""
    if (flags.ema or out) and not evaluate:
        raise C.ConfigError(f"--ema and --out go with --eval PATH; {USAGE}")
    spawn = _count("--spawn", _value(flags, "--spawn"), least=0)
    check = _counts("--check", _value(flags, "--check"))
    config = _value(flags, "--config") or ""
    resolved = _value(flags, "--resolved") or ""
    twice = [flag for flag in VALUE_FLAGS if len(_given(flags, flag)) > 1]
    if twice and not wants_help:
        raise C.ConfigError(f"{twice[0]} is given more than once; {USAGE}")
    named = bool(args) and not args[0].startswith("-") and "=" not in args[0]
    if resolved and (config or args[1 if named else 0 :]):
        raise C.ConfigError(
            f"--resolved {resolved} is a whole config: give it alone after RECIPE (no --config "
            "or key=value); to change a value, resolve the request again (make train ...)"
        )
    if evaluate and not config and not resolved:  # scored with its run's request
        config = _run_config(evaluate, args[0] if named else "")
    recipe = args.pop(0) if named else _recipe_of(config or resolved, wants_help)
    request = EngineRequest(recipe, config, args, spawn, check, flags.data_here, flags.print_config)
    request.resolved = resolved
    request.help, request.help_all = wants_help, flags.help_all
    request.evaluate, request.ema, request.out = evaluate, flags.ema, out
    request.make_shards = flags.make_shards
    return request


def _run_config(weights: str, recipe: str) -> str:
    """The saved config of the run whose checkpoint --eval scores ("" for weights outside a
    run): its recipe, variant and overrides rebuild the model it trained. A checkpoint of
    another recipe than the one named is refused in one line."""
    saved = rundir.run_config_of(Path(weights))
    if saved is None:
        return ""
    recorded = catalog.file_recipe(str(saved))
    if recipe and recorded and recipe != recorded:
        raise C.ConfigError(
            f"--eval {weights} is a checkpoint of recipe {recorded!r} (its run's {saved}), "
            f"not of {recipe!r}; evaluate it with RECIPE={recorded}, or leave the recipe out"
        )
    return str(saved)


def _recipe_of(config: str, wants_help: bool) -> str:
    """The recipe when none is given before the overrides: the config file's `recipe:`."""
    recipe = catalog.file_recipe(config) if catalog.is_config_file(config) else ""
    if recipe or wants_help:
        return recipe
    named_by = f" and {config} names none (no recipe: key)" if config else ""
    raise C.ConfigError(
        f"no recipe given{named_by} (available: {', '.join(catalog.available())}); {USAGE}"
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    os.umask(os.umask(0) | 0o022)  # nothing the run writes is writable by others
    try:
        request = parse_argv(argv)
        if request.help:
            print(help_text(request.recipe, request.help_all))
            return 0
        cfg, recipe = load(request)
        if request.check or request.print_config:
            return check_or_print(request, cfg, recipe)
        if request.make_shards:
            return make_shards(request, cfg, recipe)
        return run(request, cfg, recipe)
    except C.ConfigError as err:
        LAST_ERROR[:] = [redact(one_line(err))]
        if is_rank_zero():
            print(f"error: {LAST_ERROR[0]}", file=sys.stderr)  # all ranks fail alike
        return 2
    except RunError as err:
        LAST_ERROR[:] = [redact(str(err))]
        if is_rank_zero() or isinstance(err, PeerFailure):
            print(f"error: {LAST_ERROR[0]}", file=sys.stderr, flush=True)
        return 1


# The line main() last ended on, for a caller in the same process (a SLURM job's wrapper,
# launch.slurm.EngineJob, raises with it: the job's result says why, not only an exit code).
LAST_ERROR: list[str] = []


def load(request: EngineRequest) -> tuple[C.Config, Recipe]:
    """The config the request runs with: W&B's variables go before the command line's
    overrides, which win. A saved config names the run it came from: rerunning it starts a
    new run rather than resume or replace that one (said once), unless run.name is given."""
    if request.resolved:  # resolved once, by the launch that started this process
        return catalog.read_resolved(request.recipe, request.resolved)
    saved_name = "" if request.evaluate else saved_run_name(request)
    unnamed = saved_name or request.evaluate  # scoring claims no run directory
    leading = [*(["run.name="] if unnamed else []), *wandb_env_overrides(os.environ)]
    loaded = catalog.load_config(request.recipe, [*leading, *request.overrides], request.config)
    home.follow_preprocessing(*loaded)  # the named weights', before anything reads it
    if saved_name and is_rank_zero():
        print(
            f"note: {request.config} is the config of run {saved_name!r}; this starts a new "
            f"run (add run.name={saved_name} to continue that one)",
            file=sys.stderr,
        )
    return loaded


def saved_run_name(request: EngineRequest) -> str:
    """The run.name a config file sets, unless the command line sets one; "" for none."""
    if not catalog.is_config_file(request.config):
        return ""
    if any(o.startswith("run.name=") for o in request.overrides):
        return ""
    saved = catalog.read_config_file(request.config).get("run")
    name = saved.get("name") if isinstance(saved, dict) else None
    return name if isinstance(name, str) else ""


def check_or_print(request: EngineRequest, cfg: C.Config, recipe: Recipe) -> int:
    """--check N: the checks a launch of N processes makes first; --print-config: the config.
    Neither writes anything."""
    if request.check:
        preflight(cfg, *request.check, recipe=recipe)
        check_supported(task_of(recipe), cfg.train, cfg.mix)  # refused here, not on a compute node
        if note := wandb_missing_note(cfg.log):
            print(note, file=sys.stderr)
        check_data(cfg, recipe, request.data_here)
        check_sample_count(cfg, recipe)
        if cfg.run.name:  # one name, one request; a start checks again, holding the lock
            run_dir = rundir.decide_run_dir(cfg.run.root, cfg.recipe, cfg.run.name)
            check_one_request(cfg, run_dir, recipe.resume_safe)
        if request.data_here and sources.wanted(cfg.model):
            sources.source_of(cfg.model)  # model.init_from or model.weights' cached file
    if request.print_config:
        sys.stdout.write(resolved_text(cfg))
    else:
        sizes = ", ".join(map(str, request.check))
        print(f"config ok for {' or '.join(sizes.rsplit(', ', 1))} processes")
    return 0


def resolved_text(cfg: C.Config) -> str:
    """The config as --print-config prints it and --resolved reads it back."""
    return redact(C.dump(cfg))


def make_shards(request: EngineRequest, cfg: C.Config, recipe: Recipe) -> int:
    """--make-shards: the recipe's data as shards, written here (one process, no run)."""
    if recipe.make_shards is None:
        raise C.ConfigError(
            f"recipe {request.recipe} has no shard form of its data (only image recipes "
            "read class folders: make shards RECIPE=imagenet)"
        )
    recipe.make_shards(catalog.data_here(cfg))
    return 0


def run(request: EngineRequest, cfg: C.Config, recipe: Recipe) -> int:
    denv = D.read_env()  # a half-set environment is a user error too
    spawn = request.spawn
    sizes = spawn if spawn > 1 else denv.world_size
    preflight(cfg, sizes, training=not request.evaluate, recipe=recipe)
    if spawn > 1:
        return spawn_resolved(spawn, request, cfg)
    if request.evaluate:
        return score(cfg, recipe, Path(request.evaluate), request.ema, request.out)
    preempt.install_handlers()
    code = train(cfg, recipe)
    if code == 0:
        preempt.finished()
    return code


def spawn_resolved(n: int, request: EngineRequest, cfg: C.Config) -> int:
    """--spawn N: N processes that read this one's resolved config (with the run name it
    picked, so every child agrees on it), not resolve the request again."""
    name = rundir.decide_run_name(cfg.run.name, cfg.recipe, cfg.variant)
    text = resolved_text(C.finalize(cfg, {"run.name": name}))
    with tempfile.TemporaryDirectory(prefix="engine-spawn-") as folder:
        path = Path(folder) / "resolved.yaml"
        path.write_text(text)
        argv = [request.recipe, "--resolved", str(path), *request.eval_flags()]
        return spawn_local(n, main, argv)


def is_rank_zero() -> bool:
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"


def one_line(err: Exception) -> str:
    """The message itself: an error raised in a DataLoader worker arrives wrapped in the
    worker's traceback text, whose last line is `module.Type: message`."""
    last = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
    prefix = f"{type(err).__module__}.{type(err).__name__}: "
    return last.removeprefix(prefix).removeprefix(f"{type(err).__name__}: ")


def preflight(
    cfg: C.Config, *world_sizes: int, training: bool = True, recipe: Recipe | None = None
) -> None:
    """Checks that need the world size (several: every one an elastic run may take), done
    once before any process starts or writes; read-only (`--check N` runs exactly these).
    Evaluation alone splits no training batch, so any process count scores."""
    for world_size in sorted(set(world_sizes)):
        P.check_layout(cfg, world_size)
    if training:  # the batch is split over the data-parallel ranks: world / dist.tp
        replicas = sorted({w // cfg.dist.tp for w in world_sizes})
        try:
            check_elastic(cfg.train.batch_size, cfg.train.micro_batch_size, replicas)
        except C.ConfigError as err:
            if cfg.dist.tp == 1:
                raise
            groups = f"data-parallel groups (the processes / dist.tp={cfg.dist.tp})"
            raise C.ConfigError(str(err).replace("processes", groups, 1)) from None
    if recipe is not None:
        P.check_tensor_parallel(cfg, recipe)
    if cfg.device == "cpu":
        amp_dtype(cfg.train.amp, torch.device("cpu"))
    if cfg.run.name:
        run_dir = rundir.decide_run_dir(cfg.run.root, cfg.recipe, cfg.run.name)
        rundir.check_fresh_start(run_dir, cfg.resume, cfg.run.overwrite)
    wandb_mode(cfg.log)
    tensorboard_check(cfg.log)


def data_location(cfg: C.Config) -> str:
    """Where the data config points (data.root, else data.path); "" for nowhere."""
    data = catalog.data_here(cfg)
    return contract.data_location(data)


def check_data(cfg: C.Config, recipe: Recipe, here: bool) -> None:
    """The recipe's look at its data, where this machine can see it: a job submitted from a
    login node may read a data root that only the compute nodes mount."""
    location = data_location(cfg)
    if recipe.check_data is None or not (here or (location and Path(location).exists())):
        return
    recipe.check_data(catalog.data_here(cfg))


def check_sample_count(cfg: C.Config, recipe: Recipe) -> None:
    """A global batch larger than the training set, refused by the check before the queue
    where the recipe can count its samples without reading them (recipe.count_samples)."""
    if recipe.count_samples is None:
        return
    samples = recipe.count_samples(catalog.data_here(cfg))
    if samples is not None:
        check_batch_fits(samples, cfg.train.batch_size)


# ---------------------------------------------------------------- --help


def help_text(recipe_name: str, everything: bool = False) -> str:
    """Usage, then every key with its type, default, range and meaning, generated from the
    config dataclasses; with a recipe, the values its config.yaml gives (not the engine's
    defaults), its variants and its own sections too. Test-only sections (fault) only with
    `everything` (--help-all)."""
    shown = {k: c for k, c in C.ENGINE_SECTIONS.items() if everything or not C.is_test_only(c)}
    cfg = catalog.load_config(recipe_name, [])[0] if recipe_name else None
    sections = {"top level": C.describe_top_level(cfg)}
    summaries = {name: C.class_summary(cls) for name, cls in shown.items()}
    sections |= {
        name: C.describe_section(name, cls, getattr(cfg, name, None)) for name, cls in shown.items()
    }
    hidden = sorted(set(C.ENGINE_SECTIONS) - set(shown))
    parts = [OPTIONS, f"recipes: {', '.join(catalog.available())}"]
    if recipe_name:
        recipe = catalog.load(recipe_name)
        own = {"model": C.with_weights_init(recipe.model_config), "data": recipe.data_config}
        summaries |= {f"{name} ({recipe_name})": C.class_summary(cls) for name, cls in own.items()}
        sections |= {
            f"{name} ({recipe_name})": C.describe_section(name, c, getattr(cfg, name))
            for name, c in own.items()
        }
        parts.append(variant_lines(recipe_name))
    for title, rows in sections.items():
        summary = summaries.get(title, "")
        parts.append("\n".join([f"{title}: {summary}" if summary else title, *key_lines(rows)]))
    if hidden:
        parts.append(f"not listed: {', '.join(hidden)} (for tests; --help-all lists them)")
    return "\n\n".join(parts)


def variant_lines(recipe_name: str) -> str:
    """The recipe in one line, then each variant (--config NAME) in one line."""
    folder = catalog.RECIPES_DIR / recipe_name
    lines = [f"recipe {recipe_name}: {C.description(folder / 'config.yaml')}"]
    for name in catalog.variants(recipe_name):
        lines.append(f"  --config {name:<10} {C.description(folder / f'{name}.yaml')}".rstrip())
    return "\n".join(lines)


def key_lines(rows: list[C.KeyHelp]) -> list[str]:
    """One line per key, in columns: key, type = default, (range), meaning."""
    typed = [f"{row.kind} = {row.default}" for row in rows]
    ranges = [f"({row.range})" if row.range else "" for row in rows]
    key_width = max(len(row.key) for row in rows)
    typed_width, range_width = max(map(len, typed)), max(map(len, ranges))
    return [
        f"  {row.key:<{key_width}}  {kind:<{typed_width}}  {span:<{range_width}}  {row.meaning}".rstrip()
        for row, kind, span in zip(rows, typed, ranges, strict=True)
    ]


if __name__ == "__main__":
    sys.exit(main())
