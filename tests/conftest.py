"""Suite-wide rules. In CI (CI=true) a skipped test is a failure: whatever a test needs,
.ci/run must install and start it. The one thing no CI machine here has, a CUDA device, is
asked for by the `gpu` marker: such tests are deselected (and counted as such) without one,
and bench/gpu.sh runs them on a machine with a GPU. A test marked gpu(cpu_stand_in=True) can
also run on the CPU in its own reduced form: GPU_TESTS_ON_CPU=1 keeps it (to check the test
itself before its one run on a GPU)."""

import compileall
import os
import shutil
import signal
import sys
import threading
import warnings

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
# Handlers a test may install in its worker process (the engine's stop flag, a sweep's or a
# spawner's forwarding): put back after each test, or the next test in that worker would see
# Ctrl-C set a flag instead of raising KeyboardInterrupt.
WATCHED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)


@pytest.fixture(autouse=True)
def signal_handlers_put_back(request):
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in WATCHED_SIGNALS}
    yield
    for sig, handler in saved.items():
        if signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)
            warnings.warn(
                f"{request.node.nodeid} left a {sig.name} handler installed; put back", stacklevel=1
            )


@pytest.fixture(scope="module", autouse=True)
def module_folders_removed(request, tmp_path_factory):
    """The folders a module's fixtures made (its reference runs, often hundreds of MB) go when
    its last test has run, unless one of its tests failed (then they stay to be read), as
    tmp_path_retention_policy = "failed" does for each test's own tmp_path: the suite's
    footprint on /tmp stays that of one module per worker, not the sum of all of them."""
    made, mktemp = [], tmp_path_factory.mktemp

    def recorded(basename: str, numbered: bool = True):
        path = mktemp(basename, numbered)
        made.append(path)
        return path

    failed_before = request.session.testsfailed
    tmp_path_factory.mktemp = recorded
    yield
    del tmp_path_factory.mktemp  # the class's own again
    keep_all = request.config.getini("tmp_path_retention_policy") == "all"  # -o ...=all
    if request.session.testsfailed == failed_before and not keep_all:
        for path in made:
            shutil.rmtree(path, ignore_errors=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if IN_CI and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.longrepr = f"skipped in CI, which must provide everything a test needs: {reason}"


def pytest_collection_modifyitems(config, items):
    deselect_gpu_tests(config, items)
    slow_modules_first(items)


def slow_modules_first(items) -> None:
    """Modules with SLURM tests, then modules with slow tests, then the rest, each module's
    tests together and in their order: under -n 2 the long modules start first, and the
    quick ones fill the gaps at the end."""

    def rank(item) -> int:
        return (
            0 if item.get_closest_marker("slurm") else 1 if item.get_closest_marker("slow") else 2
        )

    module_rank: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        module_rank[module] = min(module_rank.get(module, 2), rank(item))
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (module_rank[item.nodeid.split("::", 1)[0]], order[id(item)]))


def deselect_gpu_tests(config, items) -> None:
    import torch

    if torch.cuda.is_available():
        return
    stand_in = os.environ.get("GPU_TESTS_ON_CPU") == "1"

    def needs_cuda(item) -> bool:
        marker = item.get_closest_marker("gpu")
        return marker is not None and not (stand_in and marker.kwargs.get("cpu_stand_in"))

    gpu = [item for item in items if needs_cuda(item)]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if not needs_cuda(item)]


# ---------------------------------------------------------------- both cores (pytest-xdist)

# Tests that share the one local SLURM cluster (two nodes) run one after the other in a
# single worker: two at once would queue behind each other's jobs and time out.
SERIAL_SCOPES = {"tests/slurm/": "slurm"}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # not tests.helpers: torch
PACKAGES = ("engine", "launch", "recipes", "bench", "tests")


def pytest_configure(config):
    """The repository's bytecode written once, before any test: the suite starts Python
    processes by the hundred (engines, launches, checks), and where PYTHONDONTWRITEBYTECODE
    is set (CI images often set it) each one compiled the modules it imports again (~0.4 s of
    a 2-core machine's CPU each). A process reads bytecode whose source is unchanged and
    compiles an edited module itself, as always. The test processes also keep what pytest's
    assertion rewriting makes of each test module (which PYTHONDONTWRITEBYTECODE would drop):
    ~4 s of every worker's collection, from the second run of a checkout on."""
    sys.dont_write_bytecode = False
    if hasattr(config, "workerinput"):  # an xdist worker: the controller did it
        return
    for package in PACKAGES:
        compileall.compile_dir(os.path.join(REPO, package), quiet=2)


@pytest.hookimpl(optionalhook=True)  # a plain `pytest` without xdist ignores it
def pytest_xdist_make_scheduler(config, log):
    """`make test` runs on both cores (-n 2): whole modules go to a worker, so a module's
    fixtures (its reference runs) are made once, and the SLURM tests form one scope."""
    from xdist.scheduler import LoadScopeScheduling

    class ModulesWithSerialScopes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            for prefix, scope in SERIAL_SCOPES.items():
                if nodeid.startswith(prefix):
                    return scope
            return nodeid.split("::", 1)[0]

    return ModulesWithSerialScopes(config, log)


# ---------------------------------------------------------------- where the time went

_seconds_by_folder: dict[str, float] = {}


def pytest_runtest_logreport(report):
    folder = "/".join(report.nodeid.split("::", 1)[0].split("/")[:2])
    _seconds_by_folder[folder] = _seconds_by_folder.get(folder, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """Test time per folder (set-up, call and tear-down, summed over the workers), beside
    the slowest tests that --durations lists: what tests/README.md's cost table is made of."""
    if not _seconds_by_folder:
        return
    total = sum(_seconds_by_folder.values())
    terminalreporter.section("test time per folder, summed over the workers")
    for folder, seconds in sorted(_seconds_by_folder.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{seconds:8.1f}s {100 * seconds / total:5.1f}%  {folder}")
    terminalreporter.write_line(f"{total:8.1f}s total")


@pytest.fixture(scope="session")
def train_here():
    """Trains as `python -m engine.train RECIPE QUIET run.root=ROOT run.name=NAME OVERRIDES`
    would (engine.lifecycle.train, one process, one thread as tests.helpers.engine_env gives the
    engine's processes), but in this process: for tests whose subject is what a run trains,
    not the process (its start-up, exit status or signals). The global flags and the thread
    count it changes are put back after each run; rank 0's lines are in the run's train.log
    (and on this process's stderr)."""
    import torch

    from engine.catalog import load_config
    from engine.lifecycle import train
    from tests.helpers import QUIET, backend_flags, set_backend_flags

    def run(root, name: str, *overrides: str, recipe: str = "digits", variant: str = "") -> None:
        args = [*QUIET, f"run.root={root}", f"run.name={name}", *overrides]
        cfg, recipe_ = load_config(recipe, args, variant)
        threads = torch.get_num_threads()
        saved = backend_flags()
        torch.set_num_threads(1)
        try:
            assert train(cfg, recipe_) == 0
        finally:
            torch.set_num_threads(threads)
            set_backend_flags(saved)

    return run
