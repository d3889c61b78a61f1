"""Suite-wide rules. In CI (CI=true) a skipped test is a failure: whatever a test needs,
.ci/run must install and start it. The one thing no CI machine here has, a CUDA device, is
asked for by the `gpu` marker: such tests are deselected (and counted as such) without one,
and bench/gpu.sh runs them on a machine with a GPU."""

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
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]
