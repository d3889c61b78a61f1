# The request interface. Every target renders its command through `python -m launch`;
# DRY_RUN=1 (or `make dry-run`) prints that command instead of running it.
#   make train RECIPE=digits GPUS=8 NODES=1 PROCS=1 ARGS="optim.lr=0.2 train.epochs=5"
#   make train RECIPE=imagenet CONFIG=v2     (a named variant: recipes/imagenet/v2.yaml)
#   make recipes                             (lists recipes, variants, what each trains)
#   make config RECIPE=gpt CONFIG=124m       (the resolved config; CONFIG= also takes a file)
# Request variables reach launch through the environment, never through the shell
# line, so a value such as ARGS='"; rm -rf x"' stays an inert argument. Unset ones take
# launch's defaults: RECIPE digits, NODES 1, PROCS 1; GPUS: this machine's for train, the
# recipe's declared slurm.gpus_per_node for submit and SLURM sweeps.

export RECIPE CONFIG GPUS NODES PROCS ARGS IMAGE DRY_RUN SEEDS SWEEP BASELINE PARALLEL WAIT MAX_RESTARTS RUNS ALLOW_CPU CKPT EMA OUT RUN FOLLOW TO
# From another machine: REMOTE=user@login REMOTE_DIR=recipes make submit (or sweep
# TARGET=submit, status, logs, cancel) copies the code there and runs the same command over
# ssh (README: "From your laptop"); REMOTE_PYTHON and REMOTE_SSH as launch/remote.py says.
export REMOTE REMOTE_DIR REMOTE_PYTHON REMOTE_SSH
# The docker client and network (DOCKER_NETWORK=host where dockerd runs without a bridge), and
# what `make image` takes from a site behind a proxy: another base image, and pip's CA bundle
# and index, which reach the build as BuildKit secrets (never in a layer; docs/container.md).
export DOCKER DOCKER_NETWORK BASE_IMAGE CA_BUNDLE PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_TRUSTED_HOST

PYTHON ?= python3
# make test and test-fast spread test modules over this many pytest-xdist workers (both
# cores here); modules go out in their collection order (tests/conftest.py sets it).
TEST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) --no-loadscope-reorder
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-lock

.PHONY: help train eval recipes config shards test test-fast test-container mutants submit sbatch docker-train image sif sweep compare reproduce report publish export bench lint dry-run venv lock clean status logs cancel

# Every target and request variable in one screen (needs no venv); README.md says more.
help:
	@printf '%s\n' \
	"make TARGET [VARIABLE=value ...]; defaults in brackets, README.md and docs/ for more" \
	"" \
	"Training:   train (here) | dry-run (print it) | eval CKPT=... | config (resolved, to stdout)" \
	"            recipes | shards | export CKPT=... OUT=... | docker-train | image | sif" \
	"SLURM:      submit | sbatch (> job.sh) | status | logs RUN=... | cancel RUN=..." \
	"Sweeps:     sweep | compare RUNS=... | report RUNS=... | publish RUNS=... TO=... | reproduce" \
	"Project:    test | test-fast | test-container | mutants | bench | lint | venv | lock | clean" \
	"            gpu-wheels | image-digest | help" \
	"" \
	"Variables (VARIABLE=value; launch/variables.py, the one list):"
	@$(PYTHON) -m launch.variables
	@printf '%s\n' "" \
	"Every setting: python -m engine.train RECIPE --help (each config key, type, default)"

# The venv is rebuilt when it is missing or older than the lock. Everything it says goes to
# stderr: stdout is the target's artefact alone (make config > run.yaml, make sbatch > job.sh).
$(STAMP): requirements.lock
	@echo "make: installing requirements.lock into $(VENV) (once, and after the lock changes)" >&2
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) >&2
	@$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.lock >&2
	@touch $(STAMP)

venv: $(STAMP)

train: $(STAMP)
	@$(PY) -m launch train

# Evaluate only: score a checkpoint, run directory, export or weights file on the recipe's
# held-out split (PROCS/GPUS processes); the result is JSON beside it (<name>.eval.json).
# A run (or a checkpoint in one) is scored with the run's saved config: no RECIPE needed.
#   make eval CKPT=runs/digits/NAME [EMA=1] [OUT=result.json]
eval: $(STAMP)
	@$(PY) -m launch eval

