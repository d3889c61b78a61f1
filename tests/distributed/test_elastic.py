"""Elastic training with real torchrun agents on loopback (gloo): one agent per "node", the
command each runs rendered by launch for NODES=1:3. A node dies mid-run (its agent and its
worker SIGKILLed), the survivor carries on alone; a third node joins, and the world grows
again. The samples of every optimizer step, and the weights up to float rounding, are those
of one process that never changed size.

The first agent hosts the rendezvous store (as RDZV_ENDPOINT's node does): torchrun cannot
lose that one, so the node that dies is the second."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from engine.spawn import free_port
from launch import render
from tests.helpers import (
    QUIET,
    REPO,
    engine_env,
    final_weights,
    launch,
    max_difference,
    run_dir,
)

pytestmark = [pytest.mark.dist, pytest.mark.slow]

# As long as the N->M resume tests: float rounding that differs with the world size grows
# through SGD momentum, past RESUME_TOLERANCE after 60 steps.
STEPS = 30
# GroupNorm: no batch statistics, so the split of a batch over processes changes nothing.
SAME_RUN = [
    "model.norm=group",
    f"train.max_steps={STEPS}",
    "train.micro_batch_size=16",  # 4 accumulation steps on 1 process, 2 on 2
    "log.sample_ids=true",
    "log.every_steps=1",
    "ckpt.every_steps=5",
]
LOST_AFTER = 12  # the second node dies once this step is recorded
RESUME_TOLERANCE = 5e-5  # as for any resume on another world size (test_distributed.py)
# torchrun's timing, shortened so that the test takes well under a minute: a node missing its
# heartbeat for 1 s x 6 is gone, and a rendezvous waits 2 s for latecomers once it has enough.
RDZV_CONF = "--rdzv_conf=last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=6"
DEADLINE_S = 240


def agent_command(root, port: int) -> list[str]:
    """What `make train NODES=1:3 GPUS=0 RDZV_ENDPOINT=...` runs on each node, with the
    test's overrides and shorter rendezvous timings."""
    request = render.LaunchRequest(
        recipe="digits",
        run_name="elastic",
        nodes=1,
        max_nodes=3,
        rdzv_endpoint=f"127.0.0.1:{port}",
        max_restarts=3,
        python=sys.executable,
        overrides=(*QUIET, f"run.root={root}", *SAME_RUN, "fault.data_delay_ms=50"),
    )
    argv = render.local(request)
    assert argv[:2] == ["env", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"] and "--nnodes=1:3" in argv
    argv.insert(argv.index("--rdzv_backend=c10d"), RDZV_CONF)
    return argv


def wait_until(what: str, ready, agents) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not ready():
        if time.monotonic() > deadline or all(a.poll() is not None for a in agents):
            raise AssertionError(f"never saw {what}; agents' logs:\n{logs(agents)}")
        time.sleep(0.2)


def logs(agents) -> str:
    return "\n".join(f"--- agent {i}\n{a.log.read_text()[-3000:]}" for i, a in enumerate(agents))


def lines(path) -> list[dict]:
    """JSON lines (or one JSON file) as written so far."""
    try:
        text = path.read_text()
        if path.suffix == ".json":
            return [json.loads(text)]
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    except (OSError, ValueError):  # not yet written, or a line mid-write
        return []


def start_agent(argv, log) -> subprocess.Popen:
    agent = subprocess.Popen(
        argv,
        cwd=REPO,
        env=engine_env(LOGLEVEL="INFO"),  # torchrun's own log: rendezvous rounds, restarts
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    agent.log = log
    return agent


def start_reference(root, log) -> subprocess.Popen:
    """The same run in one process, never interrupted (run_engine's command, not waited for)."""
    argv = [sys.executable, "-m", "engine.train", "digits", *QUIET, f"run.root={root}"]
    reference = subprocess.Popen(
        [*argv, "run.name=one", *SAME_RUN],
        cwd=REPO,
        env=engine_env(),
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    reference.log = log
    return reference


def workers(agent: subprocess.Popen) -> list[int]:
    """The agent's worker processes (torchrun starts each in a session of its own)."""
    found = subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


def kill_node(agent: subprocess.Popen) -> None:
    """The node dies at once: its agent and its workers."""
    children = workers(agent)
    os.kill(agent.pid, signal.SIGKILL)
    for pid in children:
        os.kill(pid, signal.SIGKILL)


def test_a_node_lost_and_a_node_joining_keep_the_samples_of_one_process(tmp_path):
    root, port = tmp_path / "runs", free_port()
    folder = run_dir(root, "elastic")
    argv = agent_command(root, port)

    def recorded(kind: str) -> list[dict]:
        return [r for r in lines(folder / "metrics.jsonl") if r["kind"] == kind]

    def log(agent: int) -> str:
        return (tmp_path / f"{'abc'[agent]}.log").read_text()

    def world() -> int:  # as the newest start wrote it
        return (lines(folder / "env.json") or [{}])[0].get("world_size", 0)

    # a hosts the rendezvous store; b and c never do (on loopback any agent could).
    client = [a + ",is_host=0" if a == RDZV_CONF else a for a in argv]
    agents = [start_agent(argv, tmp_path / "a.log"), start_agent(client, tmp_path / "b.log")]
    reference_root, reference = tmp_path / "reference", None
    newcomer = "new nodes from group_rank=0; will restart worker group"
    try:
        wait_until(
            f"step {LOST_AFTER} on two nodes",
            lambda: world() == 2 and len(recorded("train")) >= LOST_AFTER,
            agents,
        )
        before = len(recorded("world_size"))
        kill_node(agents[1])
        last_step = recorded("train")[-1]["step"]  # the survivor's next collective fails
        wait_until("the world shrink to 1", lambda: len(recorded("world_size")) > before, agents)
        # The survivor is held still while a third node starts, so that it cannot finish
        # first on a slow machine; its agent asks it to stop (SIGTERM) once it sees the
        # newcomer, and it checkpoints when it goes on.
        (survivor,) = workers(agents[0])
        os.kill(survivor, signal.SIGSTOP)
        # One process, never interrupted: trained while the elastic job waits for node c.
        reference = start_reference(reference_root, tmp_path / "one.log")
        seen = log(0).count(newcomer)
        agents.append(start_agent(client, tmp_path / "c.log"))
        wait_until("the survivor's agent see node c", lambda: log(0).count(newcomer) > seen, agents)
        os.kill(survivor, signal.SIGCONT)
        for agent in agents:
            agent.wait(timeout=DEADLINE_S)
        reference.wait(timeout=DEADLINE_S)
    finally:
        for process in [*agents, reference]:
            if process is not None:
                process.kill()
    assert [a.returncode for a in agents] == [0, -9, 0], logs(agents)
    assert reference.returncode == 0, reference.log.read_text()[-3000:]

    *start, shrink, grow = recorded("world_size")
    assert [(r["from"], r["to"]) for r in start] in ([], [(1, 2)])  # b joined late, or not
    assert (shrink["from"], shrink["to"]) == (2, 1)
    # Resumed from the newest checkpoint (every 5 steps); the steps after it trained again.
    assert shrink["step"] % 5 == 0 and 10 <= shrink["step"] <= last_step, shrink
    assert shrink["checkpoint"] == f"step-{shrink['step']:08d}.pt"
    assert shrink["redone_steps"] >= last_step - shrink["step"]
    assert (shrink["accum_steps"], shrink["micro_batch"]) == (4, 16)  # the batch stays 64
    assert (grow["from"], grow["to"], grow["accum_steps"]) == (1, 2, 2)
    assert shrink["step"] <= grow["step"] < STEPS and grow["lost_s"] >= 0, grow
    report = launch("report", str(folder))
    assert report.returncode == 0, report.stderr
    table = (folder.parent / "report-elastic.md").read_text()
    for r, sizes in ((shrink, "2 → 1"), (grow, "1 → 2")):
        row = f"| elastic | {r['step']} | {sizes} | {r['checkpoint']} | {r['redone_steps']} |"
        assert row in table, table
    # Redone steps replace their first records: each step once, none skipped.
    assert [r["step"] for r in recorded("train")] == list(range(1, STEPS + 1))
    assert json.loads((folder / "summary.json").read_text())["world_size"] == 2

    one = lines(run_dir(reference_root, "one") / "samples.jsonl")
    elastic = lines(folder / "samples.jsonl")
    assert elastic == one and len(one) == STEPS
    difference = max_difference(
        final_weights(root, "elastic"), final_weights(reference_root, "one")
    )
    assert difference < RESUME_TOLERANCE
