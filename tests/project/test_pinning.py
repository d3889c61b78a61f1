"""One source of truth for versions, and nothing floating.

The checking functions below read the Dockerfile, requirements.lock, the GitHub workflows and
the running venv; each returns a list of problems (empty: all agree). The tests run them on
the repository's files, then on copies with a planted drift to prove that each check bites.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[2]
LOCK = "requirements.lock"
AGREE = (
    "torch",
    "torchvision",
    "torchcodec",
)  # versions that must agree in Dockerfile, lock and venv
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
FULL_VERSION = re.compile(r"v?\d+\.\d+\.\d+")  # a tag or ref must start with major.minor.patch
COMMIT_SHA = re.compile(r"[0-9a-f]{40}")
INDEX_OPTIONS = ("-i", "--index-url", "--extra-index-url", "-f", "--find-links")


# ---------------------------------------------------------------- reading the files


def instructions(dockerfile: str) -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    out: list[str] = []
    current = ""
    for raw in dockerfile.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        out.append(current + line)
        current = ""
    if current:
        out.append(current)
    return out


def keyword(instruction: str) -> str:
    return instruction.split(maxsplit=1)[0].upper()


def arg_defaults(dockerfile: str) -> dict[str, str]:
    """ARG name -> default; the first declaration with a default wins."""
    args: dict[str, str] = {}
    for ins in instructions(dockerfile):
        if keyword(ins) == "ARG":
            name, _, default = ins.split(maxsplit=1)[1].partition("=")
            if "=" in ins and name not in args:
                args[name] = default.strip().strip('"')
    return args


_VAR = re.compile(r"\$\{(\w+)(?::([+-])([^}]*))?\}|\$(\w+)")


def expand(word: str, args: dict[str, str]) -> str:
    """Dockerfile variable substitution: $X, ${X}, ${X:+word}, ${X:-word}."""

    def one(m: re.Match) -> str:
        value = args.get(m[1] or m[4], "")
        if m[2] == "+":
            return expand(m[3], args) if value else ""
        if m[2] == "-":
            return value or expand(m[3], args)
        return value

    return _VAR.sub(one, word)


def base_images(dockerfile: str) -> list[str]:
    """Every image the build pulls: FROM lines and COPY --from=<image>, ARGs expanded."""
    args = arg_defaults(dockerfile)
    stages: set[str] = set()
    images: list[str] = []
    for ins in instructions(dockerfile):
        words = ins.split()
        if keyword(ins) == "FROM":
            words = [w for w in words[1:] if not w.startswith("--")]
            ref = expand(words[0], args)
            if ref not in stages and ref != "scratch":
                images.append(ref)
            if len(words) >= 3 and words[1].upper() == "AS":
                stages.add(words[2])
        elif keyword(ins) == "COPY":
            for w in words[1:]:
                ref = w.removeprefix("--from=")
                if w.startswith("--from=") and ref not in stages and not ref.isdigit():
                    images.append(expand(ref, args))
    return images


def lock_versions(lock: str) -> dict[str, str]:
    out = {}
    for line in lock.splitlines():
        name, sep, version = line.partition("==")
        if sep and not line.startswith("#"):
            out[canonical(name)] = version.strip()
    return out


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower().strip()


def venv_versions(names=AGREE) -> dict[str, str]:
    return {name: importlib.metadata.version(name) for name in names}


def venv_torch_cuda() -> str | None:
    """torch.version.cuda of the venv's torch, read from its version.py (no torch import)."""
    spec = importlib.util.find_spec("torch")
    assert spec and spec.submodule_search_locations, "torch is not installed in this venv"
    text = (Path(spec.submodule_search_locations[0]) / "version.py").read_text()
    m = re.search(r"^cuda\b[^=]*=\s*'([^']+)'", text, re.M)
    return m[1] if m else None


# ---------------------------------------------------------------- the checks


