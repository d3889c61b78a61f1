"""Planted bugs, one at a time: does the test that holds each guarantee catch its breach?

    make mutants                      every plant (minutes: docs in tests/README.md)
    make mutants PLANTS="resume rng"  the plants whose names hold these words

Each plant is a small, realistic change that leaves the program running (a skipped restore, a
dropped term, a swapped order) and the tests named for its guarantee. The checkout's code is
copied to a temporary git repository (launch.snapshot's list of files, uncommitted changes
included, in one commit) and each plant is applied there alone, never in the checkout; its tests run there with the
venv's pytest. A plant is caught when those tests fail, missed when they pass, and stale when
its text is no longer found exactly once (the code moved: update the plant). The plants'
tests are run once without any plant first: they must pass. Exit 0 when every plant is
caught.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


@dataclass(frozen=True)
class Plant:
    name: str  # the guarantee it breaks
    file: str
    old: str  # found exactly once in file
    new: str
    tests: tuple[str, ...]  # pytest node ids that hold the guarantee


PLANTS = (
    Plant(
        "code identity: untracked code counts",
        "engine/codeid.py",
        "    extra = untracked(repo)\n",
        "    extra = []\n",
        ("tests/engine/test_codeid.py",),
    ),
    Plant(
        "hardware: BLAS is a fact that changes bits",
        "engine/hardware_keys.py",
        '    "blas",\n',
        "",
        ("tests/engine/test_hardware.py",),
    ),
    Plant(
        "profiling draws no random number",
        "engine/profile.py",
        "        self.profiler.start()\n",
        "        self.profiler.start()\n        torch.rand(1)\n",
        (
            "tests/engine/test_profile.py::test_a_profiled_run_trains_exactly_like_an_unprofiled_one_with_dropout",
        ),
    ),
    Plant(
        "async checkpoint: a failed write is never published",
        "engine/checkpoint/sharded.py",
        "        except Exception:  # the error that ends the run is already on its way\n            return\n",
        "        except Exception:  # the error that ends the run is already on its way\n            pass\n",
        (
            "tests/engine/checkpoint/test_sharded_publish.py::test_a_background_write_that_failed_is_not_published_on_close",
        ),
    ),
    Plant(
        "HSDP mesh: (replicate, shard), never transposed",
        "engine/parallel/__init__.py",
        "(replicate, world_size // replicate)",
        "(world_size // replicate, replicate)",
        ("tests/engine/parallel/test_mesh.py",),
    ),
    Plant(
        "request precedence: ARGS over the SLURM variables",
        "launch/request.py",
        "    overrides = (*keys, *user)\n",
        "    overrides = (*user, *keys)\n",
        (
            "tests/launch/test_one_resolution.py::test_each_slurm_key_takes_the_highest_layer_that_sets_it",
        ),
    ),
    Plant(
        "bitwise resume: the sampler's position is restored",
        "engine/parts/progress.py",
        "        super().load_state_dict(state)\n",
        "        super().load_state_dict(state)\n        self.position = 0\n",
        ("tests/recipes/test_digits.py::test_stop_mid_epoch_and_resume_is_bitwise_identical",),
    ),
    Plant(
        "bitwise resume: every rank's RNG state is restored",
        "engine/parts/progress.py",
        '            set_rng_state(state["rng"][self.rank])\n',
        "            pass\n",
        (
            "tests/engine/test_rng_state.py",
            "tests/faults/test_faults.py::test_a_tampered_newest_checkpoint_is_skipped_and_the_run_resumes_bitwise",
        ),
    ),
    Plant(
        "config drift on resume is refused",
        "engine/checkpoint/state.py",
        "    if refused:\n        raise C.ConfigError(",
        "    if False:\n        raise C.ConfigError(",
        (
            "tests/faults/test_faults.py::test_a_checkpoint_resumed_into_another_run_under_a_changed_config_is_refused",
        ),
    ),
    Plant(
        "one run name, one request: a finished run is never done for another request",
        "engine/lifecycle.py",
        "    check_same_request(run_dir, cfg.run.name, current, also_safe, trained)\n",
        "    pass\n",
        (
            "tests/engine/test_run_directory.py::test_a_finished_run_is_never_done_for_another_request",
        ),
    ),
    Plant(
        "one run name, one request: a sweep's members keep their request",
        "launch/sweep_members.py",
        "    pairs = [(p, saved) for p in plan.members if (saved := saved_request(p))]\n",
        "    pairs = []\n",
        (
            "tests/slurm/test_one_request_slurm.py::test_a_sweep_grown_after_its_config_file_changed_is_refused_with_the_difference",
        ),
    ),
    Plant(
        "a resume over other code is refused",
        "engine/checkpoint/state.py",
        "cfg.run.allow_code_change or codeid.same_code(saved, code)",
        "cfg.run.allow_code_change or True",
        ("tests/engine/test_code_identity.py",),
    ),
    Plant(
        "world-size invariance: 1 process x 2 accumulation steps = 2 processes",
        "engine/data/sampler.py",
        "            mine = first + self.rank * plan.per_rank\n",
        "            mine = first\n",
        (
            "tests/distributed/test_distributed.py::test_one_process_with_accumulation_equals_two_processes",
        ),
    ),
    Plant(
        "no duplicate steps: a resumed run drops the records after its checkpoint",
        "engine/tracking.py",
        "self._truncate_after(self.metrics_path, resume_step)",
        "self._truncate_after(self.metrics_path, 10**9)",
        ("tests/faults/test_faults.py::test_a_torn_metrics_line_is_dropped_on_resume",),
    ),
    Plant(
        "a submission's config is frozen: the job reads the frozen file",
        "launch/render.py",
        "    if req.frozen:  # resolved once",
        "    if False:  # resolved once",
        (
            "tests/launch/test_variants.py::test_v2_submit_on_2_nodes_renders_the_job_with_the_variant_and_its_slurm_section",
        ),
    ),
    Plant(
        "a sweep member is addressed as <array>_<task>",
        "engine/rundir.py",
        '        return f"{array}_{task}"\n',
        "        pass\n",
        ("tests/engine/test_run_directory.py",),
    ),
    Plant(
        "GPUs asked for pin device=cuda",
        "launch/request.py",
        "    gpus_asked = slurm_job or picked is not None\n",
        "    gpus_asked = False\n",
        (
            "tests/launch/test_request_checks.py::test_a_config_saved_where_gpus_were_asked_records_them_and_reruns_as_that_request",
        ),
    ),
    Plant(
        "checkpoints load with weights_only=True",
        "engine/checkpoint/__init__.py",
        '        return torch.load(path, map_location="cpu", weights_only=True)\n    except FileNotFoundError:',
        '        return torch.load(path, map_location="cpu", weights_only=False)\n    except FileNotFoundError:',
        ("tests/project/test_security.py",),
    ),
    Plant(
        "exact evaluation: each sample once, whatever the world size",
        "engine/data/sampler.py",
        "    lo = n * rank // world_size\n",
        "    lo = max(n * rank // world_size - 1, 0)\n",
        ("tests/engine/test_eval_batches.py",),
    ),
    Plant(
        "tensor parallel: the MLP's output projection split by rows",
        "recipes/gpt/parallel.py",
        '        "mlp.proj": RowwiseParallel(output_layouts=sequence),\n',
        '        "mlp.proj": ColwiseParallel(),\n',
        (
            "tests/engine/parallel/test_tensor_parallel.py::test_tensor_parallel_trains_like_one_process_on_the_same_samples",
        ),
    ),
    Plant(
        "tensor parallel: a TP group is consecutive ranks reading one batch",
        "engine/parallel/__init__.py",
        '    mesh = fsdp.device_mesh(device, (denv.dp_size, strategy.tp), ("shard", "tp"))\n',
        '    mesh = fsdp.device_mesh(device, (strategy.tp, denv.dp_size), ("tp", "shard"))\n',
        (
            "tests/engine/parallel/test_tensor_parallel.py::test_tensor_parallel_trains_like_one_process_on_the_same_samples",
        ),
    ),
)


def copy_checkout(dest: Path) -> None:
    """The checkout's code as launch.snapshot lists it, committed in a git repository of its
    own (runs record their commit), and its venv, in dest."""
    from tests.helpers import git_checkout

    git_checkout(dest)
    (dest / ".venv").symlink_to(REPO / ".venv")


def pytest(copy: Path, tests: list[str] | tuple[str, ...]) -> int:
    """pytest's exit code for these tests in the copy (CI unset: a skip is not a failure)."""
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
        cwd=copy, env={**os.environ, "CI": ""}, capture_output=True, text=True, timeout=1800,
    ).returncode  # fmt: skip


