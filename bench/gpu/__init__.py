"""The one-shot GPU benchmark: every speed figure of the repo in one run, into one JSON file.

Run it from the repository root on a machine with one NVIDIA GPU:

    bash bench/gpu.sh                          # 7.5 minutes at most; prints the JSON path
    OUT=/some/dir bash bench/gpu.sh            # writes $OUT/gpu.json instead of runs/bench/
    GPU_BENCH_BUDGET_S=300 bash bench/gpu.sh   # a shorter budget: later items shrink or skip
    bash bench/gpu.sh --smoke                  # tiny sizes (CPU when no GPU): proves the code
    bash bench/gpu.sh --only resnet50_synthetic,cifar10_fast   # a subset, e.g. for a rerun
    RECIPES_GIT_SHA=<sha> bash bench/gpu.sh    # records the commit where the copy has no .git
    GPU_BENCH_PYTHON=.venv/bin/python bash bench/gpu.sh   # another interpreter than python3

(bench/gpu.sh runs `python -m bench.gpu`, then the tests marked gpu.) It needs only python3
with torch, torchvision, numpy, pyyaml, pillow and scikit-learn (no W&B, no submitit, no
network). Each measurement runs in its own try/except: a failure is recorded in the JSON
(`status: error`, the error line and the end of the traceback) and the next one runs. A
measurement that does not fit the time left is skipped with the reason, or shrinks (half the
timed steps, `budget_tight: true`); a watchdog writes the JSON and stops the script once the
budget (default 440 s, GPU_BENCH_BUDGET_S or --budget) is overrun by 15 s. The JSON is
rewritten after every measurement, so a killed run still leaves what it measured.

Warm-up steps, compilation included, are never in a throughput; every timed span starts and
ends with torch.cuda.synchronize. The measurements, in run order, each in its own module whose
docstring says what its figures mean:

  versions            versions.py    python, torch, torchvision, CUDA, cuDNN, GPU, driver, git SHA
  resnet50_synthetic  resnet.py      (a) ResNet-50 images/s, engine against a bare loop
  imagenet_jpeg       jpeg.py        (b) the same from a folder of JPEGs, CPU and GPU decode
  cifar10_fast        cifar10.py     (c) CIFAR-10 fast: seconds per epoch, projected budget
  compile_recompiles  recompiles.py  (d) torch.compile recompilations and graph breaks
  gpt                 gpt.py         (f) recipes/gpt tokens/s, MFU and memory against its estimate
  memory_and_mfu      memory_mfu.py  (e) every path's memory high-water mark and MFU in one table

The plumbing they share: sizes.py (names, targets, references, full and smoke sizes),
harness.py (budget, attempt, JSON, watchdog, timing, MFU), compile_log.py (dynamo counters),
engine_runs.py (the engine driven step by step); __main__.py parses the flags and runs them.

The printed summary puts each figure beside its target; the JSON also holds published
reference figures (labelled references, with their sources) for comparison.
"""
