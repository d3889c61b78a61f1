"""The prof section's one-line behaviour on the CPU: bad windows and ranks refused, the memory
option said to be CUDA's, an out-of-memory error turned into one line. The traces themselves
are tested on two gloo processes (tests/distributed/test_distributed.py), the memory snapshot
on a GPU (tests/gpu/test_memory_snapshot.py)."""

from __future__ import annotations

import json

import pytest
import torch

from engine import lifecycle
from engine.config import ConfigError
from engine.faults import RunError
from engine.meter import clocked
from engine.profile import Window, parse_ranks, parse_steps
from tests.helpers import final_weights, records, run_dir, same_weights


@pytest.mark.parametrize(
    "text, window", [("", None), ("4:6", Window(4, 6)), (" 7 : 7 ", Window(7, 7))]
)
def test_a_window_is_two_steps(text, window):
    assert parse_steps(text) == window


@pytest.mark.parametrize("text", ["6:4", "0:3", "4", "a:b", "4-6"])
def test_a_bad_window_is_one_line_naming_the_key_and_the_form(text):
    with pytest.raises(ConfigError, match=r"prof\.steps=.*A:B") as err:
        parse_steps(text)
    assert "\n" not in str(err.value)


def test_ranks_are_all_or_a_list_within_the_world():
    assert parse_ranks("all", 3) == {0, 1, 2}
    assert parse_ranks("0,2", 3) == {0, 2}
    for bad in ("3", "x", "", "0,-1"):
        with pytest.raises(ConfigError, match="prof.ranks"):
            parse_ranks(bad, 3)


@pytest.mark.slow
def test_memory_history_on_the_cpu_is_said_once_and_changes_nothing(tmp_path, train_here):
    train_here(tmp_path, "memory", "train.max_steps=3", "prof.memory=true")
    log = (run_dir(tmp_path, "memory") / "train.log").read_text()
    assert log.count("prof.memory applies to CUDA only") == 1
    assert not (run_dir(tmp_path, "memory") / "profile").exists()


@pytest.mark.slow
def test_out_of_memory_is_one_line_naming_the_step_and_the_fix(tmp_path, train_here, monkeypatch):
    def out_of_memory(run):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(lifecycle, "fit", out_of_memory)
    with pytest.raises(RunError) as err:
        train_here(tmp_path, "oom", "train.max_steps=3")
    line = str(err.value)
    assert "\n" not in line and "out of memory on cpu at step 1" in line
    assert "train.micro_batch_size" in line and "prof.memory=true" in line


@pytest.mark.slow
def test_a_profiled_run_trains_exactly_like_an_unprofiled_one_with_dropout(tmp_path, train_here):
    """Dropout draws from the generator at every step: a profiling window that drew a single
    number more (or fewer) would change every loss after it, and the weights."""
    same = ["train.max_steps=8", "log.every_steps=1", "model.dropout=0.2"]
    train_here(tmp_path, "plain", *same)
    train_here(tmp_path, "profiled", *same, "prof.steps=3:5")
    assert (run_dir(tmp_path, "profiled") / "profile").is_dir()

    def losses(name: str) -> list[dict]:
        return [
            {k: v for k, v in r.items() if not clocked(k)} for r in records(tmp_path, name, "train")
        ]

    assert losses("plain") == losses("profiled") and len(losses("plain")) == 8
    assert same_weights(final_weights(tmp_path, "plain"), final_weights(tmp_path, "profiled"))


@pytest.mark.slow
def test_a_run_ending_inside_the_window_writes_the_steps_it_recorded(tmp_path, train_here):
    """prof.steps=4:9 in a 5-step run: torch's schedule warms up on step 3 and records 4 and 5,
    each a ProfilerStep#N span holding the run's `step n`; the trace is written at the end."""
    train_here(tmp_path, "short", "train.max_steps=5", "prof.steps=4:9")
    folder = run_dir(tmp_path, "short") / "profile"
    assert sorted(p.name for p in folder.iterdir()) == [
        "rank0-steps4-end.summary.json",
        "rank0-steps4-end.trace.json",
    ]
    events = json.loads((folder / "rank0-steps4-end.trace.json").read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert {"step 4", "step 5", "ProfilerStep#1", "ProfilerStep#2"} <= names
    assert "step 3" not in names  # the warm-up step is not recorded
    summary = json.loads((folder / "rank0-steps4-end.summary.json").read_text())
    assert summary["steps"] == [4, None]
    assert not any(op["name"].startswith("ProfilerStep#") for op in summary["top_ops"])
