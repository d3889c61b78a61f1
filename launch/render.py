"""Pure rendering: a LaunchRequest in, an argv list (or an sbatch script) out.

Nothing here reads the environment, touches the filesystem or starts a process; the CLI
resolves every default first. Each function returns the exact argv that runs, and
`shell_join` is the exact text printed for it (every element quoted with shlex.quote), so an
override such as '"; rm -rf x"' stays one inert argument in every target.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from dataclasses import dataclass, field, replace

from engine.rundir import decide_run_dir

WORKDIR = "/workspace"  # the image's WORKDIR: the checkout is mounted here
DATA_MOUNT = "/data"  # the data root inside a container (RECIPES_DATA points here)
PREEMPTED = 75  # engine exit code: stopped on SIGUSR2 with a checkpoint saved
# Passed into containers by name only (`-e NAME`): docker copies the value from the caller's
# environment, so no secret ever appears in a printed command or a process listing.
PASSTHROUGH_ENV = (
    "WANDB_API_KEY",
    "WANDB_MODE",
    "WANDB_PROJECT",
    "WANDB_ENTITY",
    "WANDB_DIR",
    "WANDB_RUN_GROUP",
)
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # a name alone: `-e NAME=value` shows the value
# NVIDIA's settings for PyTorch in a container, given where NCCL may run (GPUs or several
# nodes): NCCL pins its buffers, which docker's default locked-memory limit (64 KiB) refuses,
# and a 64 MiB stack. A one-node CPU run goes without: rootless docker cannot raise the limit.
ULIMITS = ("memlock=-1", "stack=67108864")
INFINIBAND = "/dev/infiniband"  # the host's RDMA devices, for NCCL across nodes
# torchrun's switch from one store shared by every rendezvous round to one per round.
FRESH_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
# NCCL's flight recorder: the last collectives of each rank, dumped into the run directory's
# hang/ (beside the engine's stack dumps) when a collective times out. gloo ignores them.
FLIGHT_RECORDER = {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}


@dataclass(frozen=True)
class Slurm:
    """Scheduler options shared by the sbatch script, pyxis srun and submitit."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time_min: int = 60
    cpus_per_task: int | None = None
    mem_gb: int | None = None
    constraint: str | None = None
    exclude: str | None = None
    setup: tuple[str, ...] = ()  # shell lines run before srun (module load, venv, ...)
    signal_delay_s: int = 120  # SIGUSR2 this many seconds before the time limit
    max_requeues: int = 20  # stop requeueing a job that was requeued this often


@dataclass(frozen=True)
class Docker:
    """How docker is called: the client, the network of builds and runs, and what a build
    takes from the site (a base image, and pip's CA bundle and index as BuildKit secrets)."""

    client: str = "docker"  # DOCKER: e.g. a client with BuildKit where the default has none
    network: str = ""  # DOCKER_NETWORK: --network of builds and runs; "": docker's default
    base_image: str = ""  # BASE_IMAGE: replaces the Dockerfile's CUDA base; "": its default
    ca_bundle: str = ""  # CA_BUNDLE: a file, mounted as the secret ca_bundle
    # Names of the pip variables set in the caller's environment (PIP_INDEX_URL, ...), each
    # mounted as a secret from that variable: the value never appears on the line.
    pip_settings: tuple[str, ...] = ()


