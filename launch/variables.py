"""The request variables: one list, read by launch's check of what make was given, by the
tests (tests.helpers.REQUEST_VARS) and checked against the Makefile's help and the README.

make hands every VAR=value of its command line to launch in MAKEFLAGS; a name that is none
of these but is close to one (NODE=2, PARTITON=gpu) is a typo that would otherwise be
ignored in silence (a job on one node, in the default partition): it is refused with the
name it most likely meant. A name close to none (CC=clang) is left alone: it is not ours."""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping

from launch.errors import UserError

# The request: what is trained, where, and how many.
REQUEST = ("RECIPE", "CONFIG", "GPUS", "NODES", "PROCS", "ARGS", "IMAGE", "SIF", "DRY_RUN",
           "TARGET", "RDZV_ENDPOINT", "MAX_RESTARTS", "ALLOW_CPU", "RECIPES_DATA", "RECIPES_DIR")  # fmt: skip
# SLURM's shortcuts for slurm.* keys (launch.request.SLURM_FLAGS).
SLURM = ("PARTITION", "ACCOUNT", "QOS", "TIME_MIN", "CPUS_PER_TASK", "MEM_GB", "CONSTRAINT",
         "EXCLUDE", "SIGNAL_DELAY_S", "MAX_REQUEUES")  # fmt: skip
# Sweeps, comparisons, reports, watching, evaluation and export.
ANALYSIS = ("SEEDS", "SWEEP", "BASELINE", "PARALLEL", "WAIT", "RUNS", "RUN", "FOLLOW", "TO",
            "MLFLOW_TRACKING_URI", "CKPT", "EMA", "OUT", "BEST", "AVERAGE", "FORCE")  # fmt: skip
# Another machine, and the container.
REMOTE = ("REMOTE", "REMOTE_DIR", "REMOTE_PYTHON", "REMOTE_SSH")
CONTAINER = ("DOCKER", "DOCKER_NETWORK", "BASE_IMAGE", "CA_BUNDLE", "PIP_INDEX_URL",
             "PIP_EXTRA_INDEX_URL", "PIP_TRUSTED_HOST")  # fmt: skip
# The Makefile's own: the project's targets (test, lint, mutants, gpu-wheels).
MAKEFILE = ("PYTHON", "TEST_WORKERS", "PLANTS", "VENV", "PY", "STAMP", "XDIST",
            "TORCHCODEC_INDEX", "LINT_PY", "LINT_DOCKERFILES", "LINT_WORKFLOWS",
            "LINT_IMPORTS_ROOT")  # fmt: skip
KNOWN = frozenset(REQUEST + SLURM + ANALYSIS + REMOTE + CONTAINER + MAKEFILE)

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
