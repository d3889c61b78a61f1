"""The one-shot GPU benchmark: every speed figure of the repo in one run, into one JSON file.

Run it from the repository root on a machine with one NVIDIA GPU:

    make gpu-wheels                            # once, with network: .gpu-wheels/ (see below)
    bash bench/gpu.sh                          # at most 8 minutes; prints the JSON path
    OUT=/some/dir bash bench/gpu.sh            # writes $OUT/gpu.json instead of runs/bench/
    GPU_BENCH_BUDGET_S=240 bash bench/gpu.sh   # a shorter budget: later items shrink or skip
    bash bench/gpu.sh --smoke                  # tiny sizes (CPU when no GPU): proves the code
    bash bench/gpu.sh --only resnet50_synthetic,cifar10_fast   # a subset, e.g. for a rerun
    bash bench/gpu.sh --only gpt.speed.compiled,resnet50_synthetic.eager   # single parts
    RECIPES_GIT_SHA=<sha> bash bench/gpu.sh    # records the commit where the copy has no .git
    GPU_BENCH_PYTHON=.venv/bin/python bash bench/gpu.sh   # another interpreter than python3

bench/gpu.sh runs `python -m bench.gpu`, then, where torch sees a CUDA device and pytest is
there (smoke or not; GPU_BENCH_TESTS=0: never), the tests marked gpu, at most 135 s: with the
budget and the watchdog's grace, 330 + 15 + 135 s = 8 minutes at most. It needs only python3
with torch, torchvision, numpy, pyyaml, pillow and scikit-learn (no W&B, no submitit, no
matplotlib, no safetensors, no network), and puts the repository on PYTHONPATH itself: on a
machine with those but not the project's lock, `bash bench/gpu.sh` from the checkout is the
whole command.

Two packages such a machine lacks: torchcodec (the engine decodes image files through it:
imagenet_jpeg and decode_stages) and airbench (cifar10_fast.airbench94). `make gpu-wheels`,
where there is network, downloads into .gpu-wheels/ torchcodec 0.17.0's wheel for CPython
3.12 on manylinux x86_64 and airbench 0.1.8's sdist; bench/gpu.sh installs each wheel found
there (or in $GPU_BENCH_WHEELS) with pip install --no-deps --target into a temporary folder,
unpacks each sdist, puts them on PYTHONPATH, and says in one line which needed package still
does not import. The parts that need it are then skipped with the reason; nothing else
changes.

Each measurement is made of parts (sizes.PARTS: resnet50_synthetic.eager and .compiled,
imagenet_jpeg.cpu_decode and .gpu_decode, decode_stages.decode, .augment, .finish_thread,
.engine.* and .split.*, cifar10_fast.generated, .airbench94 and .real_data,
determinism.eager and .compiled, gpt.speed.*, gpt.micro_batch.* and gpt.memory.*), each
run by harness.attempt() in its own try/except and filed under its dotted name in the JSON,
which is rewritten (atomically) as each part starts and ends. A failure is recorded
(`status: error`, the error line and the end of the traceback) and the next part runs.
--only takes measurements, parts or groups (gpt.speed); an unknown name is refused with the
valid ones. A part that does not fit the time left is skipped with the reason, or
shrinks (half the timed steps, `budget_tight: true`). The default budget is 330 s
(GPU_BENCH_BUDGET_S or --budget; smoke 300 s), of which the plan (sizes.planned_s) uses 280 s:
the rest is a margin for compilation on an empty inductor cache. A watchdog stops the script
once the budget is overrun by 15 s: the parts that ended are kept, the part running and its
measurement are marked `aborted` (the top-level `aborted` names the part), the measurements
after it `not reached`. GPU_BENCH_PLANT_STALL=<part> makes that part stall, to test this.

Warm-up steps, compilation included, are never in a throughput; every timed span starts and
ends with torch.cuda.synchronize. The measurements, in run order, each in its own module whose
docstring says what its figures mean:

  versions            versions.py    python, torch, torchvision, CUDA, cuDNN, GPU, driver, git SHA
  resnet50_synthetic  resnet.py      (a) ResNet-50 images/s, engine against a bare loop
  imagenet_jpeg       jpeg.py        (b) the same from 20,480 generated JPEGs, CPU and GPU
                                     decode, each window's breakdown, one evaluation pass
  decode_stages       decode_stages.py  (b) stage by stage: decode, augment, the finishing
                                     thread alone; the engine at decode_ahead 1 and 3 and two
                                     worker counts; the GPU/CPU decode split
  cifar10_fast        cifar10.py     (c) CIFAR-10 fast: seconds per epoch, projected budget;
                                     airbench94's own code on the same data
  compile_recompiles  recompiles.py  (d) torch.compile recompilations and graph breaks
  determinism         determinism.py  two runs and a stop/resume: final weights bitwise equal?
  gpt                 gpt.py         (f) recipes/gpt tokens/s, MFU (also at micro batch 32 and
                                     64) and memory against its estimate
  tensor_parallel     tensor_parallel.py  (g) gpt 124m on two GPUs, dist.tp=1 against tp=2
                                     (skipped with fewer than two GPUs)
  memory_and_mfu      memory_mfu.py  (e) every path's memory high-water mark and MFU in one table

The plumbing they share: sizes.py (names and parts, budget, targets, references, full and
smoke sizes),
harness.py (budget, attempt, JSON, watchdog, timing, MFU), compile_log.py (dynamo counters),
engine_runs.py (the engine driven step by step); __main__.py parses the flags and runs them.

The printed summary puts each figure beside what it is compared with: (a) engine and bare
img/s against >= 3500 and engine/bare against >= 0.95; (b) the JPEG folder's generation time,
each decode path's img/s over (a)'s engine figure (GPU decode against >= 0.90) and its
evaluation pass; the decode stages' img/s and each engine run's largest shares of its time;
(c) the projected time of the fast variant's 475 steps beside airbench94's 3.83 s on an A100
and airbench94's own time on this GPU; (d) recompilations and graph breaks (0 is the aim);
determinism: equal or not, and the largest difference; (f) tokens/s and MFU, MFU by micro
batch, and the 1b model's memory high-water mark beside recipes/gpt/memory.py's estimate. A
part that did not run says why on its line, and each measurement that did not end ok is
listed at the end with the reason.
The JSON also holds published reference figures (labelled references, with their sources).
"""