def judge(plant: Plant, copy: Path) -> tuple[str, float]:
    """(caught | missed | stale | error, seconds) of one plant, applied and taken back."""
    path = copy / plant.file
    original = path.read_text()
    if original.count(plant.old) != 1 or plant.old == plant.new:
        return "stale", 0.0
    path.write_text(original.replace(plant.old, plant.new))
    started = time.monotonic()
    try:
        code = pytest(copy, plant.tests)
    finally:
        path.write_text(original)
    return {0: "missed", 1: "caught"}.get(code, "error"), time.monotonic() - started


def main(words: list[str]) -> int:
    chosen = [p for p in PLANTS if all(w.lower() in p.name.lower() for w in words)]
    if not chosen:
        print(f"no plant's name holds {' '.join(words)!r}", file=sys.stderr)
        return 2
    results = []
    with tempfile.TemporaryDirectory(prefix="mutants-") as tmp:
        copy = Path(tmp) / "checkout"
        copy_checkout(copy)
        # Without any plant every test named here passes: a failure below is the plant's.
        if pytest(copy, sorted({t for p in chosen for t in p.tests})) != 0:
            print("the plants' tests fail without any plant: fix them first", file=sys.stderr)
            return 2
        for plant in chosen:
            verdict, seconds = judge(plant, copy)
            results.append(verdict)
            print(f"{verdict:<7} {seconds:6.0f} s  {plant.name}  ({plant.file})", flush=True)
    counts = {v: results.count(v) for v in ("caught", "missed", "stale", "error") if v in results}
    print(", ".join(f"{n} {v}" for v, n in counts.items()))
    return 0 if counts.get("caught") == len(results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
