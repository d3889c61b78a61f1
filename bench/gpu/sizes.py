"""What the GPU benchmark measures and how big: the measurement names in run order, their
parts, the default budget, the targets, published reference figures, and the sizes of a full
run and of a smoke run."""

from __future__ import annotations

import dataclasses

MEASUREMENTS = (
    "resnet50_synthetic",
    "imagenet_jpeg",
    "decode_stages",
    "cifar10_fast",
    "compile_recompiles",
    "determinism",
    "gpt",
    "tensor_parallel",
    "memory_and_mfu",
)
# Each measurement's parts (each one attempt(), filed under measurements.<name>.<part> in the
# JSON as soon as it ends), in run order; a measurement not listed is one part.
PARTS = {
    "resnet50_synthetic": ("eager", "compiled"),
    "imagenet_jpeg": ("cpu_decode", "gpu_decode"),
    "decode_stages": (
        "decode",
        "augment",
        "finish_thread",
        "engine.ahead1_half_cores",
        "engine.ahead3_half_cores",
        "engine.ahead1_most_cores",
        "engine.ahead3_most_cores",
        "split.gpu_only",
        "split.cpu_quarter",
    ),
    "cifar10_fast": ("generated", "airbench94", "real_data"),
    "determinism": ("eager", "compiled"),
    "tensor_parallel": ("tp1", "tp2"),
    "gpt": (
        "speed.eager",
        "speed.eager_checkpointing",
        "micro_batch.x2",
        "micro_batch.x4",
        "memory.checkpointing",
        "memory.no_checkpointing",
        "speed.compiled",
    ),
}


def selectable() -> tuple[str, ...]:
    """What --only accepts: each measurement, then its parts and the groups between
    ("gpt", "gpt.memory", "gpt.memory.checkpointing", ...)."""
    names = []
    for name in MEASUREMENTS:
        names.append(name)
        for part in PARTS.get(name, ()):
            steps = part.split(".")
            for k in range(1, len(steps) + 1):
                dotted = ".".join([name, *steps[:k]])
                if dotted not in names:
                    names.append(dotted)
    return tuple(names)


# bench/gpu.sh's whole run within 8 minutes: the budget, the watchdog's 15 s grace past it and
# at most TESTS_S of tests marked gpu (bench/gpu.sh's timeout).
BUDGET_S = 330.0  # the default budget of a full run; a smoke run's is SMOKE_BUDGET_S
SMOKE_BUDGET_S = 300.0
WATCHDOG_GRACE_S = 15.0
TESTS_S = 135  # bench/gpu.sh: timeout of the tests marked gpu
MARGIN = 0.85  # a full run's planned seconds stay within this fraction of BUDGET_S
TARGETS = {
    "resnet50_img_per_s": ">= 3500 (bare and engine, bf16, channels_last, batch 256)",
    "engine_over_bare": ">= 0.95",
    "jpeg_gpu_decode_over_synthetic": ">= 0.90",
}
REFERENCES = [
    {
        "what": "ResNet-50 v1.5 training, mixed precision, 1 GPU of a DGX A100 (A100 80GB)",
        "img_per_s": 2470,
        "source": "NVIDIA DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5/"
        "README.md, 'Training performance: NVIDIA DGX A100 (8x A100 80GB)' (NGC 21.03)",
    },
    {
        "what": "ResNet-50 training, AMP, channels_last, one A100",
        "img_per_s": 2600,
        "source": "timm's benchmark tracker, as quoted when this benchmark was specified "
        "(approximate; the train benchmark CSVs in timm's results/ folder are for an "
        "RTX 3090, so the A100 figure is not traced to a file here)",
    },
    {
        "what": "airbench94: CIFAR-10 to 94.01% top-1, one A100",
        "seconds": 3.83,
        "source": "Keller Jordan, airbench (github.com/KellerJordan/cifar10-airbench), "
        "as quoted in recipes/cifar10/fast.yaml",
    },
]


