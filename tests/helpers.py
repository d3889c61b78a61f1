"""Shared by the tests: run the engine in a real process and read what it left behind."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import torch

from launch import variables
from tests import warm

REPO = Path(__file__).resolve().parent.parent
QUIET = ["log.wandb=off", "log.progress=plain", "device=cpu"]
# What launch reads from the environment (launch/cli.py's docstring) and make's own variables:
# a launch test sets the ones it means and inherits none from the shell that runs it.
REQUEST_VARS = variables.KNOWN | {"MAKEFLAGS", "MAKELEVEL", "MFLAGS"}


def engine_env(**extra: str) -> dict[str, str]:
    """The environment a user's shell would give: no rank variables, no W&B credentials."""
    drop = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "WANDB_API_KEY")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("SLURM_")}
    return env | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"} | extra


def launch_env(base: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
    """base (this process's environment) without the request variables, then extra."""
    base = dict(os.environ) if base is None else base
    return {k: v for k, v in base.items() if k not in REQUEST_VARS} | extra


def launch(*args: str, cwd: Path = REPO, timeout: float = 60, **env: str):
    """`python -m launch ARGS` with only the request variables given here (forked warm, its
    engine checks too: tests.warm)."""
    env = launch_env(**env)
    if warm.usable(env):
        return warm.run("launch", list(args), env, cwd, timeout)
    return subprocess.run(
        [sys.executable, "-m", "launch", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def engine_here(*args: str, cwd: Path = REPO, env: dict | None = None):
    """`python -m engine.train ARGS` that resolves, checks or prints help, run in this process:
    engine.cli.main (the command line's own code) under that command's environment (default
    engine_env()) and working folder, its exit code and output captured as a process's. A
    process of its own would spend ~5 s importing torch; tests of the command line as a
    process (its exit, a traceback, signals) start one."""
    from engine import cli

    out, err = io.StringIO(), io.StringIO()
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    # A run refused after it installed its stop-signal handlers: they end with its process
    saved_handlers = {
        sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)
    }
    os.environ.clear()
    os.environ.update(engine_env() if env is None else env)
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(list(args))
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)
        for sig, handler in saved_handlers.items():
            signal.signal(sig, handler)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def torchrun(n: int) -> list[str]:
    """The engine under torchrun with n local processes (a standalone rendezvous)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={n}",
        "-m",
        "engine.train",
    ]


def engine_process(*args: str, env=None, cwd: Path = REPO, timeout: float = 300):
    """`python -m engine.train ARGS`, a process of its own, its output captured: forked from a
    warm interpreter where nothing at its start would differ (tests/warm.py)."""
    env = env or engine_env()
    if warm.usable(env, engine_argv=args, cwd=cwd):
        return warm.run("engine.train", list(args), env, cwd, timeout)
    return subprocess.run(
        [sys.executable, "-m", "engine.train", *args], cwd=cwd, capture_output=True, text=True,
        timeout=timeout, env=env,
    )  # fmt: skip


def run_engine(
    root: Path,
    name: str,
    *overrides: str,
    prefix=None,
    check=True,
    timeout=300,
    env=None,
    recipe: str = "digits",
    variant: str = "",
    cwd: Path = REPO,
):
    """A run of RECIPE under QUIET in root/RECIPE/NAME: `python -m engine.train` (or prefix,
    e.g. torchrun, then the same arguments); check: an exit other than 0 fails the test."""
    engine = [sys.executable, "-m", "engine.train"]
    head = [recipe, *(["--config", variant] if variant else [])]
    argv = [*head, *QUIET, f"run.root={root}", f"run.name={name}", *overrides]
    if prefix is None or prefix[:3] == engine:  # --spawn N: its workers start fresh
        out = engine_process(*(prefix or engine)[3:], *argv, env=env, cwd=cwd, timeout=timeout)
    else:
        out = subprocess.run(
            [*prefix, *argv], cwd=cwd, capture_output=True, text=True, timeout=timeout,
            env=env or engine_env(),
        )  # fmt: skip
    if check and out.returncode != 0:
        raise AssertionError(f"exit {out.returncode}\n{out.stdout}\n{out.stderr[-4000:]}")
    return out


class PicklePayload:
    """Unpickling this runs code (it creates the marker file): what a tampered checkpoint
    holds. weights_only=True must refuse it without running it."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def run_dir(root: Path, name: str, recipe: str = "digits") -> Path:
    return root / recipe / name


def final_checkpoint(root: Path, name: str, recipe: str = "digits") -> dict:
    newest = max((run_dir(root, name, recipe) / "checkpoints").glob("step-*.pt"))
    return torch.load(newest, map_location="cpu", weights_only=True)


def final_weights(root: Path, name: str, recipe: str = "digits") -> dict[str, torch.Tensor]:
    return final_checkpoint(root, name, recipe)["model"]


def records(root: Path, name: str, kind: str, recipe: str = "digits") -> list[dict]:
    lines = (run_dir(root, name, recipe) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def max_difference(a: dict, b: dict) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def read_wandb_history(run_file: Path) -> tuple[str, list[dict]]:
    """Parse an offline W&B transaction log (LevelDB-style log of protobuf Records) without
    the W&B service: the run id and every history row, values decoded from JSON."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", "not a W&B transaction log"
    payloads, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:  # block trailer
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # FULL or LAST
            payloads.append(pending)
    run_id, rows = "", []
    for payload in payloads:
        rec = pb.Record()
        rec.ParseFromString(payload)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run_id = rec.run.run_id
        elif kind == "history":
            rows.append(
                {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in rec.history.item
                }
            )
    return run_id, rows


TORCH_FREE_ENGINE = (
    "config",
    "catalog.py",
    "recipe.py",  # the recipe contract, which catalog reads (torch-free)
    "rundir.py",
    "results.py",
    "redact.py",
    "preempt.py",
    "codeid.py",
    "hardware_keys.py",  # the names of the facts that change bits (launch.hardware)
)


def copy_torch_free_engine(root: Path) -> None:
    """The engine modules launch imports outside the SLURM job (a module or a package)."""
    import shutil

    (root / "engine").mkdir()
    (root / "engine" / "__init__.py").write_text("")
    for shared in TORCH_FREE_ENGINE:
        source = REPO / "engine" / shared
        if (REPO / "engine" / f"{shared}.py").exists():  # config: one module or a package
            source = REPO / "engine" / f"{shared}.py"
        if source.is_dir():
            shutil.copytree(
                source, root / "engine" / shared, ignore=shutil.ignore_patterns("__py*")
            )
        else:
            shutil.copy(source, root / "engine" / source.name)


def git(repo: Path, *args: str) -> str:
    """git in repo as a test's author; its output."""
    who = ["-c", "user.name=test", "-c", "user.email=test@example.invalid"]
    done = subprocess.run(["git", *who, *args], cwd=repo, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def git_checkout(dest: Path) -> Path:
    """A git repository of its own holding this checkout's code as it is now (uncommitted
    changes included, in one commit): for tests that change the code under a run."""
    import shutil

    from launch import snapshot

    for name in snapshot.files(REPO):
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, dest / name, follow_symlinks=False)
    git(dest, "init", "-q")
    git(dest, "add", "-A")
    git(dest, "commit", "-q", "-m", "base")
    return dest


# engine.resolved's stand-in in a fake checkout: each member's "config" is its argv.
FAKE_RESOLVED = """\
import json, sys
given = json.load(sys.stdin)
if "--compare" in sys.argv:  # a stand-in: every member is the request it was
    json.dump([[] for _ in given], sys.stdout)
else:
    json.dump(["# " + " ".join(argv) + "\\n" for argv in given], sys.stdout)
"""


def fake_checkout(root: Path, fake_train: str, recipe_config: str) -> Path:
    """A copy of launch/ (and the torch-free engine modules it shares: the config schema,
    recipe discovery, run names, result names, redaction) beside a fake engine.train and one recipe, so
    launch's real subprocess path can be run cheaply."""
    import shutil

    shutil.copytree(REPO / "launch", root / "launch", ignore=shutil.ignore_patterns("__py*"))
    copy_torch_free_engine(root)
    (root / "engine" / "train.py").write_text(fake_train)
    (root / "engine" / "resolved.py").write_text(FAKE_RESOLVED)
    (root / "recipes" / "digits").mkdir(parents=True)
    (root / "recipes" / "digits" / "config.yaml").write_text(recipe_config)
    return root


def cache_stand_in_weights(name: str, arch: str, torch_home: Path, seed: int = 0) -> Path:
    """A stand-in for torchvision's published weights `name` (no test touches the network):
    a seeded `arch` with the weights' class count, saved as torchvision's weights API caches
    it, $TORCH_HOME/hub/checkpoints/<the URL's file name>."""
    import torchvision

    entry = torchvision.models.get_weight(name)
    path = torch_home / "hub" / "checkpoints" / Path(entry.url).name
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    classes = len(entry.meta["categories"])
    torch.save(torchvision.models.get_model(arch, num_classes=classes).state_dict(), path)
    return path


def backend_flags() -> tuple:
    return (
        torch.get_float32_matmul_precision(),
        torch.backends.cudnn.allow_tf32,
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.deterministic,
        torch.are_deterministic_algorithms_enabled(),
    )


def set_backend_flags(saved: tuple) -> None:
    torch.set_float32_matmul_precision(saved[0])
    torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = saved[1:3]
    torch.backends.cudnn.deterministic = saved[3]
    torch.use_deterministic_algorithms(saved[4])
