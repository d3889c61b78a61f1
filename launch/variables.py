"""The request variables: one list, with each one's meaning and default. `make help` and
`python -m launch --help` print it, the README's table is written from it (`python -m
launch.variables --markdown`; tests/launch/test_make_targets.py holds them equal), launch's
check of what make was given reads it, and so do the tests (tests.helpers.REQUEST_VARS).

make hands every VAR=value of its command line to launch in MAKEFLAGS; a name that is none
of these but is close to one (NODE=2, PARTITON=gpu) is a typo that would otherwise be
ignored in silence (a job on one node, in the default partition): it is refused with the
name it most likely meant. A name close to none (CC=clang) is left alone: it is not ours."""

from __future__ import annotations

import difflib
import re
import sys
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass

from launch.errors import UserError


@dataclass(frozen=True)
class Variable:
    """One or more request variables with one meaning: the README's table row (Markdown),
    `make help` and `python -m launch --help` (plain text) are written from it."""

    names: tuple[str, ...]
    meaning: str
    default: str = ""


def var(names: str, meaning: str, default: str = "") -> Variable:
    return Variable(tuple(names.split()), meaning, default)


# The request: what is trained, where, and how many.
REQUEST = (
    var("RECIPE", "a folder of `recipes/`", "`digits`"),
    var(
        "CONFIG",
        "a variant of the recipe (`recipes/<recipe>/<CONFIG>.yaml`), or a config "
        "file such as a run's saved `config.yaml`",
        "none: `config.yaml`",
    ),
    var(
        "GPUS",
        "GPUs per node; `0` = CPU",
        "`make train`: 1 if a GPU is visible, else 0; "
        "`make submit` and SLURM sweeps: the recipe's `slurm.gpus_per_node`",
    ),
    var(
        "NODES",
        "nodes; `MIN:MAX` an elastic range "
        "([Elastic](docs/distributed.md#elastic-lose-a-node-keep-training))",
        "1; under SLURM the recipe's `slurm.nodes`",
    ),
    var("PROCS", "processes per node when `GPUS=0`", "1"),
    var("ARGS", 'config overrides, `ARGS="optim.lr=0.2 train.epochs=5"`'),
    var(
        "RDZV_ENDPOINT",
        "`HOST:PORT` of the first node, for `NODES>1` outside SLURM "
        "(one run name for all: `ARGS=run.name=NAME`)",
        "required then",
    ),
    var(
        "MAX_RESTARTS",
        "torchrun restarts the workers this often after a failure, from the "
        "last checkpoint (not under SLURM, which requeues)",
        "0; 3 for a node range",
    ),
    var(
        "TARGET",
        "where `make train` runs (`local`, `docker`, `pyxis`, `apptainer`) and "
        "`make sweep` (`local`, `submit`)",
        "`local`",
    ),
    var("DRY_RUN", "`1`: print the command instead of running it"),
    var("ALLOW_CPU", "`1`: submit with `GPUS=0` a recipe that declares GPUs", "refused"),
    var(
        "RECIPES_DATA",
        "the data's root on this machine (`data.root` is `$RECIPES_DATA/<recipe>`)",
        "`data/` in the checkout; `/data` in the container",
    ),
    var("RECIPES_DIR", "where recipes are looked up", "`recipes/` in the checkout"),
)
# SLURM's shortcuts for slurm.* keys (launch.request.SLURM_FLAGS; docs/config.md's table).
SLURM = (
    var(
        "PARTITION ACCOUNT QOS TIME_MIN CPUS_PER_TASK MEM_GB CONSTRAINT EXCLUDE SIGNAL_DELAY_S "
        "MAX_REQUEUES",
        "under SLURM: each sets one `slurm.*` key "
        "([the table](docs/config.md#one-name-per-setting-config-keys-and-their-shortcuts))",
        "the recipe's `slurm:` section",
    ),
)
# Sweeps, comparisons, reports, watching, evaluation and export.
ANALYSIS = (
    var("SEEDS", "`make sweep`: seeds 0..N-1 per cell", "3 (a rerun: the sweep's own)"),
    var("SWEEP", "`make sweep`: a sweep file (`grid:`, `zip:`, `baseline:`, `seeds:`, `name:`)"),
    var(
        "BASELINE",
        "`make sweep`, `make compare`: the cell the others are compared with, "
        '`BASELINE="optim.lr=0.1"`',
        "the first cell (the first run's group)",
    ),
    var("PARALLEL", "`make sweep TARGET=submit`: at most N array tasks at once", "every task"),
    var(
        "WAIT",
        "`0`: `make sweep TARGET=submit` submits the array and returns (a rerun reports it)",
        "wait until it ends",
    ),
    var(
        "RUNS",
        "`make status`, `report`, `compare`, `publish`: run directories or patterns",
        "status: every run under `runs/`",
    ),
    var(
        "RUN FOLLOW",
        "`make logs`, `make cancel`: the run directory; `FOLLOW=1`: the log until the run ends",
    ),
    var(
        "TO MLFLOW_TRACKING_URI",
        "`make publish`: `tensorboard[:DIR]` or `mlflow[:URI]`; "
        "MLflow's URI when `TO=mlflow` names none",
        "a sqlite file beside the runs",
    ),
    var(
        "CKPT EMA OUT",
        "`make eval`, `make export`: the checkpoint, run directory, export or "
        "weights file; `EMA=1` its averaged weights; the file written",
    ),
    var(
        "BEST AVERAGE FORCE",
        "`make export`: `1` for the run's best checkpoint, the mean of "
        "its best, an existing `OUT` replaced",
    ),
)
# Another machine, and the container.
REMOTE = (
    var(
        "REMOTE REMOTE_DIR",
        "`make submit`, `make sweep TARGET=submit` and the watch commands "
        "run on that login node over ssh, the code copied there first "
        "([From your laptop](docs/slurm.md#from-your-laptop-remote))",
        "unset: here",
    ),
    var(
        "REMOTE_PYTHON REMOTE_SSH",
        "with `REMOTE`: the Python there; the ssh command",
        "`.venv/bin/python`; `ssh -o BatchMode=yes`",
    ),
)
CONTAINER = (
    var(
        "IMAGE SIF",
        "container image; apptainer's image file",
        "`recipes:<git short sha>`; `recipes.sif`",
    ),
    var(
        "DOCKER_NETWORK DOCKER",
        "docker's `--network` for `make image` and `make "
        "docker-train` (`host` where dockerd runs without a bridge); the docker client",
        "docker's default; `docker`",
    ),
    var(
        "BASE_IMAGE",
        "`make image`: another base than the CUDA one (e.g. "
        "`docker/debootstrap-base.sh`'s Debian bookworm)",
        "the Dockerfile's",
    ),
    var(
        "CA_BUNDLE PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_TRUSTED_HOST",
        "`make image` behind a "
        "proxy: pip's CA bundle and index in the build, as BuildKit secrets (never in a layer; "
        "a credential never printed) ([docs/container.md](docs/container.md#behind-a-proxy-a-"
        "ca-bundle-and-a-package-index))",
    ),
)
USER = REQUEST + SLURM + ANALYSIS + REMOTE + CONTAINER
# The Makefile's own: the project's targets (test, lint, mutants, gpu-wheels).
MAKEFILE = (
    "PYTHON",
    "TEST_WORKERS",
    "PLANTS",
    "VENV",
    "PY",
    "STAMP",
    "XDIST",
    "TORCHCODEC_INDEX",
    "LINT_PY",
    "LINT_DOCKERFILES",
    "LINT_WORKFLOWS",
    "LINT_IMPORTS_ROOT",
)
KNOWN = frozenset(name for v in USER for name in v.names) | frozenset(MAKEFILE)