@dataclass(frozen=True)
class LaunchRequest:
    """One launch, fully resolved: every field is a value, never 'auto' (the engine's side,
    one process's command line, is engine.cli.EngineRequest)."""

    recipe: str
    run_name: str
    variant: str = ""  # the recipe's named config (CONFIG=v2): recipes/<recipe>/<variant>.yaml
    # cpu or cuda: the device the request asks for (GPUS=0: cpu); "": the machine decides
    # (device=auto), so a saved config never pins the launching host's device.
    device: str = ""
    gpus: int = 0  # per node; 0 = CPU
    nodes: int = 1  # the fewest nodes of an elastic range
    max_nodes: int = 0  # > nodes: an elastic range, NODES=nodes:max_nodes
    procs: int = 1  # processes per node when gpus == 0
    overrides: tuple[str, ...] = ()  # dotted key=value, passed through verbatim
    python: str = "python"  # host interpreter (the CLI passes sys.executable)
    image: str = "recipes:dev"
    sif: str = "recipes.sif"
    rdzv_endpoint: str | None = None  # HOST:PORT of the first node when nodes > 1
    max_restarts: int = 0  # torchrun restarts all workers this often after one fails
    src: str = "."  # host checkout, mounted at /workspace in containers
    # A SLURM job's snapshot of the code (launch.snapshot), relative to src; "": the checkout
    code: str = ""
    # The request's resolved config (launch.snapshot.freeze), relative to src: a submission's
    # job and a launch's processes read it alone, not the recipe, variant, CONFIG file and
    # overrides; "": the one process started resolves it
    frozen: str = ""
    data: str = "data"  # host data root (RECIPES_DATA), mounted at /data
    run_root: str = "runs"  # run.root of the engine config
    uid_gid: str | None = None  # docker -u; None: the image's user
    # More variables docker passes through by name (e.g. the caller's NCCL_* settings), beside
    # PASSTHROUGH_ENV; names only, never values.
    passthrough_env: tuple[str, ...] = ()
    infiniband: bool = False  # the host has /dev/infiniband: docker maps it into the container
    docker: Docker = field(default_factory=Docker)
    slurm: Slurm = field(default_factory=Slurm)
    engine_flags: tuple[str, ...] = ()  # e.g. --eval PATH: what the engine does instead of training
    warnings: tuple[str, ...] = ()  # said once the request passed its checks, never before

    @property
    def procs_per_node(self) -> int:
        return self.gpus if self.gpus > 0 else self.procs

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    @property
    def elastic(self) -> bool:
        return self.max_nodes > self.nodes

    @property
    def most_nodes(self) -> int:
        return max(self.nodes, self.max_nodes)

    @property
    def world_sizes(self) -> list[int]:
        """Every world size the run may take: one, or one per node count of its range."""
        return [n * self.procs_per_node for n in range(self.nodes, self.most_nodes + 1)]

    @property
    def run_dir(self) -> str:
        return str(decide_run_dir(self.run_root, self.recipe, self.run_name))


def shell_join(argv: list[str]) -> str:
    """The printed form of an argv: shlex.split(shell_join(argv)) == argv."""
    return shlex.join(argv)


def override_keys(overrides: tuple[str, ...]) -> set[str]:
    return {o.partition("=")[0] for o in overrides}


def engine_args(req: LaunchRequest) -> list[str]:
    """Arguments of `engine.train`: the recipe and its variant, what launch adds, then the
    user's overrides; for a frozen request (a submission, several processes), its resolved
    config alone."""
    if req.frozen:  # resolved once, at launch: every process reads the file alone
        return [req.recipe, "--resolved", req.frozen, *req.engine_flags]
    keys = override_keys(req.overrides)
    added = ["--config", req.variant] if req.variant else []
    if req.device and "device" not in keys:
        added.append(f"device={req.device}")
    if "run.name" not in keys and req.run_name:  # "": make config, which names no run
        added.append(f"run.name={req.run_name}")
    return [req.recipe, *added, *req.engine_flags, *req.overrides]


def resolved_from(req: LaunchRequest) -> str:
    """A frozen request's file and the command line it was resolved from, for a dry run."""
    asked = engine_args(replace(req, frozen=""))
    return f"--resolved {req.frozen}: resolved from {shell_join(asked)}"


def flight_recorder_env(req: LaunchRequest) -> dict[str, str]:
    """The flight recorder's settings where NCCL may run (GPUs, several processes), else none."""
    if not req.gpus or max(req.world_sizes) < 2:
        return {}
    dump = posixpath.join(req.run_dir, "hang", "nccl_trace_rank_")  # + the rank, by torch
    return {**FLIGHT_RECORDER, "TORCH_FR_DUMP_TEMP_FILE": dump}


def flight_recorder_items(req: LaunchRequest) -> list[str]:
    return [f"{k}={v}" for k, v in flight_recorder_env(req).items()]


def _env(items: list[str]) -> list[str]:
    return ["env", *items] if items else []


