"""loader.decode_ahead (engine.data.prefetch): a thread finishes the next batches on the device
while the step runs. The loop must see what it saw without it: the same Samples in the same
order, each error at its own batch with its own message, and no thread left behind by a pass it
leaves early. On the CPU the same thread runs without streams; on CUDA (marked gpu) with its
stream, its events and a matmul load on the training stream."""

import _thread
import gc
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bench.jpegs import write_jpeg_folder
from engine import assemble, evaluate
from engine import distributed as D
from engine.catalog import load_config
from engine.config import LoaderConfig
from engine.data.errors import DataError
from engine.data.loaders import eval_loader, train_loader
from engine.data.prefetch import FinishAhead, Finished, finish_ahead
from engine.data.sampler import GlobalBatchSampler, plan_batches
from engine.run import Run
from engine.train import fit
from engine.vision.gpu_decode import DeviceDecodedFiles, crop_flip_batch, decode_batch
from engine.vision.imagefolder import folder_indexes
from engine.vision.images import ImageAugment, normalise_on_device
from tests.datagen_images import plant_not_an_image, settle, wnid, write_image_folder
from tests.engine.vision.test_gpu_decode import (
    plant_bad_huffman_table,
    torchvision_per_image,
    whole_batch,
)

CPU = torch.device("cpu")
AUG = ImageAugment(train_size=48, scale_min=0.2, eval_resize=56, eval_size=48)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_image_folder(tmp_path_factory.mktemp("ahead") / "imagenet", 3, 8, 3, (60, 80))


def dataset(root: Path, train: bool = True, aug: ImageAugment = AUG) -> DeviceDecodedFiles:
    return DeviceDecodedFiles(folder_indexes(root)[0 if train else 1], aug, train)


def loader_of(data, seed=0, epoch=0, workers=0, device=CPU, skip_bad=False, persistent=False):
    sampler = GlobalBatchSampler(len(data), plan_batches(4, 4, 1), rank=0, seed=seed)
    sampler.set_epoch(epoch)
    cfg = LoaderConfig(num_workers=workers, persistent_workers=persistent)
    return train_loader(data, sampler, cfg, device, skip_bad), sampler


def ahead(loader, data, depth=1, device=CPU, memory_format=None) -> FinishAhead:
    """Forced: a thread, and CUDA streams only on CUDA."""
    return FinishAhead(loader, data.finish_on_device, device, depth, memory_format)


def synchronous(loader, data, device=CPU) -> list:
    """What the loop did without decode_ahead: each batch finished as the step takes it."""
    return [b._replace(x=data.finish_on_device(b.x, device)) for b in loader]


def assert_same(expected: list, got: list) -> None:
    assert len(got) == len(expected) > 0
    for a, b in zip(expected, got, strict=True):
        assert isinstance(b.x, Finished)
        assert torch.equal(a.x, b.x.tensor)
        assert torch.equal(a.y, b.y) and torch.equal(a.index, b.index)
        assert torch.equal(a.replaced, b.replaced)


def ahead_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "finish-ahead"]


