"""engine.hang in-process: the line's wording, the watchdog's firing and its restraint (a run
that makes progress, a first step that has not ended), and dist.hang_s=0 starting nothing.
The real two-process hang is tests/distributed/test_hang.py."""

import json
import threading
import time
from pathlib import Path

import pytest

from engine import hang
from engine.catalog import load_config
from engine.config import ConfigError
from engine.config.sections import resume_safe_keys
from engine.distributed import DistEnv

FOLDER = Path("runs/digits/r1/hang")


def beat(marks, what, step, dumped=True):
    return {"marks": marks, "what": what, "step": step, "dumped": dumped}


def test_the_line_names_the_rank_behind_its_step_where_the_others_wait_and_what_to_read():
    beats = {0: beat(7, "step", 4), 1: beat(6, "after step", 3)}
    line = hang.describe(beats, 2, 5, FOLDER)
    assert line == (
        "hang: rank 1 stopped after step 3 and did not reach step 4, where rank 0 waits (no "
        "progress for 5s, dist.hang_s); every rank's Python stack is in runs/digits/r1/hang/, "
        "rank 1's in rank1.txt; rerun with run.name=r1 to resume from its last checkpoint"
    )


def test_several_behind_and_ranks_without_a_heartbeat_or_a_stack_are_named():
    beats = {
        0: beat(9, "checkpoint", 20),
        1: beat(8, "stop check", 20, dumped=False),
        2: beat(9, "checkpoint", 20),
        3: None,
        4: beat(8, "stop check", 20),
    }
    line = hang.describe(beats, 5, 600, FOLDER)
    assert line.startswith(
        "hang: ranks 1, 4 stopped in the stop-signal check after step 20 and did not reach "
        "the checkpoint at step 20, where ranks 0, 2 wait (no progress for 600s"
    )
    assert "; no heartbeat from rank 3; no stack from ranks 1, 3; " in line
    assert "rank 1's in rank1.txt" in line


def test_ranks_all_at_one_place_are_a_deadlock_with_none_behind():
    beats = {0: beat(4, "evaluation", 10), 1: beat(4, "evaluation", 10)}
    line = hang.describe(beats, 2, 5, FOLDER)
    assert line.startswith("hang: every rank stopped in the evaluation at step 10 (no progress")
    assert "none behind the others" in line


def test_one_process_names_where_it_stopped_and_its_stack_file():
    line = hang.describe({0: beat(6, "after step", 3)}, 1, 2, FOLDER)
    assert line.startswith("hang: no progress for 2s, dist.hang_s, after step 3; ")
    assert "is in runs/digits/r1/hang/rank0.txt" in line


def wait_for(condition, seconds):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def test_a_stalled_process_dumps_every_thread_and_says_one_line(tmp_path, capfd):
    hang.reset()
    folder = tmp_path / "r" / "hang"
    dog = hang.Watchdog(folder, 0.3, isolate=False)
    dog.start()
    hang.beat("step", 1)
    hang.beat("after step", 1)  # armed: the first step ended
    try:
        assert wait_for(lambda: dog.exit_code is not None, 20)
    finally:
        dog.stop()
    assert dog.exit_code == hang.HANG_EXIT
    stack = (folder / "rank0.txt").read_text()
    assert stack.startswith("rank 0 of 1, pid ") and "after step 1" in stack.splitlines()[0]
    assert "wait_for" in stack  # this test's main thread, seen from the watchdog's
    err = capfd.readouterr().err.strip().splitlines()
    assert err[-1] == f"error: {dog.line}" and "after step 1" in dog.line


@pytest.mark.slow  # waits out real timeouts: seconds
def test_a_rank_waits_while_another_progresses_alone_then_asks_all_and_names_itself(
    tmp_path, capfd
):
    """Rank 0's watch, rank 1 played by the test through its files: while rank 1 makes
    progress alone (e.g. writes files the others wait for), no dump; once nothing moves, rank
    0 asks every rank for its stack, waits for rank 1's and, the lowest, says the line."""
    hang.reset()
    folder = tmp_path / "r1" / "hang"
    folder.mkdir(parents=True)

    def rank1(beat_at: float, dumped=False):
        facts = {"rank": 1, "marks": 3, "what": "checkpoint", "step": 2, "time": beat_at}
        (folder / "heartbeat-rank1.json").write_text(json.dumps(facts | {"dumped": dumped}))

    # Rank 1's beat is dated an hour ahead while it "moves": recent to the watchdog however
    # late this thread runs (a beat every 0.1 s against hang_s=1 s failed on a busy machine).
    rank1(time.time() + 3600)
    dog = hang.Watchdog(folder, 1.0, rank=0, world=2, isolate=False)
    dog.start()
    hang.beat("step", 2)
    hang.beat("after step", 2)
    try:
        time.sleep(2.5)  # longer than hang_s, rank 1 moving all along
        assert dog.exit_code is None and not (folder / hang.REQUEST).exists()
        rank1(time.time() - 3600)  # then nothing moves anywhere
        assert wait_for(lambda: (folder / hang.REQUEST).exists(), 60)
        rank1(time.time(), dumped=True)  # rank 1 answers with its stack
        assert wait_for(lambda: dog.exit_code is not None, 60)
    finally:
        dog.stop()
    assert dog.line.startswith(
        "hang: rank 0 stopped after step 2 and did not reach the checkpoint at step 2, where "
        "rank 1 waits (no progress for 1s, dist.hang_s); every rank's Python stack is in "
    )
    assert capfd.readouterr().err.strip().splitlines()[-1] == f"error: {dog.line}"
    assert (folder / hang.REPORTED).exists() and (folder / "rank0.txt").exists()
    mine = json.loads((folder / "heartbeat-rank0.json").read_text())
    assert mine["dumped"] and (mine["marks"], mine["what"], mine["step"]) == (2, "after step", 2)


@pytest.mark.slow  # waits out real timeouts: seconds
def test_progress_keeps_it_quiet_and_an_unfinished_first_step_is_not_timed(tmp_path):
    hang.reset()
    dog = hang.Watchdog(tmp_path / "hang", 1.0, isolate=False)
    dog.start()
    try:
        hang.beat("step", 1)  # a first step (compilation, loader start-up): never timed
        time.sleep(1.5)
        assert dog.exit_code is None
        hang.beat("after step", 1)
        hang.beat("evaluation", 1)
        for _ in range(30):  # an evaluation longer than hang_s, batch by batch
            hang.touch()
            time.sleep(0.05)
        hang.beat("checkpoint", 1)
        assert dog.exit_code is None
    finally:
        dog.stop()
    assert dog.exit_code is None and not (tmp_path / "hang").exists()


def watchdogs() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "hang-watchdog"]


def test_hang_s_zero_starts_no_thread_and_the_watch_ends_with_the_loop(tmp_path):
    with hang.watch(tmp_path, 0, DistEnv()) as dog:
        assert dog is None and not watchdogs()
    with hang.watch(tmp_path, 300, DistEnv()) as dog:
        assert dog is not None and watchdogs() == [dog._thread]
    assert not watchdogs()
    assert not (tmp_path / "hang").exists()  # one process: nothing written unless it hangs


def test_hang_s_is_a_resume_safe_dist_key_that_refuses_negatives():
    assert any("dist.hang_s".startswith(key) for key in resume_safe_keys())
    assert load_config("digits", ["dist.hang_s=0"])[0].dist.hang_s == 0
    with pytest.raises(ConfigError, match="dist.hang_s"):
        load_config("digits", ["dist.hang_s=-1"])
