"""What a run leaves behind: metrics.jsonl, env.json, a W&B run, a progress display.
Only rank 0 creates these; other ranks get a Tracker that does nothing."""

from __future__ import annotations

import hashlib
import json
import netrc
import os
import platform
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from engine.config import ConfigError, LogConfig

PROVENANCE_VARS = (
    "RECIPES_IMAGE",
    "RECIPES_IMAGE_DIGEST",
    "RECIPES_BASE_IMAGE",
    "RECIPES_GIT_SHA",
    "RECIPES_LOCK_SHA256",
)
REPO = Path(__file__).resolve().parent.parent


def wandb_mode(cfg: LogConfig) -> str:
    """auto: online with credentials, else offline. Checked before anything is written."""
    has_key = bool(os.environ.get("WANDB_API_KEY")) or _netrc_has_wandb()
    if cfg.wandb == "online" and not has_key:
        raise ConfigError(
            "log.wandb=online but no W&B credentials: run `wandb login` or set WANDB_API_KEY, "
            "or use log.wandb=offline"
        )
    if cfg.wandb == "auto":
        return "online" if has_key else "offline"
    return cfg.wandb


def _netrc_has_wandb() -> bool:
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def lock_sha256() -> str | None:
    lock = REPO / "requirements.lock"
    return hashlib.sha256(lock.read_bytes()).hexdigest() if lock.exists() else None


def environment(world_size: int, hosts: list[str], device: torch.device) -> dict[str, Any]:
    """Versions and provenance for env.json. Never copies the environment wholesale (secrets)."""
    sha = _git("rev-parse", "HEAD") or os.environ.get("RECIPES_GIT_SHA")
    dirty = _git("status", "--porcelain")
    devices = []
    if torch.cuda.is_available():
        devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "git_sha": sha,
        "git_dirty": None if dirty is None else bool(dirty),
        "lock_sha256": lock_sha256() or os.environ.get("RECIPES_LOCK_SHA256"),
        "image": {k.removeprefix("RECIPES_").lower(): os.environ.get(k) for k in PROVENANCE_VARS},
        "host": socket.gethostname(),
        "hosts": sorted(set(hosts)),
        "world_size": world_size,
        "device": str(device),
        "cuda_devices": devices,
        "cpu_threads": torch.get_num_threads(),
        "argv": sys.argv,
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
    }


class Tracker:
    """Rank 0's writer. Other ranks use NullTracker."""

    def __init__(self, run_dir: Path, cfg: LogConfig, mode: str, config: dict, resume_step: int):
        self.run_dir = run_dir
        self.metrics_path = run_dir / "metrics.jsonl"
        self._truncate_after(resume_step)
        self.metrics = self.metrics_path.open("a")
        self.wandb = None
        if mode != "off":
            self.wandb = self._start_wandb(cfg, mode, config)

    def _truncate_after(self, step: int) -> None:
        """A resumed run repeats the steps after its checkpoint: drop their old records."""
        if not self.metrics_path.exists():
            return
        kept = [
            line
            for line in self.metrics_path.read_text().splitlines(keepends=True)
            if line.strip() and json.loads(line).get("step", 0) <= step
        ]
        self.metrics_path.write_text("".join(kept))

    def _start_wandb(self, cfg: LogConfig, mode: str, config: dict):
        import wandb

        id_file = self.run_dir / "wandb-id.txt"
        run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
        id_file.write_text(run_id + "\n")
        run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            id=run_id,
            resume="allow",
            dir=str(self.run_dir),
            name=self.run_dir.name,
            mode=mode,
            config=config,
            settings=wandb.Settings(silent=True, console="off"),
        )
        if mode == "offline":
            log(
                "W&B is offline (no credentials found); upload later with: "
                f"wandb sync {self.run_dir}/wandb/offline-run-*"
            )
        return run

    def write(self, record: dict[str, Any]) -> None:
        self.metrics.write(json.dumps(record) + "\n")
        self.metrics.flush()
        if self.wandb is not None:
            prefix = record["kind"]
            data = {f"{prefix}/{k}": v for k, v in record.items() if k not in ("kind", "step")}
            self.wandb.log(data, step=record["step"])

    def close(self) -> None:
        self.metrics.close()
        if self.wandb is not None:
            self.wandb.finish()


class NullTracker:
    def write(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Progress:
    """A tqdm bar on a terminal, plain lines otherwise (CI logs, SLURM output files)."""

    def __init__(self, total: int, initial: int, style: str, enabled: bool):
        if style == "auto":
            style = "bar" if sys.stderr.isatty() else "plain"
        self.style = style if enabled else "off"
        self.bar = None
        if self.style == "bar":
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)
        self.total = total
        self.started = time.perf_counter()

    def update(self, step: int, record: dict[str, Any] | None) -> None:
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            if record:
                self.bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.3g}")
        elif self.style == "plain" and record:
            log(
                f"step {step}/{self.total} epoch {record['epoch']} loss {record['loss']:.4f} "
                f"lr {record['lr']:.4g} {record['samples_per_s']:.0f} samples/s"
            )

    def message(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        elif self.style != "off":
            log(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
