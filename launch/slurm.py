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

import contextlib
import io
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import submitit
from submitit.core import utils as submitit_utils

from engine import preempt
from launch import render, snapshot, watch
from launch.errors import UserError
from launch.render import PREEMPTED, LaunchRequest


class EngineJob(submitit.helpers.Checkpointable):
    """The submitted callable: `engine.cli.main([recipe, *args])` in this process."""

    def __init__(
        self,
        recipe: str,
        args: list[str],
        src: str,
        max_requeues: int,
        environ: dict[str, str] | None = None,
        code: str = "",
    ):
        self.recipe = recipe
        self.args = list(args)
        self.src = src
        self.code = code  # the snapshot it imports from (launch.snapshot); "": src
        self.max_requeues = max_requeues
        self.environ = dict(environ or {})  # set in the task before the engine starts

    def __call__(self) -> int:
        os.environ.update(self.environ)
        os.chdir(self.src)  # relative paths (run.root, data.root) mean the checkout's
        # getattr: a job pickled before jobs named their code, requeued after an update
        if (code := getattr(self, "code", "") or self.src) not in sys.path:
            sys.path.insert(0, code)
        from engine import cli  # start-up time: the engine pulls torch; only the job needs it

        rc = cli.main([self.recipe, *self.args])
        return self.finish(rc, (getattr(cli, "LAST_ERROR", None) or [""])[-1])

    @staticmethod
    def _warned_of_the_time_limit() -> bool:
        """SIGUSR2 (--signal=USR2@lead) means: requeue me. A SIGTERM alone comes from scancel,
        which ends the job, or from SLURM's own preemption, which requeues it by itself."""
        return "SIGUSR2" in preempt.received()

    def finish(self, rc: int, said: str = "") -> int:
        if rc == 0:
            return 0
        if rc != PREEMPTED:
            raise RuntimeError(f"engine.train exited with code {rc}: {said or 'its log says why'}")
        env = submitit.JobEnvironment()
        if env.global_rank == 0 and self._warned_of_the_time_limit():
            restarts = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
            if restarts >= self.max_requeues:
                raise RuntimeError(
                    f"stopped on a preemption signal with a checkpoint saved, but job "
                    f"{env.job_id} was already requeued {restarts} times; not requeueing"
                )
            requeue(env.job_id)
            print(f"requeued job {env.job_id} to resume from its checkpoint", file=sys.stderr)
        raise SystemExit(PREEMPTED)  # no result file: the job is not over


@contextlib.contextmanager
def _stop_signals_ignored():
    """SIGTERM and SIGUSR2 ignored in this process, and so in a child started meanwhile
    (an ignored signal stays ignored across exec); the handlers are back afterwards."""
    signals = (signal.SIGTERM, signal.SIGUSR2)
    saved = [signal.signal(sig, signal.SIG_IGN) for sig in signals]
    try:
        yield
    finally:
        for sig, handler in zip(signals, saved, strict=True):
            signal.signal(sig, handler)


def requeue(job_id: str) -> None:
    """`scontrol requeue JOB`, immune to the signals of the preemption that asked for it.
    SLURM signals every process of a job step, scontrol too: a SIGTERM or a second SIGUSR2
    arriving just after the first (preemption, scancel, the time limit) would kill the
    request halfway, and the job would end FAILED instead of requeued. The engine has already
    saved its checkpoint and is leaving, so nothing is lost by ignoring them here."""
    with _stop_signals_ignored():
        subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=60)


def setup_lines(req: LaunchRequest) -> list[str]:
    lines = [*render.guarded(req.slurm.setup, req.most_nodes), *render.job_exports(req)]
    if req.slurm.cpus_per_task:  # srun does not inherit --cpus-per-task (Slurm >= 22.05)
        lines.append('export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"')
    return lines


def executor_parameters(req: LaunchRequest) -> dict[str, Any]:
    """SlurmExecutor.update_parameters keywords (sbatch's own names) for a request."""
    params: dict[str, Any] = {
        "job_name": req.run_name,
        **render.job_options(req),
        "signal_delay_s": req.slurm.signal_delay_s,
        "setup": setup_lines(req) or None,
        "srun_args": render.step_options(req) or None,
        "additional_parameters": {"requeue": True, "chdir": req.src},
    }
    return {k: v for k, v in params.items() if v is not None}