def is_one_process(req: LaunchRequest) -> bool:
    """One engine process and nothing around it: no torchrun, no restarts."""
    return req.most_nodes == 1 and req.procs_per_node == 1 and not req.max_restarts


def engine_command(req: LaunchRequest, python: str) -> list[str]:
    """The command one node runs: plain python, torchrun standalone, or multi-node torchrun.

    torchrun is started as `python -m engine.torchrun`: torch.distributed.run's main (what
    the torchrun console script runs), whose failed run ends in one line and the failed
    worker's exit code instead of a traceback; the interpreter that runs is the one named
    here, venv or image. One process with max_restarts runs under torchrun too: torchrun is
    what restarts it."""
    module = ["-m", "engine.train", *engine_args(req)]
    n = req.procs_per_node
    if is_one_process(req):
        return [python, *module]
    torchrun = [python, "-m", "engine.torchrun"]
    restarts = [f"--max-restarts={req.max_restarts}"] if req.max_restarts else []
    recorder = flight_recorder_items(req)
    if req.most_nodes == 1:
        return [
            *_env(recorder),
            *torchrun,
            "--standalone",
            f"--nproc_per_node={n}",
            *restarts,
            *module,
        ]
    if not req.rdzv_endpoint:
        raise ValueError("nodes > 1 needs rdzv_endpoint (HOST:PORT of the first node)")
    # An elastic range: each rendezvous round's workers meet in a store of their own, hosted
    # by that round's rank 0. torchrun's shared store lives in the first round's rank-0 agent:
    # when that node dies, the survivors' next round waits on it until it times out.
    fresh_store = [f"{FRESH_STORE}=1"] if req.elastic else []
    nnodes = f"{req.nodes}:{req.max_nodes}" if req.elastic else str(req.nodes)
    return [
        *_env([*fresh_store, *recorder]),
        *torchrun,
        f"--nnodes={nnodes}",
        f"--nproc_per_node={n}",
        *restarts,
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint={req.rdzv_endpoint}",
        f"--rdzv_id={req.run_name}",  # the same on every node: the run name is shared
        *module,
    ]


def local(req: LaunchRequest) -> list[str]:
    return engine_command(req, req.python)


def _host(req: LaunchRequest, path: str) -> str:
    return path if posixpath.isabs(path) else posixpath.join(req.src, path)


def code_environment(req: LaunchRequest) -> dict[str, str]:
    """What a job's processes need to run its snapshot of the code (launch.snapshot) from
    the checkout as working directory; empty: it runs the checkout's code."""
    if not req.code:
        return {}
    return {
        "PYTHONPATH": _host(req, req.code),
        "PYTHONSAFEPATH": "1",  # the working directory (the checkout) is never on sys.path
        "RECIPES_DATA": _host(req, req.data),  # the default data root stays the checkout's
    }


def job_exports(req: LaunchRequest) -> list[str]:
    """A batch script's export lines: the code snapshot's, then the flight recorder's."""
    recorder = [f"export {k}={shlex.quote(v)}" for k, v in flight_recorder_env(req).items()]
    return [*code_exports(req), *recorder]


def code_exports(req: LaunchRequest) -> list[str]:
    """code_environment() as lines of a batch script, each value quoted."""
    if not req.code:
        return []
    exports = [f"export {k}={shlex.quote(v)}" for k, v in code_environment(req).items()]
    return [f"# the code as submitted: {_one_line('code', req.code)}/ (its CODE.json)", *exports]


def _runs_mount(req: LaunchRequest) -> tuple[str, str] | None:
    """The runs folder's own mount, needed only outside the checkout: an absolute run.root
    (the same path inside) or a relative one that climbs out of it (`../runs`). Any other
    relative run.root lies inside the mounted checkout already."""
    root = req.run_root
    if posixpath.isabs(root):
        return root, root
    inside = posixpath.normpath(root)
    if inside != ".." and not inside.startswith("../"):
        return None
    host = posixpath.normpath(posixpath.join(req.src, inside))
    return host, posixpath.normpath(posixpath.join(WORKDIR, inside))


def _mounts(req: LaunchRequest) -> list[tuple[str, str]]:
    """The checkout at /workspace, the data root at /data, and the runs folder where it is
    not inside the checkout, each once."""
    runs = _runs_mount(req)
    return [(req.src, WORKDIR), (_host(req, req.data), DATA_MOUNT), *([runs] if runs else [])]