def image_problem(ref: str) -> str | None:
    """None when ref names an exact, fully versioned tag (and a valid digest, if any)."""
    name, _, digest = ref.partition("@")
    if digest and not DIGEST.fullmatch(digest):
        return f"{ref}: {digest!r} is not a sha256 digest"
    tag = name.rsplit("/", 1)[-1].partition(":")[2]
    if not tag:
        return f"{ref}: no tag (floats as latest)"
    if tag == "latest" or not FULL_VERSION.match(tag):
        return f"{ref}: tag {tag!r} floats; use an exact major.minor.patch tag"
    return None


def action_problem(uses: str) -> str | None:
    if uses.startswith("./"):
        return None
    if uses.startswith("docker://"):
        return image_problem(uses.removeprefix("docker://"))
    ref = uses.partition("@")[2]
    if COMMIT_SHA.fullmatch(ref) or FULL_VERSION.fullmatch(ref):
        return None
    return f"{uses}: {ref or 'no ref'!r} floats; pin a full tag (v1.2.3) or a commit SHA"


def _images_of(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict) and isinstance(value.get("image"), str):
        return [value["image"]]
    return []


def workflow_problems(workflow: str) -> list[str]:
    """Floating actions, containers, services or runners in one GitHub workflow."""
    problems = []
    for job_id, job in (yaml.safe_load(workflow).get("jobs") or {}).items():
        runners = job.get("runs-on", [])
        for runner in [runners] if isinstance(runners, str) else runners:
            if "${{" not in runner and runner.endswith("-latest"):
                problems.append(f"job {job_id}: runs-on {runner} floats; name the version")
        images = _images_of(job.get("container"))
        for service in (job.get("services") or {}).values():
            images += _images_of(service)
        problems += [f"job {job_id}: {p}" for p in map(image_problem, images) if p]
        uses = [job["uses"]] if "uses" in job else []
        uses += [step["uses"] for step in job.get("steps", []) if "uses" in step]
        problems += [f"job {job_id}: {p}" for p in map(action_problem, uses) if p]
    return problems


def dockerfile_pin_problems(dockerfile: str) -> list[str]:
    """Floating base images or a malformed recorded digest."""
    problems = [p for p in map(image_problem, base_images(dockerfile)) if p]
    digest = arg_defaults(dockerfile).get("BASE_DIGEST", "")
    if digest and not DIGEST.fullmatch(digest):
        problems.append(f"ARG BASE_DIGEST={digest} is not a sha256 digest")
    if "BASE_IMAGE" not in arg_defaults(dockerfile):
        problems.append("no ARG BASE_IMAGE=<image:tag>")
    return problems


def _pip_installs(run: str) -> list[list[str]]:
    """The argument lists of every `pip install` in a RUN instruction."""
    out = []
    for segment in re.split(r"&&|\|\||;|\|", run):
        words = shlex.split(segment) if "pip install" in segment else []
        if words:
            out.append(words[words.index("install") + 1 :])
    return out


def install_path_problems(dockerfile: str, lock: dict[str, str]) -> list[str]:
    """The image must install the lock file itself, and nothing unpinned or off-lock."""
    args = arg_defaults(dockerfile)
    copied = [
        ins.split()[-1]
        for ins in instructions(dockerfile)
        if keyword(ins) == "COPY" and LOCK in ins.split()[1:-1]
    ]
    problems = [] if copied else [f"the Dockerfile does not COPY {LOCK}"]
    installed_lock = False
    for ins in instructions(dockerfile):
        if keyword(ins) != "RUN":
            continue
        for words in _pip_installs(expand(ins, args)):
            flag = None
            for word in words:
                if flag in ("-r", "--requirement"):
                    if word in copied:
                        installed_lock = True
                    else:
                        problems.append(f"pip installs {word}, not the copied {LOCK}")
                elif flag in INDEX_OPTIONS or word.startswith(INDEX_OPTIONS[1:]):
                    problems.append(
                        f"pip uses another index ({word}): the lock's wheels are PyPI's"
                    )
                elif not word.startswith("-") and flag not in ("-c", "--constraint"):
                    problems += _spec_problems(word, lock)
                flag = word if word.startswith("-") and "=" not in word else None
    if not installed_lock:
        problems.append(f"no `pip install -r {LOCK}` in the Dockerfile")
    return problems


