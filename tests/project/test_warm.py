"""The suite's warm processes (tests/warm.py) are the processes a fresh interpreter would be:
the same command line, environment, working folder, import path, thread count, standard
input, exit code and output; launch's checks forked inside a warm launch answer as cold ones."""

import json
import subprocess
import sys

from tests import helpers, warm

PROBE = """\
import json, multiprocessing, os, signal, sys
import torch
sys.stdout.write(json.dumps({
    "argv": sys.argv[1:], "orig_argv": sys.orig_argv, "path": sys.path, "cwd": os.getcwd(),
    "name": __name__, "threads": torch.get_num_threads(), "stdin": sys.stdin.read(),
    "probe_env": os.environ.get("PROBE"), "engine_loaded": "engine" in sys.modules,
    "sigint": str(signal.getsignal(signal.SIGINT)), "sigterm": str(signal.getsignal(signal.SIGTERM)),
    "dont_write_bytecode": sys.dont_write_bytecode,
    "start_method": multiprocessing.get_start_method(allow_none=True),
}))
print("to stderr", file=sys.stderr)
sys.exit(3)
"""


def test_a_warm_process_is_what_a_fresh_interpreter_would_be(tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    env = helpers.engine_env(PROBE="x y", PYTHONPATH=f"{tmp_path / 'lib'}:{helpers.REPO}")
    for threads in ("1", "2"):
        env["OMP_NUM_THREADS"] = threads
        assert warm.usable(env)
        forked = warm.run("probe", ["a", "--b"], env, tmp_path, timeout=60)
        cold = subprocess.run(
            [sys.executable, "-m", "probe", "a", "--b"], cwd=tmp_path, env=env,
            capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60,
        )  # fmt: skip
        assert (
            (forked.returncode, forked.stderr)
            == (cold.returncode, cold.stderr)
            == (3, "to stderr\n")
        )
        seen = json.loads(forked.stdout)
        assert seen == json.loads(cold.stdout)
        assert seen["threads"] == int(threads) and seen["argv"] == ["a", "--b"]
        # a DataLoader's workers fork, as in a fresh interpreter, not from a fork server
        assert seen["start_method"] is None


def test_the_server_starts_with_the_test_process_environment_not_a_tests(monkeypatch):
    """A test's TORCH_LOGS (or CUDA_VISIBLE_DEVICES) when the first command starts is not the
    server's: otherwise every later command would differ from it and start cold."""
    monkeypatch.setattr(warm, "_server_env", None)
    monkeypatch.setenv("TORCH_LOGS", "dynamo")
    assert "TORCH_LOGS" not in warm.server_env() or warm.STARTED_WITH.get("TORCH_LOGS")
    assert not warm.usable(helpers.engine_env())  # torch reads TORCH_LOGS as it is imported
    monkeypatch.undo()
    assert warm.usable(helpers.engine_env())


def test_what_a_fresh_interpreter_would_read_otherwise_starts_cold(tmp_path):
    assert warm.usable(helpers.engine_env())
    assert not warm.usable(helpers.engine_env(TORCH_LOGS="dynamo"))
    assert warm.usable(helpers.engine_env(TORCH_HOME=str(tmp_path)))  # read when used
    assert not warm.usable(helpers.engine_env(TESTS_COLD_PROCESSES="1"))
    (tmp_path / "sitecustomize.py").write_text("import os\nos.environ['X'] = '1'\n")
    assert not warm.usable(helpers.engine_env(PYTHONPATH=f"{tmp_path}:{helpers.REPO}"))


HIDING = """\
import json
import torch
found = []
for name in ("wandb", "numpy"):
    try:
        __import__(name)
        found.append(name)
    except ImportError as err:
        found.append(str(err))
try:
    found.append(str(type(torch.zeros(1).numpy())))  # torch's numpy, bound at its import
except RuntimeError as err:
    found.append(str(err))
print(json.dumps(found))
"""


def test_a_startup_hook_that_hides_modules_acts_as_at_an_interpreter_s_start(tmp_path):
    """A sitecustomize that only hides modules (as tests/engine/test_optional_deps.py stands
    in for a machine without wandb) runs in the forked process as the interpreter's start
    would run it; one that hides a module the server imported (numpy: torch's) makes the
    forked process a fresh interpreter (exec), where that module is hidden as it should be."""
    (tmp_path / "probe.py").write_text(HIDING)
    for hidden in (["wandb"], ["wandb", "numpy"]):
        site = tmp_path / "-".join(hidden)
        site.mkdir()
        lines = ["import sys", *(f"sys.modules[{name!r}] = None" for name in hidden)]
        (site / "sitecustomize.py").write_text("\n".join(lines) + "\n")
        assert warm.hidden_modules(site / "sitecustomize.py") == hidden
        env = helpers.engine_env(PYTHONPATH=f"{site}:{tmp_path}")
        assert warm.usable(env)
        forked = warm.run("probe", [], env, tmp_path, timeout=60)
        cold = subprocess.run(
            [sys.executable, "-m", "probe"], cwd=tmp_path, env=env, capture_output=True,
            text=True, stdin=subprocess.DEVNULL, timeout=60,
        )  # fmt: skip
        assert (forked.returncode, forked.stdout) == (cold.returncode, cold.stdout), forked
        found = json.loads(forked.stdout)
        assert found[0] == "import of wandb halted; None in sys.modules"
        assert (found[1] == "numpy") == ("numpy" not in hidden)
        assert (found[2] == "Numpy is not available") == ("numpy" in hidden)  # not the server's


def test_a_run_that_compiles_starts_cold_and_one_that_only_checks_does_not(tmp_path):
    """inductor's compile workers hung in a forked process: an override, a variant (cifar10's
    fast.yaml) or a config file asking for torch.compile starts a fresh interpreter."""
    env = helpers.engine_env()
    (tmp_path / "c.yaml").write_text("recipe: digits\ntrain:\n  compile: on\n")
    for argv in (
        ["digits", "train.compile=on"], ["--spawn", "2", "digits", "train.compile=true"],
        ["cifar10", "--config", "fast"], ["digits", "--config", "c.yaml"],
    ):  # fmt: skip
        assert not warm.usable(env, engine_argv=argv, cwd=tmp_path), argv
    for argv in (
        ["digits"], ["digits", "train.compile=auto"], ["cifar10", "--config", "fast", "--check", "1"],
        ["cifar10", "--config", "fast", "train.compile=off"],
    ):  # fmt: skip
        assert warm.usable(env, engine_argv=argv, cwd=tmp_path), argv


# A fake engine whose check refuses with what it saw (tests.helpers.fake_checkout).
REFUSING_CHECK = """\
import json, os, sys
seen = {"argv": sys.argv[1:], "orig_argv": sys.orig_argv[1:], "cwd": os.getcwd(),
        "path": sys.path, "record": os.environ.get("FAKE_RECORD"),
        "launch_loaded": "launch" in sys.modules, "preloaded": "torchvision" in sys.modules}
print("error: " + json.dumps(seen), file=sys.stderr)
sys.exit(2)
"""


def test_a_check_forked_inside_a_warm_launch_answers_as_a_cold_one(tmp_path, monkeypatch):
    checkout = helpers.fake_checkout(tmp_path / "checkout", REFUSING_CHECK, "seed: 0\n")
    request = {"GPUS": "0", "PROCS": "2", "FAKE_RECORD": "r", "ARGS": "run.name=w optim.lr=0.2"}
    forked = helpers.launch("train", cwd=checkout, **request)
    monkeypatch.setenv("TESTS_COLD_PROCESSES", "1")
    cold = helpers.launch("train", cwd=checkout, **request)
    assert forked.returncode == cold.returncode == 2 and forked.stdout == cold.stdout == ""
    said = [
        json.loads(done.stderr.removeprefix("launch: ").split(" (config checked")[0])
        for done in (forked, cold)
    ]
    assert [seen.pop("preloaded") for seen in said] == [True, False]  # the first was forked
    assert said[0] == said[1] and "--check" in said[0]["argv"], said
    assert not said[0]["launch_loaded"]  # the check's modules are its own, imported fresh


MEMBER = """\
import json, os, subprocess, sys
from tests import warm
if os.environ.get("FORK"):
    subprocess.Popen = warm.ForkingPopen  # as in a forked `python -m launch`
argv = [sys.executable, "-m", "engine.train", *sys.argv[1:]]
child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, process_group=0)
group = os.getpgid(child.pid)
out = child.stdout.read().decode()
print(json.dumps({"code": child.wait(), "out": out, "own_group": group == child.pid,
                  "forked": child.pid in warm.ForkingPopen.forked}))
"""


def test_a_forked_launch_forks_the_engine_commands_it_starts_as_they_would_run(tmp_path):
    """A sweep's members and a claim's rerun: launch starts `python -m engine.train ...` with
    subprocess.Popen, which a forked launch forks warm too; the command's output, exit code
    and process group are what the fresh interpreter gives."""
    (tmp_path / "member.py").write_text(MEMBER)
    env = helpers.engine_env(PYTHONPATH=f"{tmp_path}:{helpers.REPO}")
    for engine_argv in (["digits", "--print-config", "optim.lr=0.05"], ["digits", "optim.lrr=1"]):
        forked = warm.run("member", engine_argv, env | {"FORK": "1"}, helpers.REPO, timeout=60)
        cold = subprocess.run(
            [sys.executable, "-m", "member", *engine_argv], cwd=helpers.REPO, env=env,
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert forked.returncode == cold.returncode == 0, forked.stderr + cold.stderr
        seen, fresh = json.loads(forked.stdout), json.loads(cold.stdout)
        assert seen["forked"] and not fresh["forked"]
        assert {**seen, "forked": 0} == {**fresh, "forked": 0}
        assert seen["own_group"] and seen["code"] == (0 if "--print-config" in engine_argv else 2)


SPAWNING = """\
import multiprocessing, os, sys
from engine.rank import report
if __name__ == "__main__":
    os.environ["PROBE"] = "set before the spawn"
    if "--late" in sys.argv:  # read at an interpreter's start: the server must start fresh
        os.environ["PYTHONHASHSEED"] = "7"
    multiprocessing.set_forkserver_preload(["torch", "preload_marker"])  # marker: not found
    rank = multiprocessing.get_context("forkserver").Process(target=report)
    rank.start()
    rank.join()
    sys.exit(rank.exitcode)
"""
RANK = """\
import json, os, signal, sys
def report():
    server = open(f"/proc/{os.getppid()}/cmdline", "rb").read()
    print(json.dumps({
        "cwd": os.getcwd(), "probe_env": os.environ.get("PROBE"), "path": sys.path,
        "hash_seed": os.environ.get("PYTHONHASHSEED"), "torch": "torch" in sys.modules,
        "sigint": str(signal.getsignal(signal.SIGINT)), "fresh_server": b"preload_marker" in server,
    }), flush=True)
"""


def test_the_fork_server_of_a_warm_spawn_serves_as_a_fresh_one(tmp_path):
    """`engine.train --spawn` forked warm gets its fork server forked from itself at its start
    (torch imported once per test process, not once per run): its processes see what those of
    the library's fresh server see (the environment and folder of the moment they are asked
    for, the import path, the handlers); an environment changed by then in what an
    interpreter's start reads gets the library's fresh server."""
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "__init__.py").write_text("")
    (tmp_path / "engine" / "train.py").write_text(SPAWNING)
    (tmp_path / "engine" / "rank.py").write_text(RANK)
    env = helpers.engine_env(PROBE="at the start", PYTHONPATH=str(tmp_path))
    for late in ([], ["--late"]):
        argv = ["--spawn", "2", *late]
        forked = warm.run("engine.train", argv, env, tmp_path, timeout=60)
        cold = subprocess.run(
            [sys.executable, "-m", "engine.train", *argv], cwd=tmp_path, env=env,
            capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60,
        )  # fmt: skip
        assert forked.returncode == cold.returncode == 0, forked.stderr + cold.stderr
        seen, fresh = json.loads(forked.stdout), json.loads(cold.stdout)
        assert seen.pop("fresh_server") == bool(late) and fresh.pop("fresh_server")
        assert seen == fresh and seen["probe_env"] == "set before the spawn" and seen["torch"]
