"""Several engine command lines that each stop before training (a config or data error), run
one after another in one fresh process: `python -m engine.train ARGS` is `sys.exit(main(ARGS))`,
so each call's exit status and its own stdout and stderr are main's return value and what it
printed while it ran (warnings included: they print to the stderr of the moment)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

from tests.helpers import QUIET, REPO, engine_env

SCRIPT = """
import contextlib, io, json, sys
from engine import cli
results = []
for argv in json.loads(sys.stdin.read()):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as stop:
            code = stop.code
    results.append([code, out.getvalue(), err.getvalue()])
sys.__stdout__.write(json.dumps(results))
"""


@dataclass
class Call:
    returncode: int
    stdout: str
    stderr: str


def engine_calls(*argvs: list[str], timeout: float = 300) -> list[Call]:
    """Each argv (after `python -m engine.train`, with the tests' QUIET flags) in turn."""
    argvs = [[argv[0], *QUIET, *argv[1:]] for argv in argvs]
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        input=json.dumps(argvs),
        cwd=REPO,
        env=engine_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr
    return [Call(*result) for result in json.loads(done.stdout)]