def _spec_problems(spec: str, lock: dict[str, str]) -> list[str]:
    name, sep, version = spec.partition("==")
    if not sep:
        return [f"pip installs {spec} unpinned"]
    locked = lock.get(canonical(name))
    if locked is not None and locked != version:
        return [f"Dockerfile pins {name}=={version} but the lock has {locked}"]
    if canonical(name) in AGREE and locked is None:
        return [f"Dockerfile pins {spec}, which is not in the lock"]
    return []


def version_problems(dockerfile: str, lock_text: str, venv: dict[str, str]) -> list[str]:
    """torch and torchvision: the Dockerfile's install path, the lock and the venv agree."""
    lock = lock_versions(lock_text)
    problems = install_path_problems(dockerfile, lock)
    for name in AGREE:
        if name not in lock:
            problems.append(f"{name} is not in {LOCK}")
        elif venv.get(name) != lock[name]:
            problems.append(f"{name}: {LOCK} has {lock[name]}, the venv {venv.get(name)}")
    return problems


def cuda_problems(dockerfile: str, lock_text: str, torch_cuda: str | None) -> list[str]:
    """The base image's CUDA = the lock's CUDA runtime wheel = the venv torch's CUDA."""
    base = expand(arg_defaults(dockerfile).get("BASE_IMAGE", ""), arg_defaults(dockerfile))
    m = re.search(r":(\d+\.\d+)\.\d+", base)
    runtime = lock_versions(lock_text).get("nvidia-cuda-runtime", "")
    found = {
        f"base image {base}": m[1] if m else None,
        "lock nvidia-cuda-runtime": ".".join(runtime.split(".")[:2]) or None,
        "venv torch.version.cuda": torch_cuda,
    }
    if len(set(found.values())) == 1 and None not in found.values():
        return []
    return ["CUDA versions disagree: " + ", ".join(f"{k} {v}" for k, v in found.items())]


def python_problems(dockerfile: str, venv_minor: str, requires_python: str) -> list[str]:
    image = arg_defaults(dockerfile).get("PYTHON_VERSION")
    problems = []
    if image != venv_minor:
        problems.append(f"the image installs Python {image}, the venv runs {venv_minor}")
    if f"{venv_minor}.0" not in SpecifierSet(requires_python):
        problems.append(f"pyproject requires-python {requires_python} excludes {venv_minor}")
    return problems


def layout_problems(dockerfile: str, dockerignore: str) -> list[str]:
    """Layer order (a code change must not reinstall torch), user, workdir, ignored paths."""
    ins = instructions(dockerfile)

    def first(pred, default: int) -> int:
        return next((i for i, x in enumerate(ins) if pred(x)), default)

    lock_install = first(lambda x: keyword(x) == "RUN" and f"-r /opt/venv/{LOCK}" in x, len(ins))
    source_copy = first(lambda x: keyword(x) == "COPY" and x.split()[-2:-1] == ["."], -1)
    git_sha = first(lambda x: keyword(x) == "ARG" and x.split()[1].startswith("GIT_SHA"), -1)
    problems = []
    if not 0 <= lock_install < source_copy:
        problems.append("the source must be copied after the lock is installed")
    if not lock_install < git_sha:
        problems.append("ARG GIT_SHA must come after the lock install (a commit rebuilds torch)")
    users = [x.split()[1] for x in ins if keyword(x) == "USER"]
    if not users or users[-1].split(":")[0] in ("root", "0"):
        problems.append("the image must end as a non-root USER")
    if [x for x in ins if keyword(x) == "WORKDIR"][-1:] != ["WORKDIR /workspace"]:
        problems.append("WORKDIR must be /workspace")
    ignored = {line.strip().strip("/") for line in dockerignore.splitlines()}
    problems += [
        f".dockerignore must list {p}" for p in (".venv", "runs", "data") if p not in ignored
    ]
    return problems


