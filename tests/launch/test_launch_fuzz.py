"""Property tests of `python -m launch`: random request values (shell metacharacters, line
breaks, unicode, undecodable bytes, empty, very long) in every flag and in every variable the
Makefile exports. Each case either succeeds or ends in exit 2 with one printable line on
stderr; never a traceback. Every case is a dry run, and whatever would start a process is
replaced by a stub that fails the test."""

from __future__ import annotations

import contextlib
import functools
import io
import os
import re
import shlex
import string
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from launch import cli, request
from tests import helpers

ROOT = Path(__file__).resolve().parents[2]
FUZZ = settings(
    max_examples=100,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def makefile_exports() -> list[str]:
    """The request variables `make` hands to launch, read from the Makefile's export lines;
    not REMOTE*, which send a request over ssh (tests/launch/test_remote.py)."""
    lines = [x for x in (ROOT / "Makefile").read_text().splitlines() if x.startswith("export ")]
    return [v for line in lines for v in line.split()[1:] if not v.startswith("REMOTE")]


SLURM_VARS = [env for _, env in cli.SLURM_FLAGS.values()]
ENV_VARS = sorted({*makefile_exports(), *SLURM_VARS, "TARGET", "SIF", "RDZV_ENDPOINT"})
# Values that pass validation, so that the random ones also reach the later checks.
PLAUSIBLE = {
    "RECIPE": ["digits", "cifar10", "imagenet"],
    "CONFIG": ["v2", "fast", "budget"],
    "GPUS": ["0", "1", "2", "8"],
    "NODES": ["1", "2"],
    "PROCS": ["1", "2"],
    "ARGS": ["run.name=fuzz", "optim.lr=0.2 train.epochs=1", "run.root=/tmp/x"],
    "DRY_RUN": ["1", "0"],
    "SEEDS": ["1", "2"],
    "MAX_RESTARTS": ["0", "3"],
    "TARGET": [*cli.RENDER_TARGETS, "submit"],
    "RDZV_ENDPOINT": ["node1:29500"],
    "TIME_MIN": ["30"],
    "PARTITION": ["gpu"],
}
NASTY = [
    "", " ", "\n", "\r\n", "\t", "'", '"', "\\", "$(touch pwned)", "`touch pwned`", "; rm -rf x",
    "a|b", "a&&b", "--", "-", "-1", "0", "+3", "1.5", "1e3", "٣", "a=b", "run.name=a/b",
    "run.name=$(x)", "[", "]", "%j", "{}", "*", "~", "..", "../x", "/abs", "é", "\u2028",
    "\x85", "\x1b[31mred", "\udcff", "x" * 5000, "9" * 5000,
]  # fmt: skip


def undecodable() -> st.SearchStrategy[str]:
    """What os.environ and sys.argv hold for bytes that are not UTF-8."""
    return st.binary(min_size=1, max_size=12).map(lambda b: os.fsdecode(b.replace(b"\0", b"")))


TEXT = st.one_of(
    st.sampled_from(NASTY),
    st.text(max_size=40),
    st.text(string.printable + "$`'\"\\;|&<>(){}[]*?!#~", max_size=40),
    undecodable(),
).map(lambda s: s.replace("\0", ""))  # neither argv nor the environment can hold a NUL


def value_for(name: str) -> st.SearchStrategy[str]:
    plausible = PLAUSIBLE.get(name)
    return st.one_of(st.sampled_from(plausible), TEXT) if plausible else TEXT


ENVIRONMENTS = st.fixed_dictionaries({}, optional={name: value_for(name) for name in ENV_VARS})


def flag_strategy() -> st.SearchStrategy[list[str]]:
    """[flag] or [flag, value] for any option of the parser (--help aside)."""
    out = []
    for action in cli.build_parser()._actions:
        flags = [f for f in action.option_strings if f not in ("-h", "--help")]
        if not flags:
            continue
        if action.nargs == 0:
            out.append(st.just([flags[0]]))
        else:
            out.append(st.tuples(st.just(flags[0]), value_for(action.dest.upper())).map(list))
    return st.one_of(*out)


FLAGS = flag_strategy()


@st.composite
def argvs(draw) -> list[str]:
    """COMMAND --dry-run [flags...] [words...] [-- overrides...]: always a dry run."""
    command = draw(st.one_of(st.sampled_from(cli.COMMANDS), TEXT))
    flags = draw(st.lists(FLAGS, max_size=5))
    words = draw(st.lists(TEXT, max_size=3))
    tail = draw(st.lists(st.one_of(st.sampled_from(PLAUSIBLE["ARGS"]), TEXT), max_size=3))
    dash = ["--", *tail] if draw(st.booleans()) else []
    return [command, "--dry-run", *[x for pair in flags for x in pair], *words, *dash]


# The machine's answers, asked once: each costs a process start, and they never change here.
GIT_SHORT_SHA = functools.cache(request.git_short_sha)
INSTALLED_GPUS = functools.cache(request.installed_gpu_count)


def refuse(*_args, **_kwargs):
    raise AssertionError("a dry run tried to start a process")


def check_here(argv: list[str], stdin: str | None = None) -> tuple[int, str, str]:
    """launch.check.run_check without its process: the engine's own --check (or
    engine.resolved's configs), in this one (the same code, without a torch import per case)."""
    from engine import cli as engine_cli
    from engine import resolved

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        if "engine.resolved" in argv:
            with mock.patch("sys.stdin", io.StringIO(stdin)):
                code = resolved.main()
        else:
            code = engine_cli.main(argv[argv.index("engine.train") + 1 :])
    return code, out.getvalue(), err.getvalue()


def run_main(argv: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    """cli.main in-process, stdout a UTF-8 terminal (strict), stderr as Python's own."""
    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict")
    err = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="backslashreplace")
    stubs = [
        mock.patch("launch.request.git_short_sha", GIT_SHORT_SHA),
        mock.patch("launch.request.installed_gpu_count", INSTALLED_GPUS),
        mock.patch("os.execv", refuse),
        mock.patch("launch.check.run_check", check_here),
        mock.patch("launch.slurm.submit", refuse),
        mock.patch("launch.slurm.submit_array", refuse),
        mock.patch("launch.sweep_members.subprocess", SimpleNamespace(run=refuse)),  # sweep's alone
    ]
    with contextlib.ExitStack() as stack:
        for stub in stubs:
            stack.enter_context(stub)
        stack.enter_context(contextlib.redirect_stdout(out))
        stack.enter_context(contextlib.redirect_stderr(err))
        try:
            code = cli.main(argv, env)
        except SystemExit as e:  # argparse may still exit by itself
            code = e.code
        out.flush()
        err.flush()
    raw = out.buffer.getvalue(), err.buffer.getvalue()
    return code, *(b.decode("utf-8", "surrogateescape") for b in raw)


def assert_clean_outcome(argv: list[str], env: dict[str, str]) -> None:
    code, out, err = run_main(argv, env)
    assert "Traceback" not in err, err
    if code == 0:  # a warning, or a note of what a build is given, never more
        said = err.splitlines()
        assert all(line.startswith(("launch: warning: ", "launch: note: ")) for line in said), err
        return
    assert code == 2, (code, out, err)
    lines = err.splitlines()
    assert len(lines) == 1 and err.endswith("\n"), err
    assert lines[0].startswith("launch: ") and lines[0].isprintable(), lines[0]
    assert out == "", out


@FUZZ
@given(argv=argvs())
def test_random_flags_and_overrides_succeed_or_are_one_line(argv):
    assert_clean_outcome(argv, {"GPUS": "0"})


@FUZZ
@given(env=ENVIRONMENTS, command=st.sampled_from(cli.COMMANDS))
@example(env={"GPUS": "0", "RUN": "x" * 300}, command="logs")  # found: a traceback (name too long)
def test_random_request_variables_succeed_or_are_one_line(env, command):
    assert_clean_outcome([command, "--dry-run"], env)


@FUZZ
@given(argv=argvs(), env=ENVIRONMENTS)
def test_random_flags_and_variables_together(argv, env):
    assert_clean_outcome(argv, env)


# Every nasty value in every variable and flag, each in the command that reads it.
def command_for(name: str) -> list[str]:
    if name in ("IMAGE", "--image"):
        return ["docker-train"]
    if name in ("SIF", "--sif"):
        return ["render", "--target", "apptainer"]
    if name in ("SEEDS", "--seeds", "--report"):
        return ["sweep"]
    if name in SLURM_VARS or name.lstrip("-").replace("-", "_") in cli.SLURM_FLAGS:
        return ["submit"]
    return ["train"]


VALUE_FLAGS = [
    a.option_strings[0] for a in cli.build_parser()._actions if a.option_strings and a.nargs != 0
]
OVERRIDES = ["note", "run.name", "run.root", "seed", "device"]


@pytest.mark.parametrize("name", [*ENV_VARS, *VALUE_FLAGS, *OVERRIDES])
def test_every_nasty_value_in_every_variable_flag_and_override(name):
    failures = []
    for value in NASTY:
        argv, env = [*command_for(name), "--dry-run"], {"GPUS": "0"}
        if name in ENV_VARS:
            env[name] = value
        elif name.startswith("--"):
            argv += [name, value]
        else:
            argv += ["--", f"{name}={value}"]
        try:
            assert_clean_outcome(argv, env)
        except Exception as e:  # collect them all: one run shows every value that fails
            failures.append(f"{value[:20]!r}: {type(e).__name__}: {str(e)[:200]}")
    assert not failures, "\n".join(failures)


def test_bytes_that_are_not_utf8_print_as_they_came(tmp_path):
    """A real process: the printed command holds the argument's own bytes (launch beside an
    engine whose check passes at once: the subject is what launch prints)."""
    engine = "import sys\nsys.exit(0)\n"
    checkout = helpers.fake_checkout(tmp_path / "checkout", engine, "seed: 0\n")
    done = subprocess.run(
        [sys.executable, "-m", "launch", "dry-run", "--gpus", "0", "--", b"log.project=caf\xe9"],
        cwd=checkout,
        env=helpers.launch_env(),
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert shlex.split(os.fsdecode(done.stdout))[-1] == os.fsdecode(b"log.project=caf\xe9")


def test_the_harness_sees_success_and_one_line_errors():
    code, out, err = run_main(["train", "--dry-run", "--gpus", "0"], {})
    assert code == 0 and re.search(r"engine\.train digits device=cpu", out) and err == ""
    code, out, err = run_main(["train", "--dry-run"], {"GPUS": "x\ny"})
    assert code == 2 and err == "launch: GPUS='x\\ny' is not a whole number >= 0; " + (
        "use GPUS=0 for CPU or GPUS=N for N GPUs per node\n"
    )


def test_the_harness_stops_a_run_that_is_not_dry(monkeypatch):
    monkeypatch.chdir(ROOT)  # launch changes to the checkout before it would exec
    with pytest.raises(AssertionError, match="tried to start a process"):
        run_main(["train", "--gpus", "0"], {})