ASSIGNMENT = re.compile(r"([A-Z][A-Z0-9_]*)=")


def given_to_make(makeflags: str) -> list[str]:
    """The upper-case variable names assigned on make's command line, as MAKEFLAGS holds
    them (` -- NODE=2 ARGS=a\\ b`: words split on unescaped spaces)."""
    words = re.split(r"(?<!\\) +", makeflags.strip())
    if "--" in words:
        words = words[words.index("--") + 1 :]
    return [m[1] for w in words if (m := ASSIGNMENT.match(w))]


def check_make_variables(env: Mapping[str, str]) -> None:
    """A misspelt request variable given to make is one line with the name it meant."""
    for name in given_to_make(env.get("MAKEFLAGS", "")):
        if name in KNOWN:
            continue
        close = difflib.get_close_matches(name, sorted(KNOWN), n=1, cutoff=0.75)
        if close:
            raise UserError(
                f"{name} is not a request variable; did you mean {close[0]}? (make help lists "
                "them; nothing was started)"
            )


# ---------------------------------------------------------------- written from the one list

LINK = re.compile(r"\[([^\]]*)\]\(([^)]*)\)")


def plain(text: str) -> str:
    """Markdown as a terminal shows it: a link as the page it names, no backticks."""
    return LINK.sub(lambda m: m[2].split("#")[0], text).replace("`", "")


def markdown_table() -> str:
    """The README's table of request variables."""
    rows = ["| variable | meaning | default |", "|---|---|---|"]
    for v in USER:
        rows.append(f"| {', '.join(f'`{n}`' for n in v.names)} | {v.meaning} | {v.default} |")
    return "\n".join(rows) + "\n"


def help_text(width: int = 92) -> str:
    """`make help`'s and `python -m launch --help`'s list: each variable, meaning, default."""
    lines = []
    for v in USER:
        default = f" [{plain(v.default)}]" if v.default else ""
        lines += textwrap.wrap(
            f"{' '.join(v.names)}: {plain(v.meaning)}{default}", width, subsequent_indent="    "
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # make help; --markdown: the README's table
    sys.stdout.write(markdown_table() if sys.argv[1:] == ["--markdown"] else help_text())