def passed_env(req: LaunchRequest) -> list[str]:
    """The names docker passes through (`-e NAME`): PASSTHROUGH_ENV and the request's own,
    sorted, each once. A name with a value in it (`NAME=value`) is refused: it would be shown."""
    for name in req.passthrough_env:
        if not ENV_NAME.fullmatch(name):
            raise ValueError(f"passthrough_env: {name!r} is not a variable name")
    return sorted({*PASSTHROUGH_ENV, *req.passthrough_env})


def docker_run(req: LaunchRequest) -> list[str]:
    """`docker run` of the engine command in the image (python on PATH, WORKDIR /workspace),
    with NVIDIA's settings for PyTorch: the host's IPC namespace; with GPUs or several nodes,
    unlimited locked memory and a 64 MiB stack; /dev/infiniband where the host has it.
    Variables pass by name only."""
    argv = [req.docker.client, "run", "--rm", "--pull=never", "--ipc=host"]
    if req.gpus or req.most_nodes > 1:
        for limit in ULIMITS:
            argv += ["--ulimit", limit]
    if req.gpus:
        argv.append(f"--gpus={req.gpus}")
    if network := run_network(req):
        argv.append(f"--network={network}")
    if req.infiniband:
        argv.append(f"--device={INFINIBAND}")
    if req.uid_gid:
        argv += ["-u", req.uid_gid]  # files in runs/ stay the caller's (the image's HOME is 1777)
    for host, inside in _mounts(req):
        argv += ["-v", f"{host}:{inside}"]
    argv += ["-w", WORKDIR, "-e", f"RECIPES_DATA={DATA_MOUNT}"]
    for name in passed_env(req):
        argv += ["-e", name]
    return [*argv, req.image, *engine_command(req, "python")]


def run_network(req: LaunchRequest) -> str:
    """docker run's network: the host's on several nodes (torchrun's rendezvous must reach
    the other nodes), else DOCKER_NETWORK's, else docker's default."""
    if req.most_nodes > 1:
        if req.docker.network not in ("", "host"):
            raise ValueError(
                f"DOCKER_NETWORK={req.docker.network!r}: a run on several nodes needs the "
                "host's network; leave DOCKER_NETWORK unset or set it to host"
            )
        return "host"
    return req.docker.network


def job_options(req: LaunchRequest) -> dict[str, object]:
    """What the job asks SLURM for, by sbatch's option names with '_' for '-' (submitit's
    parameter names too): pyxis's srun, the batch script and submitit share it."""
    s = req.slurm
    options = {
        "nodes": f"{req.nodes}-{req.max_nodes}" if req.elastic else req.nodes,
        # A node range leaves the tasks per node to each step (step_options): given here,
        # sbatch fixes the job's task count at MIN nodes' worth and SLURM allocates no more.
        "ntasks_per_node": None if req.elastic else req.procs_per_node,
        "gpus_per_node": req.gpus or None,
        "cpus_per_task": s.cpus_per_task,
        "mem": f"{s.mem_gb}G" if s.mem_gb else None,  # per node
        "time": s.time_min,
        "partition": s.partition,
        "account": s.account,
        "qos": s.qos,
        "constraint": s.constraint,
        "exclude": s.exclude,
    }
    return {k: v for k, v in options.items() if v is not None}


def step_options(req: LaunchRequest) -> list[str]:
    """srun's options for the job's step: the tasks per node of a node range, on however
    many nodes the job was given."""
    return [f"--ntasks-per-node={req.procs_per_node}"] if req.elastic else []


def _srun_options(req: LaunchRequest) -> list[str]:
    return [f"--{k.replace('_', '-')}={v}" for k, v in job_options(req).items()]