recipes: $(STAMP)
	@$(PY) -m launch recipes

# The resolved config of a request, as the run saves it: save it and rerun it with CONFIG=FILE.
config: $(STAMP)
	@$(PY) -m launch config

# The recipe's class folders (data.root) as tar shards plus an index (data.shards, default
# <data.root>/shards), which training reads with ARGS=data.format=shards; one line per shard.
# Rerun after a stop, it keeps the whole shards and writes the rest:
#   make shards RECIPE=imagenet ARGS="data.root=/data/imagenet data.shards=/lustre/imagenet-shards"
shards: $(STAMP)
	@$(PY) -m launch shards

dry-run: $(STAMP)
	@DRY_RUN=1 $(PY) -m launch train

# Through submitit; DRY_RUN=1 prints the batch script it submits and each task's command.
submit: $(STAMP)
	@$(PY) -m launch submit

# A hand-written batch script for `sbatch FILE` where the login node has no Python for
# submitit: make sbatch RECIPE=imagenet > job.sh
sbatch: $(STAMP)
	@$(PY) -m launch sbatch

# Every combination of comma-separated values times SEEDS seeds (default 3), one after the
# other here or one job array with TARGET=submit (PARALLEL=N: at most N tasks at once), then
# a report of each cell against the baseline; rerunning it runs only what is left:
#   make sweep ARGS="optim.lr=0.05,0.1,0.2 mix.mixup_alpha=0,0.2 run.name=lr" SEEDS=3
#   make sweep SWEEP=sweep.yaml            (grid:, zip:, baseline:, seeds:, name:)
sweep: $(STAMP)
	@$(PY) -m launch sweep

# Finished runs grouped by the settings in which they differ (the seed aside), each group
# against the first (or BASELINE='optim.lr=0.1') by Welch's t-test:
#   make compare RUNS="runs/digits/a-* runs/digits/b-*"
compare: $(STAMP)
	@$(PY) -m launch compare

# The results a recipe's README claims, rerun (under runs/reproduce/) and checked against
# recipes/<RECIPE>/results.yaml: bit for bit on the hardware they were recorded on, else
# the mean by Welch's t-test; exit 1 when they disagree:  make reproduce RECIPE=digits
reproduce: $(STAMP)
	@$(PY) -m launch reproduce

# Watching runs, local or under SLURM: one line per run (state, SLURM job, nodes, step, last
# evaluation, last log line; RUNS= run dirs or patterns, default runs/<RECIPE or any>/*), the
# last lines of a run's log (FOLLOW=1: until it ends), and a stop with a checkpoint:
#   make status [RECIPE=digits] [RUNS="runs/digits/lr-*"]
#   make logs RUN=runs/digits/NAME [FOLLOW=1]
#   make cancel RUN=runs/digits/NAME
status: $(STAMP)
	@$(PY) -m launch status

logs: $(STAMP)
	@$(PY) -m launch logs

cancel: $(STAMP)
	@$(PY) -m launch cancel

# A chart and a Markdown summary of run directories, beside them: make report RUNS="runs/digits/a runs/digits/b"
report: $(STAMP)
	@$(PY) -m launch report

# Runs published to TensorBoard or MLflow: every scalar at its step, the config, summary.json
# and the reports as hparams/params and artifacts; publishing again adds nothing:
#   make publish RUNS="runs/digits/a runs/digits/b" TO=tensorboard   (runs/digits/tensorboard/)
#   make publish RUNS=runs/digits/a TO=mlflow:sqlite:///mlflow.db      (TO=mlflow: runs/digits/mlflow.db)
publish: $(STAMP)
	@$(PY) -m launch publish

# A checkpoint's weights as a plain state dict for a single-process model:
# make export CKPT=<step-N.pt, sharded step-N/ or run dir> OUT=<file.pt|file.safetensors>
# (EMA=1: the average of the weights; BEST=1: a run dir's best checkpoint, not its newest;
# AVERAGE=1: the mean of a run dir's best checkpoints, or of several CKPT="a.pt b.pt";
# FORCE=1: replace OUT). CKPT and OUT are read from the environment, never pasted into the
# shell line (with AVERAGE=1, CKPT is split at spaces, with no other expansion).
export: $(STAMP)
	@set -f; $(PY) -m engine.export $(if $(EMA),--ema) $(if $(BEST),--best) \
		$(if $(AVERAGE),--average) $(if $(FORCE),--force) -- $(if $(AVERAGE),$$CKPT,"$$CKPT") "$$OUT"