# ---------------------------------------------------------------- the repository agrees


def read(name: str) -> str:
    return (ROOT / name).read_text()


def workflows() -> list[Path]:
    return sorted((ROOT / ".github" / "workflows").glob("*.y*ml"))


def test_dockerfile_lock_and_venv_agree_on_torch_and_torchvision():
    venv = venv_versions()
    assert version_problems(read("Dockerfile"), read(LOCK), venv) == []
    assert lock_versions(read(LOCK))["torch"] == venv["torch"]


def test_base_image_cuda_is_the_torch_wheels_cuda():
    assert cuda_problems(read("Dockerfile"), read(LOCK), venv_torch_cuda()) == []


def test_image_python_is_the_venvs_minor_version():
    minor = f"{sys.version_info.major}.{sys.version_info.minor}"
    requires = tomllib.loads(read("pyproject.toml"))["project"]["requires-python"]
    assert python_problems(read("Dockerfile"), minor, requires) == []


def test_no_base_image_floats():
    assert base_images(read("Dockerfile")), "the Dockerfile names no base image"
    assert dockerfile_pin_problems(read("Dockerfile")) == []


def test_no_action_runner_or_container_floats():
    assert workflows(), "no GitHub workflow in .github/workflows"
    for path in workflows():
        assert workflow_problems(path.read_text()) == [], path.name


def test_layers_user_and_dockerignore():
    assert layout_problems(read("Dockerfile"), read(".dockerignore")) == []


# ---------------------------------------------------------------- each check bites


def _sub(text: str, old: str, new: str) -> str:
    assert old in text, f"fixture out of date: {old!r} not found"
    return text.replace(old, new, 1)


def _torch_lock_line() -> str:
    return f"torch=={lock_versions(read(LOCK))['torch']}\n"


@pytest.mark.parametrize(
    "name, drift, expect",
    [
        ("lock torch", lambda d, lk: (d, _sub(lk, _torch_lock_line(), "torch==2.13.0\n")), "torch"),
        (
            "lock torchvision",
            lambda d, lk: (d, re.sub(r"(?m)^torchvision==.*$", "torchvision==0.28.0", lk)),
            "torchvision",
        ),
        (
            "explicit torch pin in the Dockerfile",
            lambda d, lk: (d + "RUN pip install --no-cache-dir torch==2.13.0\n", lk),
            "torch==2.13.0",
        ),
        (
            "unpinned install",
            lambda d, lk: (d + "RUN pip install --no-cache-dir torchvision\n", lk),
            "unpinned",
        ),
        (
            "another requirements file",
            lambda d, lk: (_sub(d, f"-r /opt/venv/{LOCK}", "-r /opt/venv/requirements.txt"), lk),
            "requirements.txt",
        ),
        (
            "another index",
            lambda d, lk: (
                _sub(d, "pip install --no-cache-dir -r", "pip install --extra-index-url x -r"),
                lk,
            ),
            "another index",
        ),
        (
            "lock not copied",
            lambda d, lk: (_sub(d, f"COPY {LOCK} ", "COPY requirements.txt "), lk),
            "does not COPY",
        ),
    ],
)
def test_version_check_catches_drift(name, drift, expect):
    dockerfile, lock = drift(read("Dockerfile"), read(LOCK))
    problems = version_problems(dockerfile, lock, venv_versions())
    assert any(expect in p for p in problems), (name, problems)


def test_version_check_catches_a_stale_venv():
    stale = venv_versions() | {"torch": "2.13.0"}
    problems = version_problems(read("Dockerfile"), read(LOCK), stale)
    assert any("the venv 2.13.0" in p for p in problems), problems


