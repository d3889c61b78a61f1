"""The distributed environment, read in one place: torchrun, srun (SLURM), or one process.

Nothing else in the engine reads rank variables from the environment."""

from __future__ import annotations

import datetime
import gc
import itertools
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Imported before any process group exists, on purpose. torch.distributed.nn.functional binds
# `group=group.WORLD` as the default argument of ten functions when it is first imported, and
# DDP's constructor imports it. Imported after init_process_group, it would hold the default
# group for the life of the interpreter: destroy_process_group() could not free it, gloo's
# threads would outlive the run and end during interpreter shutdown, which sometimes aborts a
# finished process (SIGABRT, "terminate called without an active exception"). Imported here,
# it binds None (tests/distributed/test_clean_exit.py).
import torch.distributed.nn  # noqa: F401

from engine.config import ConfigError, DistConfig

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
SLURM_VARS = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_JOB_NODELIST", "SLURM_JOB_ID")


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    source: str = "single"  # single | torchrun | slurm
    # processes per tensor-parallel group (dist.tp; set by the run, not read from the
    # environment): tp consecutive ranks hold one data-parallel rank's batch together
    tp: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        """This process's data-parallel rank: which part of each global batch it reads."""
        return self.rank // self.tp

    @property
    def dp_size(self) -> int:
        """How many parts each global batch is split into (the world without tp's copies)."""
        return self.world_size // self.tp

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand SLURM's compressed host list, in SLURM's order: 'gpu[01-03,7],cpu5' -> gpu01
    gpu02 gpu03 gpu7 cpu5; 'rack[1-2]-n[01-02]' -> rack1-n01 rack1-n02 rack2-n01 rack2-n02.

    Hand-written because the engine runs where submitit is not installed; the tests compare
    it with submitit's parser and with `scontrol show hostnames`."""
    example = "expected e.g. gpu[01-03,7],cpu5"
    if not re.fullmatch(r"(?:[^\[\]]|\[[^\[\]]*\])*", nodelist):  # balanced, never nested
        raise ConfigError(f"node list {nodelist!r} has unbalanced brackets; {example}")

    def numbers(ranges: str) -> list[str]:  # '01-03,7' -> 01 02 03 7; a range keeps lo's width
        out = []
        for part in ranges.split(","):
            match = re.fullmatch(r"([0-9]+)(?:-([0-9]+))?", part)
            if not match or int(match[2] or match[1]) < int(match[1]):
                raise ConfigError(f"node list {nodelist!r}: bad range [{ranges}]; {example}")
            lo, hi = match[1], match[2] or match[1]
            out += [f"{n:0{len(lo)}d}" for n in range(int(lo), int(hi) + 1)]
        return out

    hosts = []
    for group in re.findall(r"(?:[^,\[\]]|\[[^\[\]]*\])+", nodelist):  # commas only in []
        parts = re.split(r"\[([^\]]*)\]", group)  # text, [ranges], text, [ranges], ..., text
        choices = [[p] if i % 2 == 0 else numbers(p) for i, p in enumerate(parts)]
        hosts += ["".join(pieces) for pieces in itertools.product(*choices)]
    if not hosts:  # callers take hosts[0] as the rendezvous host
        raise ConfigError(f"node list {nodelist!r} names no host; {example}")
    return hosts


def slurm_port(job_id: str) -> int:
    """A port every task of a job derives alike, spread over 20000-29999 by job id."""
    return 20000 + int(re.sub(r"\D", "", job_id) or 0) % 10000


def _missing(env: Mapping[str, str], names: tuple[str, ...]) -> list[str]:
    return [n for n in names if not env.get(n)]