class Executor(submitit.SlurmExecutor):
    """submitit's SLURM executor, also where srun is absent: a dry run on a machine without
    SLURM still prints the script a submission writes (submit checks for sbatch first)."""

    @classmethod
    def affinity(cls) -> int:
        return 1

    def _num_tasks(self) -> int:
        """The tasks a job surely has, whose results submitit reads: MIN nodes' for a node
        range "MIN-MAX" (submitit 1.5 multiplies the text itself)."""
        fewest = int(str(self.parameters.get("nodes", 1)).partition("-")[0])
        return fewest * max(1, self.parameters.get("ntasks_per_node") or 1)


def engine_job(req: LaunchRequest, environ: dict[str, str] | None = None) -> EngineJob:
    # engine_args()[0] is the recipe; run.name is in the args, so a requeue keeps the run.
    args = render.engine_args(req)[1:]
    code = render.code_environment(req).get("PYTHONPATH", "")
    return EngineJob(req.recipe, args, req.src, req.slurm.max_requeues, environ, code)


def executor(req: LaunchRequest, folder: Path, **extra: Any) -> Executor:
    ex = Executor(folder=folder)
    ex.update_parameters(**{**executor_parameters(req), **extra})
    return ex


def job_folder(req: LaunchRequest) -> Path:
    return Path(req.src) / render.slurm_log_dir(req)


def submission_script(ex: Executor, count: int) -> str:
    """The batch script submitit writes for `count` jobs: one job, or one array of `count`
    tasks. These are the calls submitit 1.5 makes in `_submit_command` and, for an array,
    `_internal_process_submissions` (map_count); tests/slurm compares this text with the file
    a real submission wrote, so a submitit upgrade that changes them fails there."""
    if count > 1:
        ex.parameters["map_count"] = count
    try:
        return ex._make_submission_file_text(ex._submitit_command_str, "dry-run")
    finally:
        ex.parameters.pop("map_count", None)


def array_limit(parallel: int | None) -> dict[str, Any]:
    """submitit's array_parallelism: at most this many array tasks run at once (sbatch's
    --array=0-N%LIMIT); None keeps submitit's default, every task at once up to 256."""
    return {"array_parallelism": parallel} if parallel else {}


def dry_run(reqs: list[LaunchRequest], folder: Path, name: str, parallel: int | None = None) -> str:
    """What `submit` (one request) or a sweep (one array) would submit: submitit's script,
    then, as comments, the command each task runs in-process from its pickled job."""
    ex = executor(reqs[0], folder, job_name=name, **array_limit(parallel))
    lines = ["# Each task unpickles its job and runs:"]
    for i, r in enumerate(reqs):
        task = f"array task {i}" if len(reqs) > 1 else "every task"
        argv = ["python", "-m", "engine.train", *render.engine_args(r)]
        lines.append(f"#   {task}: {render.shell_join(argv)}")
        if r.frozen:  # what the frozen config was resolved from, at submission
            lines.append(f"#     {render.resolved_from(r)}")
    return submission_script(ex, len(reqs)) + "\n".join(lines) + "\n"


def require_sbatch() -> None:
    if shutil.which("sbatch") is None:
        raise UserError(
            "sbatch is not on PATH, so nothing can be submitted from here; "
            "`python -m launch submit --dry-run` prints the batch script to submit elsewhere"
        )


# sbatch's message (lower case) -> what to check
SLURM_HINTS = (
    (
        ("unable to contact slurm controller", "could not establish a configuration source"),
        "is slurmctld running and reachable from here? `sinfo` must answer (check SLURM_CONF)",
    ),
    (("invalid partition",), "check PARTITION; `sinfo -s` lists the partitions"),
    (("invalid account",), "check ACCOUNT; `sacctmgr show assoc user=$USER` lists yours"),
    (("invalid qos",), "check QOS; `sacctmgr show qos` lists them"),
    (
        ("job violates accounting/qos policy", "maxsubmitjob", "submit limit"),
        "your QOS or association caps your jobs (how many queued at once, their size or time): "
        "`squeue -u $USER` shows what counts, `sacctmgr show qos` the caps; wait for jobs to "
        "end or ask for less",
    ),
    (("time limit",), "lower TIME_MIN to the partition's limit; `sinfo -o '%P %l'` shows it"),
    (
        ("node configuration is not available", "more processors", "memory specification"),
        "the request exceeds every node: check GPUS, NODES, CPUS_PER_TASK and MEM_GB "
        "against `sinfo -N -o '%N %c %m %G'`",
    ),
)