def pyxis(req: LaunchRequest) -> list[str]:
    """srun with the pyxis plugin: one task per GPU (or per CPU process), one container each;
    the engine takes its rank from the SLURM variables."""
    mounts = ",".join(f"{host}:{inside}" for host, inside in _mounts(req))
    return [
        "srun",
        *_srun_options(req),
        f"--signal=USR2@{req.slurm.signal_delay_s}",
        "--kill-on-bad-exit=1",
        f"--container-image={req.image}",
        f"--container-mounts={mounts}",
        f"--container-workdir={WORKDIR}",
        f"--export={','.join(['ALL', f'RECIPES_DATA={DATA_MOUNT}', *container_env(req)])}",
        "python",
        "-m",
        "engine.train",
        *engine_args(req),
    ]


def container_env(req: LaunchRequest) -> list[str]:
    """srun --export's NAME=value items: the code snapshot's and the flight recorder's."""
    recorder = flight_recorder_items(req)
    if any("," in item for item in recorder):
        raise ValueError(f"the run directory cannot contain a comma: {req.run_dir!r}")
    return [*container_code_env(req), *recorder]


def container_code_env(req: LaunchRequest) -> list[str]:
    """NAME=value items that make a container import the job's snapshot of the code, found
    through the mounts (it lies in the run directory); none without a snapshot."""
    if not req.code:
        return []
    host = posixpath.normpath(_host(req, req.code))
    for outside, inside in reversed(_mounts(req)):  # the runs mount before the checkout's
        rel = posixpath.relpath(host, posixpath.normpath(outside))
        if rel != ".." and not rel.startswith("../"):
            path = posixpath.normpath(posixpath.join(inside, rel))
            if "," in path:
                raise ValueError(f"the code snapshot's path cannot contain a comma: {path!r}")
            return [f"PYTHONPATH={path}", "PYTHONSAFEPATH=1"]
    raise ValueError(f"the code snapshot {host} is outside every mount of the container")


def apptainer(req: LaunchRequest) -> list[str]:
    """`apptainer exec` of the engine command in the SIF (the caller's environment, secrets
    included, passes through by apptainer's default; nothing is written on the line)."""
    binds = ",".join(f"{host}:{inside}" for host, inside in _mounts(req))
    argv = ["apptainer", "exec"]
    if req.gpus:
        argv.append("--nv")
    argv += ["--bind", binds, "--pwd", WORKDIR, "--env", f"RECIPES_DATA={DATA_MOUNT}", req.sif]
    return [*argv, *engine_command(req, "python")]


def image_build(req: LaunchRequest, git_sha: str, lock_sha256: str) -> list[str]:
    """`docker build` under BuildKit (the Dockerfile mounts secrets), with the provenance
    build arguments and, where given, the site's base image, network and pip secrets."""
    d = req.docker
    argv = ["env", "DOCKER_BUILDKIT=1", d.client, "build"]
    if d.network:
        argv += ["--network", d.network]
    build_args = [f"GIT_SHA={git_sha}", f"LOCK_SHA256={lock_sha256}", f"IMAGE_TAG={req.image}"]
    if d.base_image:
        build_args.insert(0, f"BASE_IMAGE={d.base_image}")
    for arg in build_args:
        argv += ["--build-arg", arg]
    for secret in build_secrets(d):
        argv += ["--secret", secret]
    return [*argv, "-t", req.image, "-f", posixpath.join(req.src, "Dockerfile"), req.src]


def build_secrets(d: Docker) -> list[str]:
    """--secret values: the CA bundle from its file, pip's settings from the caller's
    variables by name (docker reads the value; the line shows only the name)."""
    secrets = []
    if d.ca_bundle:
        if "," in d.ca_bundle:  # docker splits a --secret value at commas
            raise ValueError(f"CA_BUNDLE cannot contain a comma: {d.ca_bundle!r}")
        secrets.append(f"id=ca_bundle,src={d.ca_bundle}")
    for name in d.pip_settings:
        if not ENV_NAME.fullmatch(name):
            raise ValueError(f"pip setting {name!r} is not a variable name")
        secrets.append(f"id={name.lower()},env={name}")
    return secrets


def sif_build(req: LaunchRequest) -> list[str]:
    return ["apptainer", "build", "--force", req.sif, f"docker-daemon://{req.image}"]


SETUP_FAILED = "error: setup line "  # how a failed slurm.setup line starts in the job's log


