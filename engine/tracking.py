"""What a run leaves behind: metrics.jsonl, env.json, a W&B run, TensorBoard events
(log.tensorboard), a progress display.
Only rank 0 creates these; other ranks get a Tracker that does nothing.

W&B never stops training: `auto` falls back to offline when W&B cannot be reached and is off
(said once) when the wandb package is not installed, and a W&B failure mid-run is reported
once and W&B is then left out. An explicit online or offline without wandb is a one-line
error in preflight. Credentials from the
environment are redacted from everything a run records.

W&B's own variables are honoured: WANDB_MODE, WANDB_PROJECT and WANDB_ENTITY set log.wandb,
log.project and log.entity over the config files and under the command line's overrides
(wandb_env_overrides); WANDB_DIR is where W&B writes (else the run directory); and
WANDB_RUN_GROUP is the run's group."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import netrc
import os
import platform
import secrets
import socket
import ssl
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch

from engine import hardware, rundir
from engine.atomic import atomic_write_text
from engine.config import ConfigError, LogConfig
from engine.redact import redact

PROVENANCE_VARS = (
    "RECIPES_IMAGE",
    "RECIPES_IMAGE_DIGEST",
    "RECIPES_BASE_IMAGE",
    "RECIPES_GIT_SHA",
    "RECIPES_LOCK_SHA256",
)
REPO = Path(__file__).resolve().parent.parent

# ---------------------------------------------------------------- W&B mode

PROBE_TIMEOUT_S = 5.0  # DNS, connect and first answer together
# wandb's own defaults wait 90 s for init and forever for the last upload; a run should not.
# Applied unless the user sets WANDB_INIT_TIMEOUT / WANDB_FINISH_TIMEOUT.
WANDB_TIMEOUTS = {"init_timeout": 30.0, "finish_timeout": 300.0}


# WANDB_MODE's values (those wandb itself takes) as log.wandb's.
WANDB_MODES = {"disabled": "off", "offline": "offline", "online": "online", "dryrun": "offline"}
WANDB_KEYS = {"WANDB_PROJECT": "log.project", "WANDB_ENTITY": "log.entity"}
DEFAULT_WANDB_URL = "https://api.wandb.ai"  # wandb's own default server


def wandb_env_overrides(environ: Mapping[str, str]) -> list[str]:
    """W&B's variables in `environ` as overrides, to be placed before the command line's so
    that those win: command line > environment > config files > engine default. An unset or
    empty variable sets nothing."""
    overrides = []
    if mode := environ.get("WANDB_MODE", "").strip().lower():
        if mode not in WANDB_MODES:
            raise ConfigError(
                f"WANDB_MODE={environ['WANDB_MODE']!r} is not one of {', '.join(WANDB_MODES)}; "
                "fix or unset it"
            )
        overrides.append(f"log.wandb={WANDB_MODES[mode]}")
    overrides += [f"{key}={environ[name]}" for name, key in WANDB_KEYS.items() if environ.get(name)]
    return overrides


def wandb_root(run_dir: Path) -> Path:
    """Where W&B writes its `wandb/` folder: $WANDB_DIR when set, else the run directory."""
    if configured := os.environ.get("WANDB_DIR"):
        return Path(configured).expanduser().absolute()
    return run_dir


def wandb_installed() -> bool:
    """Whether the wandb package can be found; imports nothing (importing it takes seconds)."""
    try:
        return importlib.util.find_spec("wandb") is not None
    except (ImportError, ValueError):  # a broken parent package, a module without a spec
        return False


def wandb_missing_note(cfg: LogConfig) -> str | None:
    """The note rank 0 gives once when log.wandb=auto turned W&B off for want of wandb."""
    if cfg.wandb != "auto" or wandb_installed():
        return None
    return (
        "note: log.wandb=auto: wandb is not installed, so W&B logging is off (pip install "
        "wandb, or set log.wandb=off to silence this)"
    )


def wandb_mode(cfg: LogConfig) -> str:
    """auto: online when there are credentials and W&B answers, else offline; off when wandb
    is not installed. online: both, or a one-line error. online or offline without wandb: a
    one-line error. Checked in preflight, before anything is written."""
    if cfg.wandb == "off":
        return "off"
    if not wandb_installed():
        if cfg.wandb == "auto":
            return "off"  # said once by rank 0's Tracker (wandb_missing_note)
        raise ConfigError(
            f"log.wandb={cfg.wandb} but wandb is not installed: pip install wandb (the "
            "project's requirements.lock has it), or set log.wandb=off"
        )
    if cfg.wandb == "offline":
        return "offline"
    # No key and no netrc entry: no credentials for any server, so wandb need not be imported
    # (a second or so) to learn which server is meant.
    url = wandb_base_url() if maybe_credentials() else DEFAULT_WANDB_URL
    if not has_wandb_credentials(url):
        if cfg.wandb == "online":
            raise ConfigError(
                "log.wandb=online but no W&B credentials: run `wandb login` or set "
                "WANDB_API_KEY, or use log.wandb=offline"
            )
        return "offline"
    reason = unreachable_reason(url)
    if reason and cfg.wandb == "online":
        raise ConfigError(
            f"log.wandb=online but W&B at {url} is unreachable ({reason}): check the network, "
            "HTTPS_PROXY or WANDB_BASE_URL, or use log.wandb=auto/offline and `wandb sync` later"
        )
    return "offline" if reason else "online"


def offline_reason(cfg: LogConfig) -> str:
    """Why wandb_mode chose offline (its probe is cached, so this asks nothing again)."""
    if cfg.wandb == "offline":
        return "log.wandb=offline"
    url = wandb_base_url()
    if not has_wandb_credentials(url):
        return "no credentials found"
    return f"W&B at {url} is unreachable: {unreachable_reason(url)}"


def wandb_base_url() -> str:
    if url := os.environ.get("WANDB_BASE_URL"):
        return url.rstrip("/")
    try:
        import wandb  # start-up time: seconds, only for runs that log to W&B
    except ImportError:  # installed but broken: wandb.init fails too, and says why
        return DEFAULT_WANDB_URL
    return wandb.Settings().base_url  # this wandb version's default server


def maybe_credentials() -> bool:
    """WANDB_API_KEY or any netrc entry: credentials for some server."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return bool(netrc.netrc(os.environ.get("NETRC")).hosts)
    except (OSError, netrc.NetrcParseError):
        return False