def no_thread_within(seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while ahead_threads() and time.monotonic() < deadline:
        time.sleep(0.02)
    return not ahead_threads()


@pytest.mark.parametrize("depth", [1, 3])
def test_the_same_samples_in_the_same_order(data, depth):
    train = dataset(data)
    loader, _ = loader_of(train, seed=3, epoch=1)
    expected = synchronous(loader, train)
    wrapped = ahead(loader, train, depth)
    assert len(wrapped) == len(loader) and wrapped.batch_sampler is loader.batch_sampler
    assert_same(expected, list(wrapped))
    assert_same(expected, list(wrapped))  # a second pass: the same again
    assert no_thread_within()
    evaluation = dataset(data, train=False)
    loader = eval_loader(evaluation, 4, 0, 1, LoaderConfig(), CPU)
    assert_same(synchronous(loader, evaluation), list(ahead(loader, evaluation, depth)))


def test_persistent_workers_an_epoch_left_early_then_resumed_mid_epoch(data):
    """The loader's iterator is the same object each epoch: the pass left early must not take
    batches of the next one."""
    train = dataset(data)
    loader, sampler = loader_of(train, seed=1, workers=2, persistent=True)
    wrapped = ahead(loader, train, depth=2)
    batches = iter(wrapped)
    first = [next(batches) for _ in range(2)]  # the loop stops here (stop_at_step, say)
    sampler.set_epoch(0, start_sample=8)  # the resumed run's position
    rest = list(wrapped)
    assert not batches.handle.thread.is_alive()
    reference, _ = loader_of(train, seed=1)
    assert_same(synchronous(reference, train), first + rest)
    sampler.set_epoch(1)
    got = list(wrapped)
    reference, _ = loader_of(train, seed=1, epoch=1)
    assert_same(synchronous(reference, train), got)
    wrapped.close()
    loader._iterator._shutdown_workers()
    assert no_thread_within()


def test_the_loader_is_iterated_by_the_caller_and_consumed_by_the_thread(data):
    train = dataset(data)
    loader, _ = loader_of(train)
    seen = {"iter": [], "next": [], "finish": []}

    class Watched:
        num_workers = 0

        def __len__(self):
            return len(loader)

        def __iter__(self):
            seen["iter"].append(threading.current_thread())
            source = iter(loader)

            class Source:
                def __next__(self):
                    seen["next"].append(threading.current_thread())
                    return next(source)

            return Source()

    def finish(x, device):
        seen["finish"].append(threading.current_thread())
        return train.finish_on_device(x, device)

    batches = list(FinishAhead(Watched(), finish, CPU))
    assert len(batches) == len(loader)
    assert seen["iter"] == [threading.main_thread()]
    assert {t.name for t in seen["next"] + seen["finish"]} == {"finish-ahead"}


def test_a_pass_left_early_stops_its_thread(data):
    train = dataset(data)
    loader, _ = loader_of(train)
    batches = iter(ahead(loader, train, depth=2))
    next(batches)
    assert len(ahead_threads()) == 1
    del batches  # the loop returned (stop_at_step, preemption): the iterator is garbage
    gc.collect()
    assert no_thread_within()
    wrapped = ahead(loader, train)
    iter(wrapped)
    iter(wrapped)  # the next epoch's iter() stops the last pass's thread first
    assert len(ahead_threads()) == 1
    wrapped.close()
    assert not ahead_threads()


def test_an_error_surfaces_at_its_batch_with_the_same_message(tmp_path):
    root = write_image_folder(tmp_path / "imagenet", 2, 8, 1, size=(60, 80))
    plant_bad_huffman_table(root / "train" / wnid(1) / f"{wnid(1)}_3.JPEG")
    plant_not_an_image(root / "train" / wnid(0) / f"{wnid(0)}_5.JPEG")
    settle(root)
    train = dataset(root)
    for skip_bad in (True, False):  # a file failing on the device; then also in the loader
        loader, _ = loader_of(train, seed=2, skip_bad=skip_bad)
        expected, got = outcomes(iter(loader), train), outcomes(iter(ahead(loader, train)), None)
        assert [kind for kind, _ in got] == [kind for kind, _ in expected]
        errors = [text for kind, text in got if kind == "error"]
        assert errors == [text for kind, text in expected if kind == "error"] and errors
        assert all(
            isinstance(e, str) and "\n" not in e and "unreadable sample" in e for e in errors
        )
    assert no_thread_within()


def outcomes(batches, data, limit: int = 8) -> list[tuple[str, str]]:
    """("batch", "") or ("error", its message) for each batch the loop asks for; data: finish
    there (the synchronous loop), None: already finished."""
    seen = []
    for _ in range(limit):
        try:
            batch = next(batches)
            if data is not None:
                data.finish_on_device(batch.x, CPU)
            seen.append(("batch", ""))
        except StopIteration:
            break
        except DataError as err:
            seen.append(("error", str(err)))
    return seen


def test_keyboard_interrupt_in_the_thread_or_while_waiting_leaves_nothing_behind(data):
    train = dataset(data)
    loader, _ = loader_of(train)

    def interrupted(x, device):
        raise KeyboardInterrupt

    batches = iter(FinishAhead(loader, interrupted, CPU))
    with pytest.raises(KeyboardInterrupt):
        next(batches)
    with pytest.raises(StopIteration):
        next(batches)
    assert no_thread_within()

    # Ctrl-C while the loop waits for a batch. No batch is finished before the interrupt has
    # arrived, however late the timer fires: with a fixed delay per batch instead, a loaded
    # machine once let the pass end first (StopIteration).
    released = threading.Event()

    def held(x, device):
        released.wait(timeout=30)
        return train.finish_on_device(x, device)

    batches = iter(FinishAhead(loader, held, CPU))
    # Python's own handler, whatever the process had: Ctrl-C raises KeyboardInterrupt
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Timer(0.05, _thread.interrupt_main).start()
        with pytest.raises(KeyboardInterrupt):
            next(batches)
    finally:
        signal.signal(signal.SIGINT, previous)
        released.set()
    del batches
    assert no_thread_within()


def test_run_to_device_takes_a_finished_batch_as_it_is():
    finished = torch.rand(2, 3, 4, 4)
    run = SimpleNamespace(device=CPU, net=SimpleNamespace(layout=torch.channels_last))

    class Data:
        def finish_on_device(self, x, device):
            raise AssertionError("finished twice")

    x, y = Run.to_device(run, Finished(finished), torch.tensor([1, 2]), Data())
    assert torch.equal(x, finished) and x.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(y, torch.tensor([1, 2]))


def test_it_applies_only_to_a_dataset_that_asks_on_cuda_with_loader_workers(data):
    train = dataset(data)
    with_workers = SimpleNamespace(num_workers=2)
    assert finish_ahead(with_workers, train, CPU) is with_workers  # the CPU: as before
    plain = SimpleNamespace(finish_on_device=train.finish_on_device)
    cuda = torch.device("cuda")
    assert finish_ahead(with_workers, plain, cuda) is with_workers  # e.g. ImageFiles' normalise
    assert finish_ahead(SimpleNamespace(num_workers=0), train, cuda).num_workers == 0
    assert finish_ahead(with_workers, train, cuda, depth=0) is with_workers
    assert DeviceDecodedFiles.finishes_ahead


# ---------------------------------------------------------------- under load, CUDA or CPU


def training_load(device: torch.device) -> torch.Tensor:
    """A step's worth of work queued on the training stream."""
    n = 8192 if device.type == "cuda" else 256  # ~10 ms on an H200
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16 if device.type == "cuda" else None)
    for _ in range(8):
        a = (a @ a).tanh()
    return a


