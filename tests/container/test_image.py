"""The image, built and run by this project's own commands on a real docker engine.

`make image` builds it from a local base (CONTAINER_BASE_IMAGE: the CUDA base needs a
registry; docker/debootstrap-base.sh makes a Debian bookworm one), with a CA bundle and a pip
index that carries a credential, both passed as BuildKit secrets. Then, as a non-root caller:
`make docker-train` equals the venv's run of the same request bit for bit, on one process and
on two under torchrun, resumes across two `docker run`s, and `make eval` scores the result. A
second build after a source-only change must take the lock layer from the cache.

Figures (build time, image size) are printed, never asserted: docs/container.md states the
budget. `make test-container` runs this module, `.ci/run` as a step of its own; `make test`
deselects it. Without a docker engine it skips, and in CI a skip is a failure.
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import json
import os
import re
import secrets
import shutil
import stat
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import REPO, final_weights, launch_env, same_weights

pytestmark = [pytest.mark.container, pytest.mark.slow]

DOCKER = os.environ.get("DOCKER") or "docker"
BASE = os.environ.get("CONTAINER_BASE_IMAGE", "")
TAG = "recipes-container-test"
NON_ROOT = 1000  # the caller's uid and gid when the tests run as root (CI)
STEPS = "train.max_steps=20"
QUIET = "log.wandb=off log.progress=plain"
SYSTEM_STEP = "apt-get update"
VENV_STEP = "-m venv /opt/venv"
LOCK_STEP = "pip install --no-cache-dir -r /opt/venv/requirements.lock"
SOURCE_STEP = "COPY . /workspace"
BUILD_TIMEOUT_S = 1800
# docs/container.md's budget on the 2-core CI machine: printed against, never asserted.
BUILD_BUDGET_S = 900
SIZE_BUDGET_GB = 9.0


def docker(*args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    out = subprocess.run(
        [DOCKER, *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and out.returncode != 0:
        raise AssertionError(f"{DOCKER} {' '.join(args)}: exit {out.returncode}\n{out.stderr}")
    return out


def figure(line: str) -> None:
    """A measured figure: printed, and kept for .ci/run's Result (CONTAINER_SUMMARY)."""
    print(f"\ncontainer: {line}", flush=True)
    if path := os.environ.get("CONTAINER_SUMMARY"):
        with open(path, "a") as f:
            f.write(line + "\n")


# ---------------------------------------------------------------- what the tests need


@pytest.fixture(scope="module")
def engine_ready():
    """A docker engine that answers, a client with BuildKit, and the base to build on."""
    if shutil.which(DOCKER) is None:
        pytest.skip(f"no docker client ({DOCKER}); install docker (Debian: docker.io)")
    if docker("info", check=False, timeout=60).returncode != 0:
        pytest.skip(f"no docker engine answers {DOCKER}; start dockerd (see .ci/run)")
    probe = subprocess.run(
        [DOCKER, "build", "--help"], capture_output=True, text=True, env=buildkit_env()
    )
    if "--secret" not in probe.stdout:
        pytest.skip(f"{DOCKER} has no BuildKit; set DOCKER to a client that has (or buildx)")
    if not BASE:
        pytest.skip(
            "CONTAINER_BASE_IMAGE is unset: name a local base image, e.g. one made by "
            "docker/debootstrap-base.sh recipes-base:bookworm"
        )
    docker("image", "inspect", BASE)


def buildkit_env() -> dict[str, str]:
    return {**os.environ, "DOCKER_BUILDKIT": "1"}


@dataclass
class Caller:
    """Who runs make: a non-root uid (the tests' own, or NON_ROOT when they run as root)."""

    uid: int
    gid: int
    groups: list[int]  # the docker socket's group, so that this uid may talk to the engine
    home: Path


@dataclass
class Checkout:
    """A copy of the working tree (tracked and untracked files, committed in a git of its
    own), readable by the caller, with the venv linked in: builds may change its source."""

    src: Path
    runs: Path  # run.root of the image's runs, owned by the caller
    venv_runs: Path  # run.root of the venv's runs, the reference
    caller: Caller


@pytest.fixture(scope="module")
def checkout(engine_ready):
    top = Path(tempfile.mkdtemp(prefix="recipes-container-"))
    top.chmod(0o755)
    try:
        caller = make_caller(top)
        src = copy_working_tree(top / "src")
        runs = top / "runs"
        runs.mkdir()
        os.chown(runs, caller.uid, caller.gid)
        yield Checkout(src, runs, top / "venv-runs", caller)
    finally:
        shutil.rmtree(top, ignore_errors=True)