def slurm_error(message: str) -> str:
    """sbatch's last error line and what to check, in one line."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower() or "fatal" in line.lower()]
    said = (errors or lines or ["no message"])[-1]
    said = said.removeprefix("sbatch: ").removeprefix("error: ").removeprefix("fatal: ")
    text = message.lower()
    hint = next(
        (h for keys, h in SLURM_HINTS if any(k in text for k in keys)),
        "check the request against `sinfo`",
    )
    return f"SLURM refused the job: {said}; {hint}; nothing was queued"


def partition_nodes(partition: str | None) -> tuple[str, dict[str, tuple[int, int, int]]] | None:
    """(the partition's name, {node: (CPUs, memory MB, GPUs)}) as sinfo lists them (partition
    None: the default one); None where sinfo cannot say (not here, no answer): nothing to
    check."""
    try:
        out = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%N %P %c %m %G"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    name, nodes = partition or "", {}
    for line in out.stdout.splitlines():
        node, part, cpus, mem, gres = (line.split() + ["", "", "", "", ""])[:5]
        wanted = part.rstrip("*") == partition if partition else part.endswith("*")
        if wanted and cpus.isdigit() and mem.isdigit():
            name, nodes[node] = part.rstrip("*"), (int(cpus), int(mem), gpu_count(gres))
    return (name, nodes) if nodes else None


def gpu_count(gres: str) -> int:
    """The GPUs a node's GRES lists (`gpu:8`, `gpu:h100:4(S:0-1),nvme:1`; `(null)`: none)."""
    total = 0
    for entry in gres.split(","):
        fields = entry.split("(")[0].split(":")
        if fields[0] == "gpu" and fields[-1].isdigit():
            total += int(fields[-1])
    return total


LIMITS = "`sinfo -N -o '%N %P %c %m %G'` lists each node's partition, CPUs, memory (MB) and GPUs"


def check_fits(req: LaunchRequest) -> None:
    """A request the partition can never satisfy (more nodes than it has, more CPUs, memory
    or GPUs than its largest node) is refused here, with its limits: SLURM would keep it
    queued for ever, or refuse it with a message that misleads."""
    found = partition_nodes(req.slurm.partition)
    if found is None:
        return
    name, nodes = found
    if req.most_nodes > len(nodes):
        raise UserError(
            f"NODES={req.most_nodes} but partition {name} has {len(nodes)} "
            f"node(s); ask for at most {len(nodes)}, or another PARTITION "
            f"({LIMITS}); nothing was queued"
        )
    check_gpus_fit(req, name, max(g for *_, g in nodes.values()))
    cpus = (req.slurm.cpus_per_task or 1) * req.procs_per_node
    most_cpus = max(c for c, *_ in nodes.values())
    if cpus > most_cpus:
        raise UserError(
            f"{req.procs_per_node} task(s) per node x CPUS_PER_TASK="
            f"{req.slurm.cpus_per_task or 1} need {cpus} CPUs on a node, but the "
            f"largest node of partition {name} has {most_cpus} ({LIMITS}); "
            "nothing was queued"
        )
    most_mb = max(m for _, m, _ in nodes.values())
    if req.slurm.mem_gb and req.slurm.mem_gb * 1024 > most_mb:
        raise UserError(
            f"MEM_GB={req.slurm.mem_gb} but the largest node of partition {name} "
            f"has {most_mb} MB of memory ({LIMITS}); nothing was queued"
        )


def check_gpus_fit(req: LaunchRequest, name: str, most_gpus: int) -> None:
    if not req.gpus or req.gpus <= most_gpus:
        return
    if most_gpus == 0:
        raise UserError(
            f"GPUS={req.gpus} but partition {name} has no GPUs (no node lists a "
            f"gpu GRES: {LIMITS}); ask for a PARTITION with GPUs, or run on CPUs "
            "with GPUS=0 ALLOW_CPU=1; nothing was queued"
        )
    raise UserError(
        f"GPUS={req.gpus} but the largest node of partition {name} has {most_gpus} "
        f"GPU(s); ask for at most {most_gpus} per node and more NODES ({LIMITS}); "
        "nothing was queued"
    )


