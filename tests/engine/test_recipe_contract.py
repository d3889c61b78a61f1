"""The recipe contract is whole in engine/recipe.py: the engine reads a recipe's config
sections and datasets only through the functions there, never by a name of its own
(getattr/hasattr of a recipe's section or dataset anywhere else in engine/)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO

CONTRACT = REPO / "engine" / "recipe.py"
# What a recipe's objects are called where the engine holds them.
RECIPE_OBJECTS = ("cfg.data", "cfg.model", "model_config", "data_config", "dataset", "train_data")


def reads_by_name(path: Path) -> list[str]:
    """getattr/hasattr calls on a recipe's section or dataset with a literal name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        if node.func.id not in ("getattr", "hasattr") or len(node.args) < 2:
            continue
        target, name = ast.unparse(node.args[0]), node.args[1]
        if isinstance(name, ast.Constant) and any(o in target for o in RECIPE_OBJECTS):
            found.append(
                f"{path.relative_to(REPO)}:{node.lineno} {node.func.id}({target}, {name.value!r})"
            )
    return found


def test_the_engine_reads_recipe_names_only_through_the_contract():
    engine = sorted((REPO / "engine").rglob("*.py"))
    assert CONTRACT in engine
    stray = [hit for path in engine if path != CONTRACT for hit in reads_by_name(path)]
    assert stray == [], "read through engine/recipe.py's functions instead: " + "; ".join(stray)


def test_the_scan_finds_a_read_by_name(tmp_path):
    """The scan is not vacuous: a planted getattr of a recipe's section is found."""
    planted = REPO / "engine" / "_planted_contract_probe.py"
    planted.write_text('def f(cfg):\n    return getattr(cfg.data, "root", "")\n')
    try:
        assert reads_by_name(planted) == [
            "engine/_planted_contract_probe.py:2 getattr(cfg.data, 'root')"
        ]
    finally:
        planted.unlink()


def test_the_contract_module_is_torch_free():
    """launch (torch-free) and every engine layer read the contract from engine/recipe.py."""
    tree = ast.parse(CONTRACT.read_text())
    top = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n.split(".")[0] in ("torch", "engine")], names


def test_the_loop_its_set_up_and_a_digits_run_load_no_image_code():
    """Images live beside the generic core (engine/vision): the loop, a process's life and a
    run's set-up import none of it, nor does a digits run's config (an import contract holds
    it for the source; this holds it for what a process really loads)."""
    script = (
        "import sys\n"
        "import engine.lifecycle, engine.assemble, engine.train\n"
        "from engine import catalog\n"
        "catalog.load_config('digits', [])\n"
        "print(sorted(m for m in sys.modules if m.startswith(('engine.vision', 'torchvision'))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