def test_cuda_check_catches_drift():
    dockerfile = re.sub(r"nvidia/cuda:13\.0\.\d+", "nvidia/cuda:12.8.1", read("Dockerfile"))
    assert "12.8.1" in dockerfile
    assert cuda_problems(dockerfile, read(LOCK), venv_torch_cuda())
    assert cuda_problems(read("Dockerfile"), read(LOCK), "12.8")
    lock = re.sub(r"(?m)^nvidia-cuda-runtime==.*$", "nvidia-cuda-runtime==12.8.90", read(LOCK))
    assert cuda_problems(read("Dockerfile"), lock, venv_torch_cuda())


def test_python_check_catches_drift():
    dockerfile = _sub(read("Dockerfile"), "ARG PYTHON_VERSION=3.11", "ARG PYTHON_VERSION=3.12")
    assert python_problems(dockerfile, "3.11", ">=3.11,<3.12")
    assert python_problems(read("Dockerfile"), "3.11", ">=3.12")


@pytest.mark.parametrize(
    "base, expect",
    [
        ("ubuntu:latest", "floats"),
        ("nvidia/cuda", "no tag"),
        ("nvidia/cuda:13", "floats"),
        ("python:3.11-slim", "floats"),
        ("localhost:5000/cuda", "no tag"),
        ("nvidia/cuda:13.0.2-base-ubuntu22.04@sha256:abc", "not a sha256"),
    ],
)
def test_floating_base_image_is_caught(base, expect):
    dockerfile = re.sub(r"(?m)^ARG BASE_IMAGE=.*$", f"ARG BASE_IMAGE={base}", read("Dockerfile"))
    problems = dockerfile_pin_problems(dockerfile)
    assert any(expect in p for p in problems), problems


def test_floating_stage_or_copy_from_image_is_caught():
    extra = "FROM python:3.11.14-slim AS tools\nFROM node:22 AS web\nCOPY --from=tools / /x\n"
    extra += "COPY --from=ghcr.io/astral-sh/uv:latest /uv /bin/uv\n"
    problems = dockerfile_pin_problems(read("Dockerfile") + extra)
    assert len(problems) == 2 and "node:22" in problems[0] and "uv:latest" in problems[1]


def test_recorded_digest_is_checked():
    pinned = "sha256:" + "ab" * 32
    good = _sub(read("Dockerfile"), "\nARG BASE_DIGEST=", f"\nARG BASE_DIGEST={pinned}\n#")
    assert dockerfile_pin_problems(good) == []
    assert base_images(good)[0].endswith("@" + pinned)
    bad = _sub(read("Dockerfile"), "\nARG BASE_DIGEST=", "\nARG BASE_DIGEST=sha256:beef\n#")
    assert any("BASE_DIGEST" in p for p in dockerfile_pin_problems(bad))


@pytest.mark.parametrize(
    "uses, expect",
    [
        ("actions/checkout@v4", "floats"),
        ("actions/checkout@v4.2", "floats"),
        ("actions/checkout@main", "floats"),
        ("actions/checkout@latest", "floats"),
        ("actions/checkout", "no ref"),
        ("docker://alpine:3", "floats"),
    ],
)
def test_floating_action_is_caught(uses, expect):
    workflow = re.sub(r"uses: actions/checkout@\S+", f"uses: {uses}", workflows()[0].read_text())
    problems = workflow_problems(workflow)
    assert any(expect in p for p in problems), problems


def test_pinned_action_forms_pass():
    assert action_problem("actions/checkout@v4.2.2") is None
    assert action_problem("actions/checkout@" + "0123456789abcdef" * 2 + "01234567") is None
    assert action_problem("./.github/actions/setup") is None


def test_floating_runner_container_and_service_are_caught():
    workflow = yaml.safe_load(workflows()[0].read_text())
    job = next(iter(workflow["jobs"].values()))
    job["runs-on"] = "ubuntu-latest"
    job["container"] = {"image": "python:3.11"}
    job["services"] = {"db": {"image": "postgres"}}
    problems = workflow_problems(yaml.safe_dump(workflow))
    assert len(problems) == 3, problems