def read_env(env: Mapping[str, str] | None = None) -> DistEnv:
    """Find out how this process was started. A half-set environment is an error."""
    env = os.environ if env is None else env
    torchrun = [n for n in TORCHRUN_VARS if env.get(n)]
    if torchrun:
        missing = _missing(env, TORCHRUN_VARS)
        if missing:
            raise ConfigError(
                f"distributed environment is half set: {', '.join(missing)} missing "
                f"(have {', '.join(torchrun)}); start with torchrun or unset them"
            )
        return DistEnv(
            rank=int(env["RANK"]),
            local_rank=int(env["LOCAL_RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            master_addr=env["MASTER_ADDR"],
            master_port=int(env["MASTER_PORT"]),
            source="torchrun",
        )
    if env.get("SLURM_STEP_ID") is not None and env.get("SLURM_PROCID") is not None:
        return _read_slurm(env)  # a task started by srun (not the batch script itself)
    return DistEnv()


def _read_slurm(env: Mapping[str, str]) -> DistEnv:
    missing = _missing(env, SLURM_VARS)
    if missing:
        raise ConfigError(f"SLURM task environment is incomplete: {', '.join(missing)} missing")
    world = int(env.get("SLURM_STEP_NUM_TASKS") or env["SLURM_NTASKS"])
    nodelist = env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"]
    return DistEnv(
        rank=int(env["SLURM_PROCID"]),
        local_rank=int(env["SLURM_LOCALID"]),
        world_size=world,
        master_addr=expand_nodelist(nodelist)[0],
        master_port=int(env.get("MASTER_PORT") or slurm_port(env["SLURM_JOB_ID"])),
        source="slurm",
    )


def host_name() -> str:
    """This node's name: SLURM's for a task (several slurmd may share one machine), else the OS's."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def limit_threads(denv: DistEnv) -> None:
    """Under srun, use the CPUs SLURM gave the task (torchrun sets OMP_NUM_THREADS itself):
    without a cgroup task plugin nothing else stops every rank from using every core."""
    cpus = os.environ.get("SLURM_CPUS_PER_TASK")
    if denv.source == "slurm" and cpus and cpus.isdigit() and not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(cpus))


def pick_device(requested: str, denv: DistEnv) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            mask = os.environ.get("CUDA_VISIBLE_DEVICES")
            seen = f" (CUDA_VISIBLE_DEVICES={mask!r})" if mask is not None else ""
            raise ConfigError(
                f"device=cuda but no CUDA device is visible on {host_name()}{seen}; GPUs were "
                "asked for: check the node's GPUs (gres), the CUDA driver or module, a "
                "container's --gpus/--nv; or ask for CPU processes (GPUS=0, device=cpu)"
            )
        index = denv.local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def init(denv: DistEnv, cfg: DistConfig, device: torch.device) -> None:
    """Join the process group (no-op for a single process)."""
    if not denv.distributed:
        return
    backend = cfg.backend if cfg.backend != "auto" else "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError("dist.backend=nccl needs CUDA devices; use dist.backend=gloo on CPU")
    if cfg.init_method == "env://":
        # srun provides no MASTER_*; publish what read_env derived so env:// finds it.
        os.environ.setdefault("MASTER_ADDR", denv.master_addr)
        os.environ.setdefault("MASTER_PORT", str(denv.master_port))
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    store = restart_safe_store(denv, timeout) if cfg.init_method == "env://" else None
    dist.init_process_group(
        backend=backend,
        init_method=None if store else cfg.init_method,
        store=store,
        rank=denv.rank,
        world_size=denv.world_size,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )


def restart_safe_store(denv: DistEnv, timeout: datetime.timedelta):
    """Under torchrun, the agent's store, with keys of their own for each restart. torchrun
    keeps one store across restarts, so a restarted rank could read the address a killed
    peer published in the failed attempt and fail with "connectFullMesh ... Connection
    refused" (pytorch/pytorch#135712). None outside torchrun (env:// as usual)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(
        denv.master_addr, denv.master_port, denv.world_size, is_master=False, timeout=timeout
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"recipes/attempt-{attempt}", store)


# The data-parallel group under tensor parallelism (None: the world). Sums of data (losses,
# counts, sample ids) go over it: every rank of a TP group holds the same batch, and summing
# over the world would count each sample tp times.
_data_group = None


def use_data_group(group) -> None:
    global _data_group
    _data_group = group


def shutdown() -> None:
    """Destroy the process group, once the caller has dropped what holds it (the wrapped
    model): gloo's threads end here, not during interpreter shutdown. DDP's reducer and its
    hooks form reference cycles, hence the collection first (a full collection of a
    process's heap: skipped when there is no group)."""
    use_data_group(None)
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The sum over the data-parallel ranks (each batch counted once), on every rank."""
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=_data_group)
    return tensor


@torch.no_grad()
def broadcast_buffers(module: torch.nn.Module) -> None:
    """Rank 0's buffers (e.g. batch norm statistics) on every rank. DDP sends them at the
    start of each forward, so after the last step every rank holds statistics updated by its
    own batch: evaluating with rank 0's makes the result that of the checkpointed weights."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        for buffer in module.buffers():
            dist.broadcast(buffer, src=0)


def max_over_ranks(value: int, device: torch.device) -> int:
    """The largest of the ranks' values, on every rank (a collective: call on all ranks)."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([float(value)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank when the flag is set on any rank (a collective: call on all ranks)."""
    if not dist.is_initialized():
        return flag
    t = torch.full((1,), 1.0 if flag else 0.0, device=device)  # a fill: no copy from the host
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def main_first(build):
    """build() on rank 0 first, then on the others (which reuse what rank 0 cached, e.g. a
    file index). A user error on rank 0 reaches every rank at once instead of leaving them
    waiting at a barrier until the timeout."""
    if not dist.is_initialized():
        return build()
    if dist.get_rank() == 0:
        try:
            result, error = build(), None
        except ConfigError as err:
            result, error = None, err
        broadcast_object(str(error) if error else None)
        if error:
            raise error
        return result
    error = broadcast_object(None)
    if error:
        raise ConfigError(error)
    return build()


def broadcast_object(obj, src: int = 0):
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_objects(obj, data: bool = False) -> list:
    """Every rank's obj, in rank order, on every rank; data=True: every data-parallel rank's
    (e.g. the samples each read: a TP group's ranks read the same)."""
    if not dist.is_initialized():
        return [obj]
    group = _data_group if data else None
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def on_main(action):
    """action() on rank 0 alone (its result there, None elsewhere); a ConfigError on rank 0 is
    raised on every rank at once instead of leaving the others at their next collective."""
    if not dist.is_initialized():
        return action()
    result, error = None, None
    if dist.get_rank() == 0:
        try:
            result = action()
        except ConfigError as err:
            error = err
    message = broadcast_object(str(error) if error else None)
    if error:
        raise error
    if message:
        raise ConfigError(message)
    return result
