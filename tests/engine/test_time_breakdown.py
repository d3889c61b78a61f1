"""Where a window's time went (engine.meter's breakdown, engine.data.stages): present in every
train record, the training thread's shares adding up to its wall time but for the loop's own
bookkeeping, the input stages measured on whichever thread ran them."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from engine.data.prefetch import FinishAhead
from engine.data.stages import STAGES, StageTimes, sample_stage, worker_batch_seconds
from engine.meter import clocked, slowest_worker_stage
from tests.datagen_images import SMALL_ARCH, write_image_folder
from tests.helpers import records

# the loop's own bookkeeping between the measured parts (the progress bar, stop checks, the
# record's writing): measured at 0.2-0.4% of a window in these tiny runs; 20% leaves room for a
# loaded machine without letting a missing part (a third of the time or more) through
BOOKKEEPING = 0.2
THREAD_SHARES = ("data_wait", "to_device", "step_host", "sync", "checkpoint")


def test_concurrent_stage_times_add_up_and_take_resets():
    stages = StageTimes()

    def add():
        for _ in range(1000):
            stages.add("decode", 0.001)

    threads = [threading.Thread(target=add) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert stages.take() == {"decode": pytest.approx(4.0)}
    assert stages.take() == {}


class Sample:
    def __init__(self, x):
        self.x, self.y = x, torch.zeros(1)

    def _replace(self, x):
        out = Sample(x)
        return out


def test_the_finishing_threads_busy_time_is_metered():
    def finish(x, device):
        time.sleep(0.02)
        return x

    class Loader(list):
        num_workers = 1

    ahead = FinishAhead(Loader(Sample(torch.ones(2)) for _ in range(5)), finish, "cpu", 2)
    STAGES.take()
    assert len(list(ahead)) == 5
    busy = STAGES.take()["finish_thread"]
    assert 5 * 0.02 <= busy < 5 * 0.02 + 1.0


@pytest.mark.slow
def test_every_train_record_says_where_its_window_went(tmp_path, train_here):
    """decode=gpu on the CPU, no workers: the batch is decoded and augmented on the training
    thread, inside to_device."""
    root = write_image_folder(tmp_path / "imagenet", classes=2, train_per_class=12)
    tiny = [f"model.arch={SMALL_ARCH}", "train.batch_size=4", "data.augment.train_size=32"]
    tiny += ["data.augment.eval_resize=36", "data.augment.eval_size=32", "train.max_steps=6"]
    tiny += ["loader.num_workers=0", "log.every_steps=2", f"data.root={root}", "data.decode=gpu"]
    train_here(tmp_path, "breakdown", *tiny, recipe="imagenet")
    windows = records(tmp_path, "breakdown", "train", "imagenet")
    assert len(windows) == 3
    for rec in windows:
        measured = (*THREAD_SHARES, "decode", "augment", "step_s", "forward_backward", "optimizer")
        assert all(clocked(k) for k in measured)
        shares = [rec[k] for k in THREAD_SHARES]
        assert all(s >= 0 for s in shares) and rec["decode"] > 0 and rec["augment"] > 0
        assert 1 - BOOKKEEPING <= sum(shares) <= 1 + 1e-9, rec
        assert rec["decode"] + rec["augment"] <= rec["to_device"] + 1e-9  # inside it here
        assert "finish_thread" not in rec and "gpu_data_wait" not in rec  # no thread ahead
        # on the CPU the host computes the step's parts: within the step's host time
        assert 0 < rec["forward_backward"] and 0 < rec["optimizer"]
        assert rec["forward_backward"] + rec["optimizer"] <= rec["step_host"] + 1e-9
        assert "gpu_util" not in rec and "gpu_power_w" not in rec  # CUDA's, through NVML
    assert windows[-1]["step_s"] == pytest.approx(1 / windows[-1]["samples_per_s"] * 4)


def test_the_starvation_warning_names_the_workers_slowest_stage():
    rec = {"worker_read_s": 0.01, "worker_decode_s": 0.078, "worker_augment_s": 0.012}
    assert slowest_worker_stage(rec) == "; its workers spend 78% of their time decoding"
    assert slowest_worker_stage({"data_wait": 0.5}) == ""  # no worker loaded: nothing said


def test_a_batch_loaded_in_the_training_process_carries_no_worker_time():
    """worker_batch_seconds is a worker's: in this process the stages go to STAGES, and the
    batch says nothing (None), so nothing is counted twice."""
    STAGES.take()
    with sample_stage("decode"):
        time.sleep(0.01)
    assert worker_batch_seconds() is None and STAGES.take()["decode"] >= 0.01