@pytest.mark.parametrize(
    "drift, expect",
    [
        (lambda d: _sub(d, "COPY . /workspace\n", ""), "after the lock"),
        (
            lambda d: _sub(
                d, "COPY requirements.lock", "COPY . /workspace\nCOPY requirements.lock"
            ),
            "after the lock",
        ),
        (lambda d: _sub(d, "ARG PYTHON_VERSION", "ARG GIT_SHA=x\nARG PYTHON_VERSION"), "GIT_SHA"),
        (lambda d: d + "USER root\n", "non-root"),
        (lambda d: d + "WORKDIR /app\n", "/workspace"),
    ],
)
def test_layout_check_catches_drift(drift, expect):
    problems = layout_problems(drift(read("Dockerfile")), read(".dockerignore"))
    assert any(expect in p for p in problems), problems


def test_dockerignore_check_catches_drift():
    dockerignore = "\n".join(x for x in read(".dockerignore").splitlines() if x != ".venv")
    assert layout_problems(read("Dockerfile"), dockerignore) == [".dockerignore must list .venv"]


# ---------------------------------------------------------------- make image-digest


def _resolve(tmp_path: Path, docker: str | None) -> tuple[subprocess.CompletedProcess, str]:
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(read("Dockerfile"))
    env = os.environ | {"DOCKER": docker or str(tmp_path / "no-docker-here")}
    done = subprocess.run(
        ["bash", str(ROOT / "docker" / "resolve-base-digest.sh"), str(dockerfile)],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )
    return done, dockerfile.read_text()


def _fake_docker(tmp_path: Path, script: str) -> str:
    path = tmp_path / "docker"
    path.write_text("#!/usr/bin/env bash\n" + script)
    path.chmod(0o755)
    return str(path)


def test_image_digest_without_docker_fails_in_one_line(tmp_path):
    done, after = _resolve(tmp_path, None)
    assert done.returncode != 0
    assert done.stderr.count("\n") == 1 and "image-digest: needs the docker client" in done.stderr
    assert after == read("Dockerfile")


def test_image_digest_without_registry_fails_in_one_line(tmp_path):
    docker = _fake_docker(tmp_path, 'echo "dial tcp: no such host" >&2; exit 1\n')
    done, after = _resolve(tmp_path, docker)
    assert done.returncode != 0 and done.stderr.count("\n") == 1, done.stderr
    assert "no such host" in done.stderr and after == read("Dockerfile")


def test_image_digest_records_the_buildx_digest(tmp_path):
    digest = "sha256:" + "0f" * 32
    log = tmp_path / "calls"
    docker = _fake_docker(tmp_path, f'echo "$*" >> {log}\necho {digest}\n')
    done, after = _resolve(tmp_path, docker)
    assert done.returncode == 0, done.stderr
    assert f"\nARG BASE_DIGEST={digest}\n" in after
    image = arg_defaults(read("Dockerfile"))["BASE_IMAGE"]
    assert f"buildx imagetools inspect {image}" in log.read_text()
    assert dockerfile_pin_problems(after) == []
    assert base_images(after) == [f"{image}@{digest}"]


def test_image_digest_falls_back_to_manifest_inspect(tmp_path):
    amd64, arm64 = "sha256:" + "a1" * 32, "sha256:" + "b2" * 32
    entries = [
        {"Descriptor": {"digest": arm64, "platform": {"os": "linux", "architecture": "arm64"}}},
        {"Descriptor": {"digest": amd64, "platform": {"os": "linux", "architecture": "amd64"}}},
    ]
    listing = tmp_path / "manifest.json"
    listing.write_text(json.dumps(entries))
    script = f'[ "$1" = buildx ] && exit 1\n[ "$1" = manifest ] && cat {listing}\n'
    done, after = _resolve(tmp_path, _fake_docker(tmp_path, script))
    assert done.returncode == 0, done.stderr
    assert f"\nARG BASE_DIGEST={amd64}\n" in after