def compare_under_load(root: Path, device: torch.device, train: bool) -> None:
    """Finished ahead (a thread, and on CUDA its stream) while matmuls keep the training
    stream busy: each batch read there and freed at once, so an early reuse of its memory by
    the finishing stream would show. Bitwise what the step's own decode gives, and what
    torchvision's per-image steps gave before batching."""
    data = dataset(root, train, ImageAugment())
    cfg = LoaderConfig(num_workers=2, persistent_workers=False)
    if train:
        sampler = GlobalBatchSampler(len(data), plan_batches(4, 4, 1), rank=0, seed=5)
        loader = train_loader(data, sampler, cfg, device)
    else:
        loader = eval_loader(data, 4, 0, 1, cfg, device)
    raw = list(loader)
    expected = [b._replace(x=data.finish_on_device(b.x, device)) for b in raw]
    per_image = [torchvision_per_image(data, b.x, device) for b in raw]
    per_image = [normalise_on_device(x, device, data.mean, data.std) for x in per_image]
    run = SimpleNamespace(device=device, net=SimpleNamespace(layout=torch.channels_last))
    got = []
    for batch in FinishAhead(loader, data.finish_on_device, device, 1, torch.channels_last):
        training_load(device)
        x, _ = Run.to_device(run, batch.x, batch.y, data)
        got.append(batch._replace(x=Finished(x.clone())))  # queued after the load
        del x, batch  # freed: its memory must wait for the clone
    assert_same(expected, got)
    for a, b in zip(per_image, got, strict=True):
        assert torch.equal(a, b.x.tensor)


def test_under_load_on_the_cpu_bitwise(tmp_path):
    root = write_jpeg_folder(tmp_path / "photos", classes=2, train_per_class=8, val_per_class=4)
    for train in (True, False):
        compare_under_load(root, CPU, train)
    assert no_thread_within()