@dataclasses.dataclass(frozen=True)
class Sizes:
    """How big each measurement is; a full run's planned seconds (planned_s, 280 of the 330 s
    budget) leave a margin for compilation on a fresh inductor cache."""

    arch: str = "resnet50"
    image: int = 224
    batch: int = 256
    amp: str = "bf16"
    device_images: int = 4096  # synthetic uint8 images resident on the device (16 batches)
    warmup_steps: int = 8  # after the first (compiling) step, per path
    segments: int = 3  # timed segments per path, alternating engine and bare
    segment_s: float = 1.5  # aimed length of one timed segment
    segment_steps: tuple[int, int] = (5, 40)  # its bounds in steps
    jpeg_unique: int = 20_480  # distinct JPEG files generated (train)
    jpeg_links: int = 1  # hard links per file: an epoch of unique * links images
    jpeg_val: int = 2048  # distinct JPEG files generated for the evaluation pass
    jpeg_classes: int = 16
    jpeg_window: int = 5  # log.every_steps: the engine meters throughput per window
    jpeg_warmup_steps: int = 10  # first iterator: worker start and compilation
    jpeg_windows: int = 8  # timed windows, after one discarded window of the second iterator
    stage_batches: int = 8  # timed batches of decode_stages' decode, augment, finish_thread
    stage_windows: int = 4  # timed windows of each decode_stages engine run (eager)
    # the decode_stages engine runs and splits made (None: all); a smoke run proves the code
    # of one per kind, not the grid
    stage_runs: tuple[str, ...] | None = None
    determinism_steps: int = 12  # steps of each determinism run (one epoch; resumed halfway)
    determinism_batch: int = 64
    determinism_compiled: bool = True  # also the compiled runs (a smoke run leaves them out)
    determinism_overrides: tuple[str, ...] = (
        "model.arch=resnet18",
        "data.augment.train_size=112",
        "data.augment.eval_size=112",
        "data.augment.eval_resize=128",
    )
    cifar_train: int = 50_000
    cifar_test: int = 10_000
    cifar_epochs: int = 3  # timed epochs after the first (compiling) one
    cifar_overrides: tuple[str, ...] = ()
    cifar_real_overrides: tuple[str, ...] = ()  # the run to the end on real files
    gpt_speed_variant: str = "124m"  # recipes/gpt/<variant>.yaml; "config": config.yaml
    gpt_speed_batch: int = 16  # sequences per step (124m's micro batch per GPU)
    gpt_memory_variant: str = "1b"
    gpt_memory_batch: int = 4
    gpt_seq: int | None = None  # tokens per sequence; None: the variant's data.block_size
    gpt_warmup_steps: int = 3  # after the first (compiling) step
    gpt_segment_s: float = 2.0  # aimed length of the timed span
    gpt_steps: tuple[int, int] = (5, 40)  # its bounds in steps
    gpt_memory_steps: int = 3  # steps after the first whose high-water mark is kept
    gpt_share_s: float = 50.0  # parts start only within this many seconds of the block's start
    compile_backend: str | None = None  # None: torch's default (inductor)
    planned_s: tuple[tuple[str, float], ...] = (  # rough cost on an H100/H200, for the budget
        ("resnet50_synthetic", 65),
        ("imagenet_jpeg", 60),  # generating its JPEGs included (~20 s on 16 cores)
        ("decode_stages", 35),
        ("cifar10_fast", 30),  # airbench94 included
        ("compile_recompiles", 15),
        ("determinism", 25),
        ("gpt", 50),  # = gpt_share_s
        # 0 on the one-GPU machine the plan is for: skipped at once. With two GPUs its two
        # runs (~60 s) start only if the budget has that much left, else say why they did not.
        ("tensor_parallel", 0),
    )


SMOKE = Sizes(
    arch="resnet18",
    image=64,  # the smallest whose last ResNet feature map is larger than 1x1
    batch=4,
    device_images=32,
    warmup_steps=1,
    segments=2,
    segment_s=0.2,
    segment_steps=(2, 3),
    jpeg_unique=16,
    jpeg_links=4,
    jpeg_val=4,
    jpeg_classes=2,
    jpeg_window=1,
    jpeg_warmup_steps=2,
    jpeg_windows=2,
    stage_batches=2,
    stage_windows=1,
    stage_runs=("engine.ahead3_most_cores", "split.cpu_quarter"),
    determinism_steps=2,
    determinism_batch=4,
    determinism_compiled=False,
    determinism_overrides=(
        "model.arch=resnet18",
        "data.augment.train_size=64",
        "data.augment.eval_size=64",
        "data.augment.eval_resize=64",
    ),
    cifar_train=1024,
    cifar_test=256,
    cifar_epochs=1,
    cifar_overrides=("train.batch_size=256", "eval.batch_size=256", "model.widths=[16,32,32]"),
    cifar_real_overrides=("train.max_steps=6",),
    gpt_speed_variant="config",  # ~390 K parameters, 64-byte blocks
    gpt_speed_batch=4,
    gpt_memory_variant="config",
    gpt_memory_batch=2,
    gpt_warmup_steps=1,
    gpt_segment_s=0.2,
    gpt_steps=(2, 3),
    gpt_memory_steps=2,
    gpt_share_s=120.0,
    planned_s=tuple((name, 10.0) for name in MEASUREMENTS),
)
