"""Suite-wide rules. In CI (CI=true) a skipped test is a failure: whatever a test needs,
.ci/run must install and start it. The one thing no CI machine here has, a CUDA device, is
asked for by the `gpu` marker: such tests are deselected (and counted as such) without one,
and bench/gpu.sh runs them on a machine with a GPU. A test marked gpu(cpu_stand_in=True) can
also run on the CPU in its own reduced form: GPU_TESTS_ON_CPU=1 keeps it (to check the test
itself before its one run on a GPU)."""

import os

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if IN_CI and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.longrepr = f"skipped in CI, which must provide everything a test needs: {reason}"


def pytest_collection_modifyitems(config, items):
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