class Undo:
    """Removes what a failed submission left under the run directory (submitit writes its
    pickles and script before it calls sbatch), and the directory itself if it was new."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.existed = run_dir.exists()
        self.before = set(run_dir.rglob("*")) if self.existed else set()
        # the folders above it that the submission makes (runs/, runs/<recipe>/), innermost first
        self.made_above = [p for p in run_dir.absolute().parents if not p.exists()]

    def __call__(self) -> None:
        if not self.existed:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            for folder in self.made_above:
                with contextlib.suppress(OSError):  # not empty (another run): kept
                    folder.rmdir()
            return
        for path in sorted(set(self.run_dir.rglob("*")) - self.before, reverse=True):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def submitted(submit_call, *run_dirs: Path):
    """submit_call() with SLURM's refusal as one UserError and nothing left behind in the
    folders it writes to."""
    undos = [Undo(run_dir) for run_dir in run_dirs]

    def undo() -> None:
        for each in undos:
            each()

    try:  # submitit prints sbatch's stderr before raising: the message comes once, below
        with contextlib.redirect_stderr(io.StringIO()):
            return submit_call()
    except (submitit_utils.FailedJobError, submitit_utils.FailedSubmissionError) as err:
        undo()
        raise UserError(slurm_error(str(err)), code=1) from None
    except (OSError, subprocess.SubprocessError) as err:
        undo()
        raise UserError(f"sbatch could not run: {err}; nothing was queued", code=1) from None
    except UserError:  # the code could not be snapshot
        undo()
        raise


def describe(job: Any, req: LaunchRequest) -> str:
    size = f"{render.job_options(req)['nodes']} node(s) x {req.procs_per_node} task(s)"
    size += f", {req.gpus} GPU(s) per node" if req.gpus else ", CPU"
    return "\n".join(
        [
            f"submitted job {job.job_id}: {req.recipe}, {size}",
            f"  run dir: {Path(req.src) / req.run_dir}",
            f"  stdout:  {job.paths.stdout}",
            f"  stderr:  {job.paths.stderr}",
            f"  watch:   make status RUNS={req.run_dir}; make logs RUN={req.run_dir} FOLLOW=1",
            f"  stop:    make cancel RUN={req.run_dir}  (a checkpoint, then the job ends)",
        ]
    )


def submit(req: LaunchRequest, config: str) -> int:
    """Queues the request, its code snapshot and its frozen config (`config`, the engine's
    resolved text) written first, under the run directory."""
    require_sbatch()
    check_fits(req)
    folder = job_folder(req)
    ex = executor(req, folder)

    def queue():
        if req.code:  # under the run directory: a refused submission removes it too
            snapshot.take(req)
        snapshot.write_frozen(req, config)
        return ex.submit(engine_job(req))

    job = submitted(queue, Path(req.src) / req.run_dir)
    watch.record_submission(Path(req.src) / req.run_dir, job, req.frozen)
    print(describe(job, req))
    return 0


def submit_array(
    reqs: list[LaunchRequest],
    configs: list[str],
    folder: Path,
    name: str,
    environ: dict[str, str] | None = None,
    parallel: int | None = None,
) -> list[Any]:
    """One job array, one array task per request (all with the same resources), at most
    `parallel` of them running at once; each reads its frozen config (`configs`, in order)."""
    require_sbatch()
    check_fits(reqs[0])  # the members ask for the same resources
    ex = executor(reqs[0], folder, job_name=name, **array_limit(parallel))
    jobs = [engine_job(r, environ) for r in reqs]

    def queue():
        if reqs[0].code:  # one snapshot for the array
            snapshot.take(reqs[0])
        for r, config in zip(reqs, configs, strict=True):
            snapshot.write_frozen(r, config)
        return ex.submit_array(jobs)

    # the sweep's folder and the members' run directories their frozen configs opened
    jobs = submitted(queue, folder.parent, *(Path(r.src) / r.run_dir for r in reqs))
    for r, job in zip(reqs, jobs, strict=True):  # make status and cancel find queued members
        watch.record_submission(Path(r.src) / r.run_dir, job, r.frozen)
    return jobs