def guarded(setup: tuple[str, ...], nodes: int = 1) -> list[str]:
    """slurm.setup's lines as a batch script runs them: each in the script's own shell (a
    `module load` or `source` must stay in effect: srun hands that environment to every
    rank), and the first that fails ends the job, its number, node and exit status in the
    job's log as an `error:` line (make status shows it) instead of a job that goes on
    without its modules and "finishes". A job of several nodes runs them once more on each
    node, in a step of their own before any rank starts: a line that fails on one node (a
    module or a local disk missing there) ends the job there too, not a rank later."""
    lines = [_guard(i, line) for i, line in enumerate(setup, 1)]
    if setup and nodes > 1:
        script = "\n".join(lines)
        step = [
            "srun",
            "--nodes=$SLURM_JOB_NUM_NODES",
            "--ntasks-per-node=1",
            "--kill-on-bad-exit=1",
        ]
        lines.append(f"{' '.join(step)} bash -c {shlex.quote(script)} || exit 1")
    return lines


def _guard(number: int, line: str) -> str:
    said = shlex.quote(f"{SETUP_FAILED}{number} failed on ")
    node = '"${SLURMD_NODENAME:-$(hostname)} (exit $rc): "'
    return f"{{ {line}\n}} || {{ rc=$?; echo {said}{node}{shlex.quote(line)} >&2; exit 1; }}"


def slurm_log_dir(req: LaunchRequest) -> str:
    return posixpath.join(req.run_dir, "slurm")


def _one_line(what: str, text: str) -> str:
    """A value written into a comment or #SBATCH line: a line break would end the comment."""
    if "\n" in text or "\r" in text:
        raise ValueError(f"{what} cannot contain a line break: {text!r}")
    return text


def _directive(key: str, value: object) -> str:
    if value is True:
        return f"#SBATCH --{key}"
    return f"#SBATCH --{key}={shlex.quote(_one_line(f'--{key}', str(value)))}"


def sbatch_script(req: LaunchRequest) -> str:
    """A batch script for people who submit by hand (`sbatch FILE`): one srun task per GPU
    (or per CPU process), ranks from SLURM variables, requeued when the engine exits 75."""
    s = req.slurm
    logs = slurm_log_dir(req)
    directives = {
        "job-name": f"{req.recipe}-{req.run_name}",
        **{k.replace("_", "-"): v for k, v in job_options(req).items()},
        "signal": f"USR2@{s.signal_delay_s}",  # to every task of each step, not the script
        "requeue": True,
        "open-mode": "append",  # a requeued job appends to the same logs
        "chdir": req.src,
        "output": f"{logs}/%j.out",
        "error": f"{logs}/%j.err",
    }
    srun = ["srun", "--unbuffered", "--kill-on-bad-exit=1", *step_options(req)]
    srun += [req.python, "-m", "engine.train"]
    lines = [
        "#!/bin/bash",
        f"# Submit: mkdir -p {shlex.quote(_one_line('log dir', _host(req, logs)))} && sbatch FILE",
        *(_directive(k, v) for k, v in directives.items() if v is not None),
        "",
        *guarded(s.setup, req.most_nodes),
        *job_exports(req),
    ]
    if s.cpus_per_task:  # srun does not inherit --cpus-per-task from sbatch (Slurm >= 22.05)
        lines.append('export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"')
    lines += [
        shell_join([*srun, *engine_args(req)]),
        "rc=$?",
        f'if [ "$rc" -eq {PREEMPTED} ]; then',
        f'  if [ "${{SLURM_RESTART_COUNT:-0}}" -lt {s.max_requeues} ]; then',
        '    echo "stopped on a preemption signal, checkpoint saved: requeueing job'
        ' $SLURM_JOB_ID" >&2',
        # scontrol must not die of the preemption's own signals halfway through the request
        "    trap '' TERM USR2",
        '    scontrol requeue "$SLURM_JOB_ID"',
        "  else",
        f'    echo "not requeueing: job $SLURM_JOB_ID was requeued {s.max_requeues} times" >&2',
        "  fi",
        "fi",
        'exit "$rc"',
        "",
    ]
    return "\n".join(lines)


TARGETS = {
    "local": local,
    "docker": docker_run,
    "pyxis": pyxis,
    "apptainer": apptainer,
    "sif": sif_build,
}