@pytest.mark.gpu  # CUDA streams, events and nvJPEG
def test_on_cuda_finished_ahead_is_bitwise_the_step_s_decode_and_launches_fewer_kernels(
    tmp_path,
):
    root = write_jpeg_folder(tmp_path / "photos", classes=2, train_per_class=12, val_per_class=6)
    cuda = torch.device("cuda")
    for train in (True, False):
        compare_under_load(root, cuda, train)
    assert no_thread_within()
    data, x = whole_batch(root, train=True)
    x = x.pin_memory()
    images = decode_batch(x, cuda)
    torch.cuda.synchronize()
    counts = []
    for batched in (False, True):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            if batched:
                crop_flip_batch(images, x.boxes, x.flips, x.size)
            else:
                torchvision_per_image(data, x, cuda, images)
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        counts.append(len(kernels))
    print(f"CUDA kernels for {len(images)} images: per image {counts[0]}, batched {counts[1]}")
    if counts[0]:  # 0: the profiler saw no kernels here (CUPTI); the op count test holds
        assert counts[1] < 0.7 * counts[0]


@pytest.mark.slow
def test_the_engine_s_loop_through_it_trains_bitwise_as_without(tmp_path, monkeypatch):
    """engine.train unchanged: iter(run.feed.loader) and run.to_device per micro batch, two micro
    batches per step (two batches ahead), an epoch end, an evaluation, then a run stopped by
    train.stop_at_step mid-epoch; the same weights and evaluation, bit for bit."""
    root = write_image_folder(tmp_path / "imagenet", 2, 6, 2, size=(40, 48))
    passes = []

    def forced(loader, data, device, depth=1, memory_format=None):
        if not getattr(data, "finishes_ahead", False):
            return loader
        passes.append(depth)
        return FinishAhead(loader, data.finish_on_device, device, depth, memory_format, False)

    results = {}
    for name, ahead_on in (
        ("sync", False),
        ("ahead", True),
        ("sync-stop", False),
        ("ahead-stop", True),
    ):
        if ahead_on:
            monkeypatch.setattr(assemble, "finish_ahead", forced)
            monkeypatch.setattr(evaluate, "finish_ahead", forced)
        overrides = [
            "log.wandb=off",
            "log.progress=off",
            "device=cpu",
            f"run.root={tmp_path / 'runs'}",
            f"run.name={name}",
            f"data.root={root}",
            "data.decode=gpu",
            "model.arch=resnet18",
            "train.batch_size=4",
            "train.micro_batch_size=2",
            "eval.batch_size=4",
            "data.augment.train_size=32",
            "data.augment.eval_resize=36",
            "data.augment.eval_size=32",
            "loader.num_workers=0",
            "train.max_steps=4",
        ]
        if name.endswith("stop"):
            overrides.append("train.stop_at_step=2")
        cfg, recipe = load_config("imagenet", overrides)
        run = assemble.setup(cfg, recipe, D.DistEnv(), CPU)
        try:
            reason = fit(run)
        finally:
            run.records.tracker.close()
            monkeypatch.undo()
        results[name] = (reason, run.records.last_eval, run.net.bare.state_dict())
        assert isinstance(run.feed.loader, FinishAhead) == ahead_on
        assert no_thread_within()
    # training (2 micro batches a step), evaluations at the epoch's end (step 3) and the
    # last step; the stopped run's training
    assert passes == [2, 1, 1, 2]
    for sync, ahead_ in (("sync", "ahead"), ("sync-stop", "ahead-stop")):
        (reason, evaluation, weights), (reason_, evaluation_, weights_) = (
            results[sync],
            results[ahead_],
        )
        assert reason == reason_ and evaluation == evaluation_
        assert weights.keys() == weights_.keys()
        assert all(torch.equal(weights[k], weights_[k]) for k in weights)
    assert results["ahead-stop"][0] == "stop_at_step"


@pytest.mark.parametrize("depth", [3, 5])
def test_a_consumer_slower_than_the_thread_still_takes_the_batches_in_order(data, depth):
    """The loop asks for its first batch only once the thread is finishing its `depth`-th
    (the loop was busy with a step): the depth - 1 batches before it, queued by then, wait in
    the order they were loaded, not newest first."""
    train = dataset(data)
    loader, _ = loader_of(train, seed=2)
    expected = synchronous(loader, train)
    assert len(expected) > depth
    finishing, queued = [], threading.Event()

    def finish(x, device):
        finishing.append(x)
        if len(finishing) == depth:  # the batches before this one are queued: at least two
            queued.set()
        return train.finish_on_device(x, device)

    batches = iter(FinishAhead(loader, finish, CPU, depth))
    assert queued.wait(timeout=30)
    assert_same(expected, list(batches))
    assert no_thread_within()
