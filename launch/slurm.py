"""SLURM submission through submitit: one srun task per GPU (or CPU process), each task one
rank that runs the engine in-process and reads its rank from the SLURM variables.

Preemption, as submitit 1.5 and the engine share it:

* submitit's job entry point (`submitit.core.submission.process_job`) installs its own SIGUSR2
  handler, then calls the submitted callable. That handler would checkpoint by pickling the
  callable and requeue at once, mid-step.
* `EngineJob.__call__` runs `engine.cli.main`, which installs the engine's SIGUSR2 handler
  (it replaces submitit's: one handler per signal). That handler only sets a flag; every rank
  saves a checkpoint at the next step boundary and `main` returns 75.
* On 75 after a SIGUSR2, rank 0 requeues the job with `scontrol requeue <job id>` (what submitit's own
  `SlurmJobEnvironment._requeue` runs) and every rank leaves with SystemExit(75), so submitit
  writes no result file and the submitter keeps waiting. The requeued job loads the same
  pickle, i.e. the same recipe and overrides, run.name included: the engine resumes from
  the checkpoint (`resume: auto`).
* A signal that arrives before the engine has installed its handler still meets submitit's:
  rank 0 calls `EngineJob.checkpoint()`, inherited from Checkpointable, which returns
  `DelayedSubmission(self)`: the same call, holding no training state, and submitit requeues
  it. Nothing had been trained yet, so nothing is lost.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import submitit

from engine import preempt
from launch import render
from launch.errors import UserError
from launch.render import PREEMPTED, Request


class EngineJob(submitit.helpers.Checkpointable):
    """The submitted callable: `engine.cli.main([recipe, *args])` in this process."""

    def __init__(self, recipe: str, args: list[str], src: str, max_requeues: int):
        self.recipe = recipe
        self.args = list(args)
        self.src = src
        self.max_requeues = max_requeues

    def __call__(self) -> int:
        os.chdir(self.src)
        if self.src not in sys.path:
            sys.path.insert(0, self.src)
        from engine.cli import main  # start-up time: the engine pulls torch; only the job needs it

        return self.finish(main([self.recipe, *self.args]))

    @staticmethod
    def _warned_of_the_time_limit() -> bool:
        """SIGUSR2 (--signal=USR2@lead) means: requeue me. A SIGTERM alone comes from scancel,
        which ends the job, or from SLURM's own preemption, which requeues it by itself."""
        return "SIGUSR2" in preempt.received()

    def finish(self, rc: int) -> int:
        if rc == 0:
            return 0
        if rc != PREEMPTED:
            raise RuntimeError(f"engine.train exited with code {rc}; its log says why")
        env = submitit.JobEnvironment()
        if env.global_rank == 0 and self._warned_of_the_time_limit():
            restarts = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
            if restarts >= self.max_requeues:
                raise RuntimeError(
                    f"stopped on a preemption signal with a checkpoint saved, but job "
                    f"{env.job_id} was already requeued {restarts} times; not requeueing"
                )
            subprocess.run(["scontrol", "requeue", env.job_id], check=True, timeout=60)
            print(f"requeued job {env.job_id} to resume from its checkpoint", file=sys.stderr)
        raise SystemExit(PREEMPTED)  # no result file: the job is not over


def setup_lines(req: Request) -> list[str]:
    lines = list(req.slurm.setup)
    if req.slurm.cpus_per_task:  # srun does not inherit --cpus-per-task (Slurm >= 22.05)
        lines.append('export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"')
    return lines


def executor_parameters(req: Request) -> dict[str, Any]:
    """AutoExecutor.update_parameters keywords for a request (None: not set)."""
    s = req.slurm
    params: dict[str, Any] = {
        "name": req.run_name,
        "nodes": req.nodes,
        "tasks_per_node": req.procs_per_node,
        "gpus_per_node": req.gpus or None,
        "cpus_per_task": s.cpus_per_task,
        "mem_gb": s.mem_gb,
        "timeout_min": s.time_min,
        "slurm_partition": s.partition,
        "slurm_account": s.account,
        "slurm_qos": s.qos,
        "slurm_constraint": s.constraint,
        "slurm_exclude": s.exclude,
        "slurm_signal_delay_s": s.signal_delay_s,
        "slurm_setup": setup_lines(req) or None,
        "slurm_additional_parameters": {"requeue": True, "chdir": req.src},
    }
    return {k: v for k, v in params.items() if v is not None}


def engine_job(req: Request) -> EngineJob:
    # engine_args()[0] is the recipe; run.name is in the args, so a requeue keeps the run.
    return EngineJob(req.recipe, render.engine_args(req)[1:], req.src, req.slurm.max_requeues)


def executor(req: Request, folder: Path, **extra: Any) -> submitit.AutoExecutor:
    ex = submitit.AutoExecutor(folder=folder, cluster="slurm")
    ex.update_parameters(**{**executor_parameters(req), **extra})
    return ex


def require_sbatch() -> None:
    if shutil.which("sbatch") is None:
        raise UserError(
            "sbatch is not on PATH, so nothing can be submitted from here; "
            "`python -m launch submit --dry-run` prints the batch script to submit elsewhere"
        )


def describe(job: Any, req: Request) -> str:
    size = f"{req.nodes} node(s) x {req.procs_per_node} task(s)"
    size += f", {req.gpus} GPU(s) per node" if req.gpus else ", CPU"
    return "\n".join(
        [
            f"submitted job {job.job_id}: {req.recipe}, {size}",
            f"  run dir: {Path(req.src) / req.run_dir}",
            f"  stdout:  {job.paths.stdout}",
            f"  stderr:  {job.paths.stderr}",
        ]
    )


def submit(req: Request) -> int:
    require_sbatch()
    folder = Path(req.src) / render.slurm_log_dir(req)
    job = executor(req, folder).submit(engine_job(req))
    print(describe(job, req))
    return 0


def submit_array(reqs: list[Request], folder: Path, name: str) -> list[Any]:
    """One job array, one array task per request (all with the same resources)."""
    require_sbatch()
    ex = executor(reqs[0], folder, name=name)
    return ex.submit_array([engine_job(r) for r in reqs])
