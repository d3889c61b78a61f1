"""The structure make lint cannot see: imports inside functions, each with its reason.

An import belongs at the top of its module; inside a function only for an optional
dependency (the run works without it) or for start-up time (seconds of imports a run that
does not need them should not pay), and the line says which."""

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "launch", "recipes", "bench")
REASONS = ("# optional", "# start-up time")


def imports_inside_functions(path: Path) -> list[int]:
    """Line numbers of the import statements nested in a function of the file."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lines += [
                sub.lineno for sub in ast.walk(node) if isinstance(sub, ast.Import | ast.ImportFrom)
            ]
    return sorted(set(lines))


def comments(path: Path) -> dict[int, str]:
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return {t.start[0]: t.string for t in tokens if t.type == tokenize.COMMENT}


def unexplained(path: Path) -> list[int]:
    said = comments(path)
    return [n for n in imports_inside_functions(path) if not said.get(n, "").startswith(REASONS)]


def test_every_import_inside_a_function_says_why():
    files = [p for name in PACKAGES for p in sorted((ROOT / name).rglob("*.py"))]
    assert len(files) > 50
    missing = [f"{p.relative_to(ROOT)}:{n}" for p in files for n in unexplained(p)]
    assert not missing, (
        f"imports inside functions without '# optional' or '# start-up time': {missing}"
    )


def test_the_check_finds_an_unexplained_import(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "def a():\n    import json\n\n\ndef b():\n    import csv  # optional\n\n\n"
        "def c():\n    import zlib  # start-up time: seconds\n"
    )
    assert imports_inside_functions(planted) == [2, 6, 10]
    assert unexplained(planted) == [2]


GIT_CALL = re.compile(r"""\[\s*["']git["']""")  # an argv that starts with git


def git_callers(root: Path) -> list[str]:
    return sorted(
        str(path.relative_to(root))
        for package in PACKAGES
        for path in (root / package).rglob("*.py")
        if GIT_CALL.search(path.read_text())
    )


def test_git_runs_from_one_module():
    """engine.codeid runs git for everyone (the code's identity, launch's commit and file
    list, the benchmarks' records): one timeout, one answer where git is missing."""
    assert git_callers(ROOT) == ["engine/codeid.py"]


def test_the_check_finds_a_second_git_caller(tmp_path):
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "a.py").write_text('subprocess.run(["git", "status"])\n')
    assert git_callers(tmp_path) == ["engine/a.py"]


NAME_STAMP = re.compile(r"%Y%m%d-%H%M%S")  # the time stamp a new run's name starts with


def stamping_functions(root: Path) -> list[str]:
    """module:function of every function that writes a run-name time stamp (the benchmarks'
    result files are not runs)."""
    found = []
    for package in ("engine", "launch", "recipes"):
        for path in sorted((root / package).rglob("*.py")):
            text = path.read_text()
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.FunctionDef) and NAME_STAMP.search(
                    ast.get_source_segment(text, node) or ""
                ):
                    found.append(f"{path.relative_to(root)}:{node.name}")
    return found


def test_a_run_name_is_made_by_one_function():
    """engine.rundir.decide_run_name names every new run (launch, the engine's --spawn and
    ranks, make reproduce); the other stamp is the name a replaced run is moved aside to."""
    assert stamping_functions(ROOT) == [
        "engine/rundir.py:decide_run_name",
        "engine/rundir.py:move_aside",
    ]


def test_the_check_finds_a_second_run_namer(tmp_path):
    (tmp_path / "launch").mkdir()
    (tmp_path / "launch" / "a.py").write_text(
        "def name():\n    return time.strftime('%Y%m%d-%H%M%S') + '-digits'\n"
    )
    assert stamping_functions(tmp_path) == ["launch/a.py:name"]


MAX_LINES = 620  # a module a reader holds in mind; past it, a concern has grown a second one


def longest(paths: list[Path], root: Path = ROOT) -> list[tuple[int, str]]:
    counted = [(len(p.read_text().splitlines()), str(p.relative_to(root))) for p in paths]
    return sorted(c for c in counted if c[0] > MAX_LINES)


def test_no_module_is_longer_than_the_limit():
    paths = [p for folder in (*PACKAGES, "tests") for p in (ROOT / folder).rglob("*.py")]
    assert len(paths) > 100 and not longest(paths), longest(paths)


def test_the_length_check_finds_a_long_module(tmp_path):
    (tmp_path / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "short.py").write_text("x = 1\n" * MAX_LINES)
    assert longest(sorted(tmp_path.glob("*.py")), tmp_path) == [(MAX_LINES + 1, "long.py")]
