"""W&B trouble never stops training: a real engine process with a (fake) API key and a W&B
server that cannot be reached, does not speak W&B, or whose service dies mid-run."""

import http.server
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from engine.tracking import unreachable_reason
from tests.helpers import QUIET, REPO, engine_env, read_wandb_history, records, run_dir, run_engine

FAKE_KEY = secrets.token_hex(20)  # 40 characters, the shape of a W&B API key


def closed_port_url() -> str:
    """A local address where nothing listens: connections are refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def silent_server():
    """Accepts connections (the kernel's backlog) and never answers, as a blackhole does."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def http_server(status: int):
    """A local web server that answers every request with `status` and no body."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def answer(self):
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_POST = answer

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def not_wandb_server():
    server = http_server(404)  # e.g. WANDB_BASE_URL pointing at some other web server
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def wandb_env(url: str) -> dict[str, str]:
    return engine_env(WANDB_API_KEY=FAKE_KEY, WANDB_BASE_URL=url)


def offline_history(root: Path, name: str) -> list[dict]:
    (log_file,) = run_dir(root, name).glob("wandb/offline-run-*/run-*.wandb")
    return read_wandb_history(log_file)[1]


def assert_trained_and_logged_offline(root: Path, name: str, out) -> None:
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    written = {r["step"]: r["loss"] for r in records(root, name, "train")}
    assert sorted(written) == [10, 20] and records(root, name, "eval")
    logged = {r["_step"]: r["train/loss"] for r in offline_history(root, name) if "train/loss" in r}
    assert logged == pytest.approx(written)


def offline_line(stderr: str) -> str:
    (line,) = [line for line in stderr.splitlines() if line.startswith("W&B is offline")]
    return line


@pytest.mark.slow
def test_auto_with_credentials_goes_offline_at_once_when_wandb_is_unreachable(tmp_path):
    url = closed_port_url()
    started = time.monotonic()
    out = run_engine(tmp_path, "auto", "log.wandb=auto", "train.max_steps=20", env=wandb_env(url))
    assert time.monotonic() - started < 45  # wandb alone retries for 90 s, then raises
    line = offline_line(out.stderr)
    assert f"W&B at {url} is unreachable" in line and "refused" in line
    assert line.endswith(f"wandb sync {run_dir(tmp_path, 'auto')}/wandb/offline-run-*")
    assert_trained_and_logged_offline(tmp_path, "auto", out)


@pytest.mark.slow
def test_auto_goes_offline_when_the_server_answers_but_wandb_init_fails(tmp_path, not_wandb_server):
    env = wandb_env(not_wandb_server)
    out = run_engine(tmp_path, "init", "log.wandb=auto", "train.max_steps=20", env=env)
    assert "(wandb.init failed: CommError" in offline_line(out.stderr)
    assert_trained_and_logged_offline(tmp_path, "init", out)


@pytest.mark.slow
def test_online_with_wandb_unreachable_is_a_one_line_error_before_anything_is_written(tmp_path):
    url = closed_port_url()
    out = run_engine(tmp_path, "online", "log.wandb=online", env=wandb_env(url), check=False)
    assert out.returncode == 2, out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith(f"error: log.wandb=online but W&B at {url} is unreachable (")
    assert "log.wandb=auto/offline" in line  # the fix
    assert not run_dir(tmp_path, "online").exists()


@pytest.mark.slow
def test_online_when_wandb_init_fails_is_a_one_line_error(tmp_path, not_wandb_server):
    env = wandb_env(not_wandb_server)
    out = run_engine(tmp_path, "online", "log.wandb=online", env=env, check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    (line,) = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert line.startswith("error: log.wandb=online but wandb.init failed (CommError: ")
    assert line.endswith("or use log.wandb=auto/offline")


def wandb_service_pids(parent: int) -> list[int]:
    """The wandb-core processes that `parent` started."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue  # the process ended while being read
        if ppid == parent and b"wandb-core" in cmdline:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.slow
def test_wandb_dying_mid_run_is_reported_once_and_training_completes(tmp_path):
    steps = 150
    args = [*QUIET, f"run.root={tmp_path}", "run.name=dies", "log.wandb=offline"]
    args += [f"train.max_steps={steps}", "log.every_steps=1", "log.progress=off"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.train", "digits", *args],
        cwd=REPO,
        env=engine_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = run_dir(tmp_path, "dies") / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text()) and proc.poll() is None:
        assert time.monotonic() < deadline, "no metrics appeared"
        time.sleep(0.01)
    services = wandb_service_pids(proc.pid)
    assert services, "no wandb-core process found"
    for pid in services:
        os.kill(pid, signal.SIGKILL)
    logged_before_kill = len(metrics.read_text().splitlines())
    stdout, stderr = proc.communicate(timeout=120)

    assert logged_before_kill < steps / 2, "the run ended before W&B was killed"
    assert proc.returncode == 0 and "Traceback" not in stderr, stderr
    (warning,) = [line for line in stderr.splitlines() if "W&B" in line and "warning" in line]
    assert warning.startswith("warning: W&B failed (") and str(metrics) in warning
    train = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in train if r["kind"] == "train"] == list(range(1, steps + 1))
    assert (run_dir(tmp_path, "dies") / "summary.json").exists()


@pytest.mark.parametrize("url", ["silent", "https://wandb.invalid"])
def test_reachability_probe_is_bounded_for_silent_servers_and_unknown_hosts(url, silent_server):
    url = silent_server if url == "silent" else url  # .invalid never resolves (RFC 6761)
    started = time.monotonic()
    assert unreachable_reason(url, timeout=1.0)
    assert time.monotonic() - started < 3


@pytest.mark.parametrize(("status", "reachable"), [(200, True), (404, True), (503, False)])
def test_reachability_probe_counts_any_answer_but_a_gateway_error(status, reachable):
    server = http_server(status)
    try:
        reason = unreachable_reason(f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
    assert (reason is None) == reachable, reason