docker-train: $(STAMP)
	@$(PY) -m launch docker-train

image: $(STAMP)
	@$(PY) -m launch image

sif: $(STAMP)
	@$(PY) -m launch sif

test: $(STAMP)
	$(PY) -m pytest $(XDIST) -m "not container" --durations=25

test-fast: $(STAMP)
	$(PY) -m pytest $(XDIST) -m "not slow and not slurm and not container"

# The container checks, apart from make test (they build the image: minutes): make image from a
# local base, make docker-train as a non-root caller, torchrun, resume and make eval, bitwise
# against the venv, and the image's history free of secrets. They need a docker engine with
# BuildKit and CONTAINER_BASE_IMAGE (docker/debootstrap-base.sh makes one); .ci/run runs them.
test-container: $(STAMP)
	$(PY) -m pytest -m container -s tests/container

# Planted bugs, one at a time, each against the tests that hold its guarantee, in a copy of
# the checkout (tests/mutants.py; minutes, see tests/README.md): make mutants [PLANTS="resume"]
mutants: $(STAMP)
	$(PY) tests/mutants.py $(PLANTS)

bench: $(STAMP)
	$(PY) -m bench

# What bench/gpu.sh installs on a GPU machine without network (it reads .gpu-wheels/, or
# GPU_BENCH_WHEELS): the torchcodec wheel for CPython 3.12 on x86_64 Linux (the engine decodes
# images through it; TORCHCODEC_INDEX=<url>: from that index instead of PyPI, e.g. a CUDA
# build) and airbench's sdist (pure Python, for cifar10_fast.airbench94). Needs network.
.PHONY: gpu-wheels
gpu-wheels:
	mkdir -p .gpu-wheels
	$(PYTHON) -m pip download --quiet --disable-pip-version-check --dest .gpu-wheels --no-deps \
		--only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
		$(if $(TORCHCODEC_INDEX),--index-url $(TORCHCODEC_INDEX)) torchcodec==0.17.0
	$(PYTHON) -m pip download --quiet --disable-pip-version-check --dest .gpu-wheels --no-deps \
		--no-binary=:all: airbench==0.1.8

# ruff (style, function size, what recipes must not import), hadolint, the workflows' schema,
# and the import contracts in pyproject.toml ([tool.importlinter]).
lint: $(STAMP)
	$(PY) -m ruff check $(or $(LINT_PY),.)
	$(PY) -m ruff format --check $(or $(LINT_PY),.)
	$(VENV)/bin/hadolint --no-color $(or $(LINT_DOCKERFILES),Dockerfile)
	$(VENV)/bin/check-jsonschema --builtin-schema vendor.github-workflows $(or $(LINT_WORKFLOWS),$(wildcard .github/workflows/*.yml .github/workflows/*.yaml))
	cd $(or $(LINT_IMPORTS_ROOT),.) && PYTHONPATH=. $(CURDIR)/$(VENV)/bin/lint-imports --no-cache

# Resolve the Dockerfile's BASE_IMAGE digest and record it as its `ARG BASE_DIGEST` default
# (needs docker and registry access; elsewhere it fails with a one-line message).
.PHONY: image-digest
image-digest:
	@bash docker/resolve-base-digest.sh Dockerfile

# Resolve pyproject's dependencies and extras afresh and write exact versions to the lock.
lock:
	rm -rf .lock-venv && $(PYTHON) -m venv .lock-venv
	.lock-venv/bin/pip install --quiet torch==2.14.1 torchvision==0.29.1 torchcodec==0.17.0 ".[dev,timm,publish,serving]"
	{ head -n 2 requirements.lock; .lock-venv/bin/pip freeze --exclude recipes; } > requirements.lock.new
	mv requirements.lock.new requirements.lock && rm -rf .lock-venv

clean:
	rm -rf $(VENV) runs wandb
