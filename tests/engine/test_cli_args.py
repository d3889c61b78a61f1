"""The engine's command line as argparse reads it (engine.cli.parse_argv): flags anywhere
among RECIPE and the overrides, overrides passed on in order, and every refused line one line
on stderr with exit code 2, never argparse's usage dump or a traceback."""

import subprocess
import sys

import pytest

from engine import cli
from engine import config as C
from engine.cli import USAGE, EngineRequest
from tests.helpers import REPO, engine_env


def refused(argv: list[str]) -> str:
    """parse_argv's one-line message for argv."""
    with pytest.raises(C.ConfigError) as err:
        cli.parse_argv(argv)
    return str(err.value)


def test_the_lines_launch_renders_read_as_before():
    argv = ["digits", "--config", "v2", "device=cpu", "run.name=r", "--eval", "ck.pt", "--ema"]
    argv += ["--out", "o.json", "optim.lr=0.2", "train.epochs=5", "--check", "2,4", "--data-here"]
    overrides = ["device=cpu", "run.name=r", "optim.lr=0.2", "train.epochs=5"]
    expected = EngineRequest("digits", "v2", overrides)
    expected.check, expected.data_here = (2, 4), True
    expected.evaluate, expected.ema, expected.out = "ck.pt", True, "o.json"
    assert cli.parse_argv(argv) == expected
    assert expected.eval_flags() == ["--eval", "ck.pt", "--ema", "--out", "o.json"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--spawn", "2", "digits", "a.b=1", "--print-config", "c=2"],  # flags before RECIPE
        ["digits", "a.b=1", "--spawn=2", "c=2", "--print-config"],  # --flag=VALUE
        ["digits", "--print-config", "a.b=1", "--print-config", "c=2", "--spawn", "2"],
    ],
)
def test_flags_go_anywhere_and_the_overrides_keep_their_order(argv):
    request = cli.parse_argv(argv)
    assert (request.recipe, request.overrides) == ("digits", ["a.b=1", "c=2"])
    assert (request.spawn, request.print_config, request.config) == (2, True, "")


def test_spawn_0_and_1_are_one_process():
    assert [cli.parse_argv(["digits", "--spawn", n]).spawn for n in ("0", "1")] == [0, 1]


def test_help_ignores_the_other_words():
    request = cli.parse_argv(["digits", "--help", "--nosuch", "--spawn", "2", "--spawn", "3"])
    assert (request.help, request.help_all, request.recipe) == (True, False, "digits")
    request = cli.parse_argv(["--help-all"])
    assert (request.help, request.help_all, request.recipe) == (True, True, "")
    assert cli.parse_argv(["-h"]).help


def test_an_abbreviated_or_unknown_flag_is_not_a_flag():
    request = cli.parse_argv(["digits", "--spa", "2", "--nosuch=1"])
    assert (request.spawn, request.overrides) == (0, ["--spa", "2", "--nosuch=1"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["digits", "--spawn", "x"], "--spawn needs a process count, got 'x'"),
        (["digits", "--spawn", ""], "--spawn needs a process count, got ''"),
        (["digits", "--spawn=two"], "--spawn needs a process count, got 'two'"),
        (["digits", "--spawn", "-1"], "--spawn needs a value"),
        (["digits", "--spawn"], "--spawn needs a value"),
        (["digits", "--spawn", "--print-config"], "--spawn needs a value"),
        (["digits", "--config", "--", "v2"], "--config needs a value"),
        (["--help", "digits", "--config"], "--config needs a value"),  # --help too
        (["digits", "--eval", "--ema", "ck.pt"], "--eval needs a value"),
        (["digits", "--ema"], "--ema and --out go with --eval PATH"),
        (["digits", "--out", "o.json"], "--ema and --out go with --eval PATH"),
        (["digits", "--spawn", "x", "--ema"], "--ema and --out go with --eval PATH"),  # first
        (["digits", "--spawn", "2", "--spawn", "3"], "--spawn is given more than once"),
        (["digits", "--config", "v2", "--config=v2"], "--config is given more than once"),
        (["digits", "--check", "2", "--check"], "--check is given more than once"),
        (["digits", "--ema=1"], "--ema takes no value, got '1'"),
        (["digits", "-hx"], "-h/--help takes no value, got 'x'"),
        (["a.b=1"], "no recipe given (available: "),
    ],
)
def test_a_refused_line_is_one_message_with_the_usage(argv, message):
    text = refused(argv)
    assert text.startswith(message) and "\n" not in text
    if not text.startswith("no recipe"):
        assert text == f"{message}; {USAGE}"


NOT_KEY_VALUE = "is not key=value (example: optim.lr=0.2)"


def test_a_double_dash_ends_the_flags_and_is_refused_as_before():
    request = cli.parse_argv(["digits", "--", "--spawn", "2"])
    assert (request.spawn, request.overrides) == (0, ["--", "--spawn", "2"])


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["digits", "--ema=1"], f"--ema takes no value, got '1'; {USAGE}"),
        (["digits", "--spawn", "2", "--spawn", "2"], f"--spawn is given more than once; {USAGE}"),
        (["digits", "--nosuch"], f"override '--nosuch' {NOT_KEY_VALUE}"),
        (["digits", "--", "optim.lr=1"], f"override '--' {NOT_KEY_VALUE}"),
    ],
)
def test_main_prints_the_one_line_and_exits_2(capsys, argv, line):
    assert cli.main(argv) == 2
    out = capsys.readouterr()
    assert (out.out, out.err) == ("", f"error: {line}\n")


def test_the_process_exits_2_with_the_one_line(tmp_path):
    cmd = [sys.executable, "-m", "engine", "digits", "--spawn", "two", f"run.root={tmp_path}"]
    out = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, env=engine_env(), timeout=120
    )
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr == f"error: --spawn needs a process count, got 'two'; {USAGE}\n"
    assert list(tmp_path.iterdir()) == []