def has_wandb_credentials(url: str) -> bool:
    return bool(os.environ.get("WANDB_API_KEY")) or _netrc_has(urlsplit(url).netloc, "api.wandb.ai")


def _netrc_has(*hosts: str) -> bool:
    try:
        entries = netrc.netrc(os.environ.get("NETRC"))  # the file wandb reads too
    except (OSError, netrc.NetrcParseError):
        return False
    return any(entries.authenticators(host) for host in hosts)


@functools.cache
def unreachable_reason(url: str, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """Why the server at `url` cannot be reached, or None when it answers. Run in a thread:
    a DNS lookup on a node without a network can hang, and no socket timeout covers it."""
    answer: list[str | None] = []
    probe = threading.Thread(target=lambda: answer.append(_http_probe(url, timeout)), daemon=True)
    probe.start()
    probe.join(timeout)
    return answer[0] if answer else f"no answer within {timeout:g} s"


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None  # a redirect is an answer; following it could leave the W&B host


def _http_probe(url: str, timeout: float) -> str | None:
    """One GET through the proxies in the environment, as wandb's own requests go."""
    try:
        urllib.request.build_opener(_NoRedirect).open(url, timeout=timeout).close()
    except urllib.error.HTTPError as err:
        if err.code in (502, 503, 504):  # a proxy or gateway that cannot reach the server
            return f"HTTP {err.code} {err.reason}"
    except ssl.SSLError:
        pass  # something spoke TLS: the network works; wandb has its own certificate settings
    except (OSError, ValueError) as err:
        reason = getattr(err, "reason", err)
        return None if isinstance(reason, ssl.SSLError) else str(reason)
    return None


# ---------------------------------------------------------------- env.json


def lock_sha256() -> str | None:
    lock = REPO / "requirements.lock"
    return hashlib.sha256(lock.read_bytes()).hexdigest() if lock.exists() else None


def environment(
    world_size: int, hosts: list[str], device: torch.device, code: dict
) -> dict[str, Any]:
    """Versions and provenance for env.json (`code`: engine.codeid's identity of the code that
    runs). Never copies the environment wholesale, and redacts credentials from what it
    records (argv may hold one pasted into an override)."""
    devices = []
    if torch.cuda.is_available():
        devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return redact(
        {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version()
            if torch.backends.cudnn.is_available()
            else None,
            "git_sha": code.get("commit"),
            "git_dirty": code.get("dirty"),
            "code": code,
            "lock_sha256": lock_sha256() or os.environ.get("RECIPES_LOCK_SHA256"),
            "image": {
                k.removeprefix("RECIPES_").lower(): os.environ.get(k) for k in PROVENANCE_VARS
            },
            "host": socket.gethostname(),
            "hosts": sorted(set(hosts)),
            "world_size": world_size,
            "device": str(device),
            "cuda_devices": devices,
            "cpu_threads": torch.get_num_threads(),
            "hardware": hardware.facts(device),
            "argv": sys.argv,
            "slurm_job_id": rundir.slurm_job(),  # <array>_<task> for a sweep's member
        }
    )


# ---------------------------------------------------------------- the tracker


EVENT_KINDS = (
    "world_size",
    "code",
    "data",
    "requeue",
)  # records of what happened to the run, not of a step's metrics


def _record(line: str) -> dict | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


# ---------------------------------------------------------------- TensorBoard, live

TENSORBOARD_KINDS = ("train", "eval")  # the records of a step's metrics


def tensorboard_check(cfg: LogConfig) -> None:
    """log.tensorboard without the tensorboard package: a one-line error in preflight."""
    if cfg.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(
            "log.tensorboard=true but tensorboard is not installed: pip install tensorboard "
            "(the project's requirements.lock has it), or set log.tensorboard=false"
        )


class LiveTensorBoard:
    """log.tensorboard: every numeric field of each train and eval record as a TensorBoard
    scalar (<kind>/<field>, as make publish and W&B name them) at its step, in
    <run dir>/tensorboard/, through tensorboard's own event file writer (not
    torch.utils.tensorboard). Each start is marked at the step after its checkpoint:
    TensorBoard drops what an earlier start wrote from there on (those steps are trained
    again), so a step is never shown twice."""

    def __init__(self, run_dir: Path, resume_step: int):
        from tensorboard.compat.proto import event_pb2  # optional: log.tensorboard only
        from tensorboard.plugins.scalar.summary_v2 import scalar_pb  # optional: as above
        from tensorboard.summary.writer.event_file_writer import EventFileWriter  # optional

        self.event_pb2, self.scalar_pb = event_pb2, scalar_pb
        self.writer = EventFileWriter(str(run_dir / "tensorboard"), flush_secs=10)
        # Every start marks itself (TensorBoard takes the first mark as the run's start): the
        # first step it trains, the one after its checkpoint.
        start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
        self._add(event_pb2.Event(step=resume_step + 1, session_log=start))

    def _add(self, event: Any) -> None:
        event.wall_time = time.time()
        self.writer.add_event(event)

    def write(self, record: dict[str, Any]) -> None:
        kind = record["kind"]
        if kind not in TENSORBOARD_KINDS:
            return
        event = self.event_pb2.Event(step=record["step"])
        for key, value in record.items():
            if key not in ("kind", "step") and type(value) in (int, float):
                event.summary.value.extend(self.scalar_pb(f"{kind}/{key}", value).value)
        self._add(event)

    def close(self) -> None:
        self.writer.close()


class Tracker:
    """Rank 0's writer. Other ranks use NullTracker."""

    def __init__(self, run_dir: Path, cfg: LogConfig, mode: str, config: dict, resume_step: int):
        self.run_dir = run_dir
        self.metrics_path = run_dir / "metrics.jsonl"
        # The last step recorded before this start: beyond resume_step after a crash or a
        # restart at another world size (those steps are trained again).
        self.last_step = self._truncate_after(self.metrics_path, resume_step)
        # log.sample_ids: a line's step counts the steps done before the one it records
        self._truncate_after(run_dir / "samples.jsonl", resume_step - 1)
        self.metrics = self.metrics_path.open("a")
        self.wandb = None
        if mode == "off" and (note := wandb_missing_note(cfg)):
            log(note)
        if mode != "off":
            self.wandb = self._start_wandb(cfg, mode, redact(config))
        self.tensorboard = LiveTensorBoard(run_dir, resume_step) if cfg.tensorboard else None

    @staticmethod
    def _truncate_after(path: Path, step: int) -> int:
        """A resumed run repeats the steps after its checkpoint: drop their old records, and
        a line torn by a kill mid-write (said once). Replaced whole, so a crash here loses
        nothing. Returns the last step the file recorded (`step` when none was later)."""
        if not path.exists():
            return step
        kept, last = [], step
        for number, line in enumerate(path.read_text().splitlines(), 1):
            record = _record(line)
            if record is None and line.strip():
                log(f"warning: {path}: line {number} dropped, torn (written in part)")
            elif record is not None and record.get("step", 0) <= step:
                kept.append(line + "\n")
            elif record is not None and isinstance(record.get("step"), int):
                last = max(last, record["step"])
        atomic_write_text(path, "".join(kept))
        return last

    def _start_wandb(self, cfg: LogConfig, mode: str, config: dict):
        """The W&B run; offline when online fails under `auto`; None (with a warning) when
        even that fails, since training matters more than its W&B copy."""
        run_id = self._wandb_run_id()
        try:
            run = self._init_wandb(cfg, mode, config, run_id)
        except Exception as err:  # wandb raises its own errors, network and OS errors
            if cfg.wandb == "online":
                _abandon_wandb()  # its exit hook would add a traceback to the one-line error
                raise ConfigError(
                    f"log.wandb=online but wandb.init failed ({error_line(err)}); check the W&B "
                    "credentials and server, or use log.wandb=auto/offline"
                ) from None
            if mode == "offline":
                return self._disable_wandb(err)
            return self._start_wandb_offline(
                cfg, config, run_id, f"wandb.init failed: {error_line(err)}"
            )
        if mode == "offline":
            self._say_offline(offline_reason(cfg), run_id)
        return run

    def _start_wandb_offline(self, cfg: LogConfig, config: dict, run_id: str, reason: str):
        _abandon_wandb()  # else the failed online run still holds the run id
        try:
            run = self._init_wandb(cfg, "offline", config, run_id)
        except Exception as err:
            return self._disable_wandb(err)
        self._say_offline(reason, run_id)
        return run

    def _wandb_run_id(self) -> str:
        """Kept in the run directory so a resumed or requeued run continues the same W&B run."""
        id_file = self.run_dir / "wandb-id.txt"
        run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
        id_file.write_text(run_id + "\n")
        return run_id

    def _init_wandb(self, cfg: LogConfig, mode: str, config: dict, run_id: str):
        import wandb  # start-up time: seconds, only for runs that log to W&B

        timeouts = {
            k: v for k, v in WANDB_TIMEOUTS.items() if f"WANDB_{k.upper()}" not in os.environ
        }
        root = wandb_root(self.run_dir)
        root.mkdir(parents=True, exist_ok=True)
        with _redacted_argv():
            return wandb.init(
                project=redact(cfg.project),
                entity=redact(cfg.entity),
                group=redact(os.environ.get("WANDB_RUN_GROUP")) or None,
                id=run_id,
                resume="allow",
                dir=str(root),
                name=self.run_dir.name,
                mode=mode,
                config=config,
                settings=wandb.Settings(
                    silent=True, console="off", finish_timeout_raises=True, **timeouts
                ),
            )

    def _say_offline(self, reason: str, run_id: str) -> None:
        root = wandb_root(self.run_dir)
        # A shared WANDB_DIR holds other runs too: name this one by its id.
        runs = "offline-run-*" if root == self.run_dir else f"offline-run-*-{run_id}"
        log(f"W&B is offline ({reason}); upload later with: wandb sync {root}/wandb/{runs}")

    def _disable_wandb(self, err: Exception) -> None:
        """Report a W&B failure once; the run goes on without W&B."""
        log(
            f"warning: W&B failed ({error_line(err)}); continuing without W&B, every record "
            f"still goes to {self.metrics_path}"
        )
        self.wandb = None
        _abandon_wandb()

    def write(self, record: dict[str, Any]) -> None:
        self.metrics.write(json.dumps(record) + "\n")
        self.metrics.flush()
        if self.tensorboard is not None:
            self.tensorboard.write(record)
        if self.wandb is not None:
            prefix = record["kind"]
            data = {f"{prefix}/{k}": v for k, v in record.items() if k not in ("kind", "step")}
            # An event names its own step and goes in at W&B's current one: a resumed W&B run
            # drops what is logged at a step it has passed, as a restart's is.
            step = None if prefix in EVENT_KINDS else record["step"]
            if step is None:
                data[f"{prefix}/step"] = record["step"]
            try:
                self.wandb.log(data, step=step)
            except Exception as err:  # e.g. its service process died: ConnectionResetError
                self._disable_wandb(err)

    def close(self) -> None:
        self.metrics.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            try:
                self.wandb.finish()
            except Exception as err:  # also finish_timeout's TimeoutError
                self._disable_wandb(err)


def _abandon_wandb() -> None:
    """Drop wandb's process-wide state after a failure. Its teardown also unregisters the
    exit hook that would otherwise print a traceback for a dead service at exit. Nothing to
    drop when wandb was never imported (or could not be)."""
    wandb = sys.modules.get("wandb")
    if wandb is None:
        return
    with contextlib.suppress(Exception):
        wandb.teardown()


@contextlib.contextmanager
def _redacted_argv():
    """wandb records sys.argv in the run's metadata, where a pasted credential must not go."""
    saved = sys.argv
    sys.argv = redact(saved)
    try:
        yield
    finally:
        sys.argv = saved


def error_line(err: Exception) -> str:
    """`Type: first line of the message`, for one-line reports of third-party errors."""
    lines = [line for line in str(err).splitlines() if line.strip()]
    return redact(f"{type(err).__name__}: {lines[0].strip() if lines else 'no message'}")


class NullTracker:
    def write(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def log(message: str) -> None:
    text = redact(message)
    print(text, file=sys.stderr, flush=True)
    to_log_file(text)


# Rank 0's copy of its log lines while it holds its run directory: <run dir>/train.log.
_LOG_FILE: list[Path] = []


def log_to(path: Path | None) -> None:
    """From now on every log() line also goes to `path` (appended: a resumed run continues
    its log); None: no longer. Where a local run's `make logs` reads; under SLURM the job's
    output files hold the same lines and those of the other ranks."""
    _LOG_FILE[:] = [path] if path is not None else []


def to_log_file(text: str) -> None:
    """A line for the run's log file alone (what reached stderr another way). A file that
    cannot be written is given up silently: the run's own writes report a full disk."""
    for path in list(_LOG_FILE):
        try:
            with path.open("a") as f:
                f.write(text + "\n")
        except OSError:
            _LOG_FILE.clear()


class ProgressBar:
    """A tqdm bar on a terminal, plain lines otherwise (CI logs, SLURM output files)."""

    def __init__(self, total: int, initial: int, style: str, enabled: bool):
        if style == "auto":
            style = "bar" if sys.stderr.isatty() else "plain"
        self.style = style if enabled else "off"
        self.bar = None
        if self.style == "bar":
            from tqdm import tqdm  # start-up time: only for the progress bar

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)
        self.total = total
        self.started = time.perf_counter()

    def update(self, step: int, record: dict[str, Any] | None) -> None:
        # A train record's epoch is the epochs completed before its step: the step's own
        # epoch, counted from 1 as the evaluation lines count, is one more.
        line = record and (
            f"step {step}/{self.total} epoch {record['epoch'] + 1} loss {record['loss']:.4f} "
            f"lr {record['lr']:.4g} {record['samples_per_s']:.0f} samples/s"
        )
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            if record:
                self.bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.3g}")
                to_log_file(line)  # the bar is for the terminal; the log keeps the line
        elif self.style == "plain" and record:
            log(line)

    def message(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(redact(text), file=sys.stderr)
            to_log_file(redact(text))
        elif self.style != "off":
            log(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