def make_caller(top: Path) -> Caller:
    uid, gid = (NON_ROOT, NON_ROOT) if os.getuid() == 0 else (os.getuid(), os.getgid())
    home = top / "home"
    home.mkdir()
    os.chown(home, uid, gid)
    socket = Path("/var/run/docker.sock")
    groups = [socket.stat().st_gid] if os.getuid() == 0 and socket.exists() else []
    return Caller(uid, gid, groups, home)


def copy_working_tree(dest: Path) -> Path:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = REPO / name
        if source.is_file() and not source.is_symlink():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)  # keeps mtimes: the venv stays newer than the lock
    (dest / ".venv").symlink_to(REPO / ".venv")
    commit_all(dest, "the working tree under test")
    for path in [dest, *dest.rglob("*")]:
        if path.is_dir() and not path.is_symlink():
            path.chmod(path.stat().st_mode | stat.S_IRWXU | 0o055)
    return dest


def commit_all(repo: Path, message: str) -> None:
    ident = ["-c", "user.name=container test", "-c", "user.email=test@localhost"]
    if not (repo / ".git").exists():
        subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(repo), *ident, "commit", "-qm", message], check=True)


def make(co: Checkout, target: str, timeout: float = 600, caller: bool = True, **variables: str):
    """`make TARGET` in the copy, with only the request variables given: as the caller, or
    (caller=False) as this process, for what runs the host's interpreter directly (make train,
    make eval: launch's check that a program may run, like make's, ignores capabilities)."""
    c = co.caller
    env = launch_env(HOME=str(c.home), **variables)
    env["GIT_CONFIG_COUNT"] = "1"  # git as the caller trusts the copy, which root owns
    env["GIT_CONFIG_KEY_0"], env["GIT_CONFIG_VALUE_0"] = "safe.directory", str(co.src)
    who = [*as_caller(c), "make", *recipe_shell()] if caller else ["make"]
    return subprocess.run(
        [*who, "--no-print-directory", target],
        cwd=co.src,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def as_caller(c: Caller) -> list[str]:
    """From root (CI), the caller's uid and gid and the docker socket's group, keeping one
    capability: to read and search any file (CI's interpreter may live in root's 0700 home).
    The caller still cannot write anything root owns, so what it writes is its own."""
    if os.getuid() != 0:
        return []
    keep = ["--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]
    groups = f"--groups={','.join(map(str, c.groups))}" if c.groups else "--clear-groups"
    return ["setpriv", f"--reuid={c.uid}", f"--regid={c.gid}", groups, *keep]


def recipe_shell() -> list[str]:
    """From root, make runs its recipes through bash: make's own check before it starts a
    program directly (access(2)) ignores capabilities, the kernel's exec does not."""
    return ["SHELL=/bin/bash"] if os.getuid() == 0 else []


def head(repo: Path) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()


def succeeded(done: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert done.returncode == 0, (
        f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    )
    return done


# ---------------------------------------------------------------- a pip index with a credential


class StubIndex(http.server.BaseHTTPRequestHandler):
    """An extra pip index that has no packages and records the credentials it was sent."""

    seen: list[str] = []

    def do_GET(self):  # noqa: N802 (http.server's name)
        auth = self.headers.get("Authorization", "")
        if auth.startswith("Basic "):
            StubIndex.seen.append(base64.b64decode(auth[6:]).decode(errors="replace"))
        self.send_error(404)

    def log_message(self, *args):  # quiet
        pass


@pytest.fixture(scope="module")
def site(checkout):
    """A CA bundle (the host's, with a marker) and an extra index URL with a token."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), StubIndex)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    token = f"tok-{secrets.token_hex(12)}"
    marker = f"recipes-ca-marker-{secrets.token_hex(8)}"
    host_bundle = Path(os.environ.get("CA_BUNDLE") or "/etc/ssl/certs/ca-certificates.crt")
    bundle = checkout.src.parent / "ca.pem"  # where the caller can read it
    bundle.write_text(host_bundle.read_text() + f"\n# {marker}\n")
    bundle.chmod(0o644)
    yield {
        "token": token,
        "marker": marker,
        "CA_BUNDLE": str(bundle),
        "PIP_EXTRA_INDEX_URL": f"http://ci-user:{token}@127.0.0.1:{server.server_port}/simple",
        "PIP_TRUSTED_HOST": "127.0.0.1",
    }
    server.shutdown()


# ---------------------------------------------------------------- the build


@dataclass
class Build:
    image: str
    output: str
    seconds: float


def build_image(co: Checkout, site: dict, image: str) -> Build:
    variables = {k: v for k, v in site.items() if k.isupper()}
    started = time.monotonic()
    done = make(
        co, "image", timeout=BUILD_TIMEOUT_S, IMAGE=image, BASE_IMAGE=BASE, DOCKER=DOCKER,
        DOCKER_NETWORK="host", BUILDKIT_PROGRESS="plain", **variables,
    )  # fmt: skip
    seconds = time.monotonic() - started
    succeeded(done)
    return Build(image, done.stdout + done.stderr, seconds)


@pytest.fixture(scope="module")
def build(checkout, site):
    StubIndex.seen.clear()
    built = build_image(checkout, site, f"{TAG}:first")
    size = int(docker("image", "inspect", "--format", "{{.Size}}", built.image).stdout)
    lock = "from the cache" if step(built.output, LOCK_STEP) == "CACHED" else "installed"
    within = built.seconds <= BUILD_BUDGET_S and size / 1e9 <= SIZE_BUDGET_GB
    figure(
        f"make image: {built.seconds:.0f} s, image {size / 1e9:.2f} GB "
        f"({built.image} on {BASE}; the lock layer {lock}); "
        f"{'within' if within else 'OVER'} the budget of {BUILD_BUDGET_S} s and "
        f"{SIZE_BUDGET_GB:g} GB (docs/container.md)"
    )
    return built


def steps(output: str) -> dict[str, str]:
    """BuildKit's plain progress: each step's command -> CACHED, DONE or ERROR."""
    names = dict(re.findall(r"^#(\d+) \[[^\]]*\] (.*)$", output, re.M))
    ends = dict(re.findall(r"^#(\d+) (CACHED|DONE [0-9.]+s|ERROR.*)$", output, re.M))
    return {cmd: ends.get(n, "?").split()[0] for n, cmd in names.items()}


def step(output: str, contains: str) -> str:
    (state,) = [s for cmd, s in steps(output).items() if contains in cmd]
    return state


# ---------------------------------------------------------------- secrets stay out of the image


def test_the_index_credential_and_ca_bundle_reach_the_build_but_no_layer(build, site):
    if step(build.output, LOCK_STEP) == "CACHED":
        pytest.skip("the lock layer came from the cache, so pip did not run: docker builder prune")
    assert f"ci-user:{site['token']}" in StubIndex.seen  # pip in the build used the secret
    history = docker("history", "--no-trunc", "--format", "{{.CreatedBy}}", build.image).stdout
    config = docker("image", "inspect", build.image).stdout
    # Where pip or a shell would have left a setting: configs, the venv's scripts, homes.
    files = docker(
        "run", "--rm", "--network=none", "-u", "0", "--entrypoint", "grep", build.image,
        "-rlF", "-e", site["token"], "-e", site["marker"],
        "/etc", "/root", "/tmp", "/workspace", "/opt/venv/pyvenv.cfg", "/opt/venv/bin",
        check=False,
    )  # fmt: skip
    assert files.returncode == 1, files.stdout + files.stderr  # grep: 1 = nothing found
    for text in (history, config, build.output):
        assert site["token"] not in text and site["marker"] not in text
        assert "BEGIN CERTIFICATE" not in text
    assert "PIP_EXTRA_INDEX_URL=" not in history  # not a build argument either


def test_the_dry_run_masks_the_index_credential(checkout, site):
    variables = {k: v for k, v in site.items() if k.isupper()}
    done = succeeded(make(checkout, "image", DRY_RUN="1", DOCKER=DOCKER, **variables))
    shown = done.stdout + done.stderr
    assert site["token"] not in shown
    assert "id=pip_extra_index_url,env=PIP_EXTRA_INDEX_URL" in done.stdout
    assert "http://ci-user:****@127.0.0.1:" in done.stderr


# ---------------------------------------------------------------- runs: the venv and the image


def request(name: str, *more: str) -> str:
    return f"{STEPS} {QUIET} run.name={name} {' '.join(more)}".strip()


def train(co: Checkout, name: str, procs: int = 1, *more: str, image: str = ""):
    """make train (the venv) or make docker-train (the image) of digits on the CPU."""
    args = f"run.root={co.runs if image else co.venv_runs} {request(name, *more)}"
    extra = {"IMAGE": image, "DOCKER": DOCKER, "DOCKER_NETWORK": "host"} if image else {}
    target = "docker-train" if image else "train"
    variables = dict(GPUS="0", PROCS=str(procs), ARGS=args, **extra)
    return succeeded(make(co, target, caller=bool(image), **variables))


@pytest.fixture(scope="module")
def venv_runs(checkout):
    """The reference: the venv's runs of the requests the image runs, on 1 and 2 processes."""
    train(checkout, "venv")
    train(checkout, "venv-2p", 2)
    return checkout.venv_runs


def owners(folder: Path) -> set[tuple[int, int]]:
    return {(p.stat().st_uid, p.stat().st_gid) for p in [folder, *folder.rglob("*")]}


def test_docker_train_runs_as_the_caller_and_equals_the_venv_bitwise(build, checkout, venv_runs):
    done = train(checkout, "image", image=build.image)
    assert f"-u {checkout.caller.uid}:{checkout.caller.gid}" in done.stderr  # the printed command
    run = checkout.runs / "digits" / "image"
    assert owners(run) == {(checkout.caller.uid, checkout.caller.gid)}  # none of it root's
    same = same_weights(final_weights(checkout.runs, "image"), final_weights(venv_runs, "venv"))
    figure(f"docker-train digits ({STEPS}, 1 process): weights equal the venv's bitwise: {same}")
    assert same
    env = json.loads((run / "env.json").read_text())
    lock = hashlib.sha256((checkout.src / "requirements.lock").read_bytes()).hexdigest()
    assert env["image"]["image"] == build.image and env["image"]["base_image"] == BASE
    assert env["image"]["lock_sha256"] == lock == env["lock_sha256"]
    assert env["image"]["git_sha"] == head(checkout.src)  # the commit the image was built from


def test_two_processes_under_torchrun_in_the_container_equal_the_venv(build, checkout, venv_runs):
    done = train(checkout, "image-2p", 2, image=build.image)
    assert "engine.torchrun" in done.stderr and "--nproc_per_node=2" in done.stderr
    env = json.loads((checkout.runs / "digits" / "image-2p" / "env.json").read_text())
    assert env["world_size"] == 2
    same = same_weights(
        final_weights(checkout.runs, "image-2p"), final_weights(venv_runs, "venv-2p")
    )
    figure(f"docker-train digits, 2 processes under torchrun: equal to the venv's bitwise: {same}")
    assert same


def test_a_run_resumes_across_two_docker_runs_bitwise(build, checkout, venv_runs):
    first = train(checkout, "resumed", 1, "train.stop_at_step=9", image=build.image)
    assert "stopped at step 9" in first.stderr
    second = train(checkout, "resumed", image=build.image)
    assert "resuming from" in second.stderr
    same = same_weights(final_weights(checkout.runs, "resumed"), final_weights(venv_runs, "venv"))
    figure(f"docker-train stopped at step 9, resumed in a second docker run: bitwise: {same}")
    assert same


def test_make_eval_scores_the_containers_run_as_it_trained(build, checkout, venv_runs):
    run = checkout.runs / "digits" / "image"
    if not run.exists():
        train(checkout, "image", image=build.image)
    out = checkout.src.parent / "image.eval.json"
    succeeded(make(checkout, "eval", caller=False, CKPT=str(run), OUT=str(out)))
    scored = json.loads(out.read_text())
    summary = json.loads((run / "summary.json").read_text())
    figure(f"make eval of the container's run: top1 {scored['metrics']['top1']:.4f}")
    assert scored["step"] == 20 and scored["metrics"]["top1"] == summary["top1"]


# ---------------------------------------------------------------- the cache across builds


def test_a_source_change_rebuilds_only_the_source_layer(build, checkout, site):
    """Last: it changes the copy's source. The lock layer (torch) must come from the cache."""
    changed = checkout.src / "engine" / "__init__.py"
    changed.write_text(changed.read_text() + "# a source-only change\n")
    commit_all(checkout.src, "a source-only change")
    again = build_image(checkout, site, f"{TAG}:changed")
    figure(f"make image after a source-only change: {again.seconds:.1f} s")
    found = steps(again.output)
    for cached in (SYSTEM_STEP, VENV_STEP, LOCK_STEP):
        assert step(again.output, cached) == "CACHED", (cached, found)
    assert step(again.output, SOURCE_STEP) == "DONE", found
    figure("second build: the system, venv and lock layers CACHED, the source layer rebuilt")
    docker("image", "rm", again.image, check=False)
