"""Export for serving: `python -m engine.export CKPT model.onnx` or `model.pt2`
(`make export CKPT=... OUT=model.onnx`), called by engine.export for those two suffixes.

The recipe's model is rebuilt from the request that trained it (the run's saved config.yaml,
else the config inside the checkpoint) and given the exported weights (a checkpoint's, its
EMA, a run's best, or an average: whatever engine.export read), on the CPU, in float32 and
in the contiguous layout. It is traced by torch.export with the held-out samples' shape and
a dynamic batch dimension:
- `.pt2`: the ExportedProgram, torch.export.save; load it with torch.export.load;
- `.onnx`: that program through torch.onnx's dynamo exporter (onnxscript), checked by
  onnx.checker and loaded into an onnxruntime CPU session.

Every export is checked before it is kept: the first held-out samples of the recipe (its
evaluation split, loaded and finished on the CPU by the engine's own evaluation data path)
go through the eager model and through what was written, at two batch sizes (1 and 8: the
batch is dynamic, not the traced one). The largest absolute difference, divided by the
largest absolute eager output, must be at most TOLERANCE. An ONNX file is checked through
onnxruntime and through the exported program it came from; a .pt2 through the program loaded
back from the file. One line says the figures, and `<OUT>.json` beside the file records them
with the source checkpoint, the file's sha256, the input shape and dtype and the ONNX opset.

A model torch.export refuses (data-dependent control flow, say) is one line naming the
module and the reason; so are a missing package and a failed check (exit 1). Nothing is
written then: the file and its JSON are written under temporary names and renamed only once
the check has passed."""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import io
import json
import linecache
import logging
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from engine import atomic, catalog, rundir
from engine import config as C
from engine import distributed as D
from engine import weights as home
from engine.assemble import setup_eval
from engine.data.loaders import eval_loader
from engine.eval_only import for_scoring
from engine.run import Run

FORMATS = (".onnx", ".pt2")
# The largest |served - eager| over the checked outputs, divided by the largest |eager|.
TOLERANCE = 1e-4
CHECK_BATCHES = (1, 8)  # batch sizes checked; the trace uses EXAMPLE_BATCH samples
EXAMPLE_BATCH = 2  # not 1: torch.export would specialise a batch of one
ONNX_PACKAGES = ("onnx", "onnxruntime", "onnxscript")
# Set for the export whatever the run trained with: a float32, contiguous, uncompiled model on
# the CPU, one process, no loader workers (a few samples).
FOR_EXPORT = {
    "device": "cpu",
    "train.amp": "off",
    "train.channels_last": False,
    "train.compile": "off",
    "dist.strategy": "none",
    "loader.num_workers": 0,
}


class ServingError(Exception):
    """The model cannot be exported or failed its check, or a package is missing: one line."""


@dataclass
class Served:
    """The eager model with the exported weights, and the run that reads its held-out data."""

    model: nn.Module
    run: Run
    recipe: str


def check_packages(suffix: str) -> None:
    """.onnx needs onnx, onnxruntime and onnxscript; said before any checkpoint is read."""
    if suffix != ".onnx":
        return
    missing = []
    for name in ONNX_PACKAGES:
        try:
            importlib.import_module(name)  # optional: only for .onnx
        except ImportError:
            missing.append(name)
    if missing:
        raise ServingError(
            f"writing .onnx needs {', '.join(missing)}, not installed: pip install "
            f"{' '.join(ONNX_PACKAGES)} (requirements.lock pins them; the project's `serving` "
            "extra), or export to .pt2"
        )


@contextlib.contextmanager
def served(sources: list[Path], saved: dict | None, tensors: dict[str, torch.Tensor], recipe: str):
    """The recipe's model holding `tensors`, built as `make eval` builds it (the run's request,
    the weights loaded strictly), on the CPU; closed on exit."""
    cfg, recipe_ = request_of(sources[0], saved, recipe)
    with tempfile.TemporaryDirectory(prefix="export-") as tmp:
        weights = Path(tmp) / "weights.pt"
        torch.save(tensors, weights)
        for_scoring(cfg, weights, ema=False)  # the EMA, if asked for, is what `tensors` hold
        C.finalize(cfg, FOR_EXPORT)
        denv = D.read_env()
        if denv.world_size > 1:
            raise ServingError("export runs in one process (not under torchrun or srun)")
        with contextlib.redirect_stderr(io.StringIO()):  # its line names the temporary file
            run = setup_eval(cfg, recipe_, denv, torch.device("cpu"))
        try:
            yield Served(run.net.bare.eval(), run, cfg.recipe)
        finally:
            run.close()


def request_of(source: Path, saved: dict | None, recipe: str):
    """(config, recipe) of the run that wrote the checkpoint: its run directory's config.yaml,
    else the config the checkpoint carries, else the recipe's defaults."""
    config = rundir.run_config_of(source)
    with tempfile.TemporaryDirectory(prefix="export-") as tmp:
        if config is None and isinstance(saved, dict) and saved.get("recipe"):
            config = Path(tmp) / "config.yaml"
            config.write_text(yaml.safe_dump(saved, sort_keys=False))
        name = catalog.file_recipe(str(config)) if config is not None else recipe
        if not name:
            raise C.ConfigError(
                f"{source}: cannot tell which recipe trained it (no run directory, no config in "
                "the checkpoint), so there is no model to export"
            )
        loaded = catalog.load_config(name, ["run.name="], str(config) if config else "")
    home.follow_preprocessing(*loaded)
    return loaded


def held_out(run: Run, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The held-out split in order, (inputs, targets) batches as evaluation finishes them."""
    data = run.feed.eval_data
    loader = eval_loader(data, batch_size, 0, 1, run.cfg.loader, run.device, run.health.skip_bad)
    for batch in loader:
        yield run.to_device(batch.x, batch.y, data)


def samples(run: Run) -> torch.Tensor:
    """The first max(CHECK_BATCHES) held-out inputs (fewer if the split is smaller)."""
    x, _ = next(held_out(run, max(CHECK_BATCHES)))
    if len(x) < EXAMPLE_BATCH:
        raise ServingError(f"the held-out split has {len(x)} sample(s); the check needs 2")
    return x.contiguous()


def export(
    served_: Served, out: Path, info: dict[str, Any], ema: bool
) -> tuple[str, dict[str, Any]]:
    """Write OUT (and OUT.json) after checking it; (the line to print, the record)."""
    x = samples(served_.run)
    program = trace(served_.model, x[:EXAMPLE_BATCH], served_.recipe)
    record = describe(served_, x, info, ema, out)
    tmp = temporary(out)
    try:
        if out.suffix == ".pt2":
            with open(tmp, "wb") as f:
                torch.export.save(program, f)
            with open(tmp, "rb") as f:
                served_by = {"exported program (from the file)": torch.export.load(f).module()}
        else:
            record["opset"] = to_onnx(program, x[:EXAMPLE_BATCH], tmp)
            served_by = {"onnxruntime": OnnxRunner(tmp), "exported program": program.module()}
        record["check"] = check(served_.model, served_by, x)
        record["sha256"], record["bytes"] = sha256(tmp), tmp.stat().st_size
        if not record["check"]["passed"]:
            raise ServingError(f"{out}: the check failed, nothing written: {summary(record)}")
        finish(tmp, out, json.dumps(record, indent=2) + "\n")
    except OSError as err:  # a full disk, a quota
        raise ServingError(atomic.unwritable(out, err)) from None
    finally:
        tmp.unlink(missing_ok=True)
    return f"wrote {out}: {summary(record)}; figures in {json_path(out).name}", record


def json_path(out: Path) -> Path:
    return out.with_name(out.name + ".json")


def temporary(out: Path) -> Path:
    """An empty file in OUT's folder, where OUT is written before it is checked."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    except OSError as err:
        raise ServingError(atomic.unwritable(out, err)) from None
    os.close(fd)
    return Path(tmp)


def finish(tmp: Path, out: Path, text: str) -> None:
    """The checked file renamed into place, then its JSON (itself written and renamed)."""
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, out)
    atomic.atomic_write_text(json_path(out), text)


def trace(model: nn.Module, example: torch.Tensor, recipe: str) -> torch.export.ExportedProgram:
    """torch.export's program of the model with a dynamic batch, or a ServingError naming the
    module that torch.export refused and why."""
    batch = torch.export.Dim("batch", min=1)
    try:
        with quiet_torch_logs():
            return torch.export.export(
                model, (example,), dynamic_shapes=({0: batch},), strict=False
            )
    except Exception as err:  # torch.export's refusals have no common base class
        raise ServingError(refusal(err, model, recipe)) from None


def refusal(err: BaseException, model: nn.Module, recipe: str) -> str:
    """One line: the innermost module of the model (outside torch's own code when there is
    one) whose forward was running when torch.export gave up, where, and torch's reason."""
    names = {id(module): name for name, module in model.named_modules()}
    found, tb = [], err.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if id(owner) in names:
            found.append((owner, tb.tb_frame.f_code.co_filename, tb.tb_lineno))
        tb = tb.tb_next
    own = [f for f in found if f"{os.sep}torch{os.sep}" not in f[1]]
    reason = first_line(err)
    if not (own or found):
        return f"torch.export refuses the {recipe} model ({type(model).__name__}): {reason}"
    owner, filename, line = (own or found)[-1]
    name = names[id(owner)] or "(the model itself)"
    code = linecache.getline(filename, line).strip()
    where = f"{short_path(filename)}:{line}" + (f" `{code}`" if code else "")
    return f"torch.export refuses module {name} ({type(owner).__name__}, {where}): {reason}"


def first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    text = lines[0] if lines else type(err).__name__
    return text if len(text) <= 240 else text[:237] + "..."


def short_path(filename: str) -> str:
    """A path inside the checkout relative to it, else as it is."""
    try:
        return str(Path(filename).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return filename


@contextlib.contextmanager
def quiet_torch_logs():
    """torch's loggers say a refused trace at length on stderr; the refusal is one line."""
    loggers = [logging.getLogger("torch")]
    loggers += [
        logging.getLogger(name)
        for name in logging.root.manager.loggerDict
        if name.startswith("torch")
    ]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def to_onnx(program: torch.export.ExportedProgram, example: torch.Tensor, tmp: Path) -> int:
    """The program as ONNX (torch.onnx's dynamo exporter) in `tmp`, checked by onnx.checker;
    its default-domain opset."""
    import onnx  # optional: only for .onnx (check_packages said it is there)

    batch = torch.export.Dim("batch", min=1)
    try:
        with quiet_torch_logs():
            onnx_program = torch.onnx.export(
                program,
                (example,),
                dynamo=True,
                dynamic_shapes=({0: batch},),
                input_names=["input"],
                verbose=False,
            )
            onnx_program.save(str(tmp), external_data=False)
        proto = onnx.load(str(tmp))
        onnx.checker.check_model(proto, full_check=True)
    except Exception as err:  # the converter's and the checker's errors have no common base
        raise ServingError(
            f"torch.onnx cannot convert the exported program: {first_line(err)}"
        ) from None
    return next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))


class OnnxRunner:
    """An onnxruntime CPU session of an exported file, called like the model."""

    def __init__(self, path: Path):
        import onnxruntime  # optional: only for .onnx (check_packages said it is there)

        options = onnxruntime.SessionOptions()
        options.log_severity_level = 3  # errors only
        self.session = onnxruntime.InferenceSession(
            str(path), options, providers=["CPUExecutionProvider"]
        )
        self.input = self.session.get_inputs()[0].name

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        outputs = self.session.run(None, {self.input: x.detach().cpu().numpy()})
        return [torch.from_numpy(o) for o in outputs]


def leaves(outputs: Any) -> list[torch.Tensor]:
    """A model's outputs as a flat list of tensors (a tensor, or tuples and lists of them)."""
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    if isinstance(outputs, list | tuple):
        return [t for o in outputs for t in leaves(o)]
    if isinstance(outputs, dict):
        return [t for o in outputs.values() for t in leaves(o)]
    raise ServingError(f"the model returns {type(outputs).__name__}, not tensors")


@torch.no_grad()
def check(model: nn.Module, served_by: dict[str, Any], x: torch.Tensor) -> dict[str, Any]:
    """Each server's outputs against the eager model's at each batch size: the largest
    absolute difference, and that over the largest absolute eager output."""
    sizes = sorted({min(n, len(x)) for n in CHECK_BATCHES})
    eager = {n: [t.float() for t in leaves(model(x[:n]))] for n in sizes}
    scale = max(t.abs().max().item() for outs in eager.values() for t in outs)
    scale = scale if scale > 0 else 1.0
    diffs = {}
    for name, server in served_by.items():
        worst = 0.0
        for n in sizes:
            got = [t.float() for t in leaves(server(x[:n]))]
            if [t.shape for t in got] != [t.shape for t in eager[n]]:
                raise ServingError(
                    f"{name} gives outputs of shape {[list(t.shape) for t in got]} for a batch "
                    f"of {n}, the model {[list(t.shape) for t in eager[n]]}"
                )
            for a, b in zip(got, eager[n], strict=True):
                d = (a - b).abs().max().item() if a.numel() else 0.0
                worst = max(worst, d if d == d else float("inf"))  # NaN fails
        diffs[name] = worst
    relative = {name: d / scale for name, d in diffs.items()}
    return {
        "samples": len(x),
        "batch_sizes": sizes,
        "tolerance": TOLERANCE,
        "measure": "max |served - eager| / max |eager|",
        "output_scale": scale,
        "max_abs_diff": diffs,
        "relative_diff": relative,
        "passed": all(r <= TOLERANCE for r in relative.values()),
    }


def describe(
    served_: Served, x: torch.Tensor, info: dict[str, Any], ema: bool, out: Path
) -> dict[str, Any]:
    """What the file holds and where it came from (the check's figures are added after)."""
    record = {
        "format": "onnx" if out.suffix == ".onnx" else "torch.export",
        "file": out.name,
        "recipe": served_.recipe,
        "source": info.get("source"),
        "step": info.get("step"),
        "ema": ema,
        "input": {"shape": ["batch", *x.shape[1:]], "dtype": str(x.dtype).removeprefix("torch.")},
        "torch": torch.__version__,
    }
    if "averaged_steps" in info:
        record["averaged_steps"] = info["averaged_steps"]
    if out.suffix == ".onnx":
        import onnx  # optional: only for .onnx (check_packages said it is there)
        import onnxruntime  # optional: likewise

        record |= {"onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__}
    return record


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def summary(record: dict[str, Any]) -> str:
    """The figures in one line."""
    check_ = record["check"]
    diffs = ", ".join(
        f"{name} {check_['max_abs_diff'][name]:.2g} ({check_['relative_diff'][name]:.2g})"
        for name in check_["max_abs_diff"]
    )
    shape = "x".join(str(d) for d in record["input"]["shape"])
    sizes = " and ".join(map(str, check_["batch_sizes"]))
    verdict = "<=" if check_["passed"] else "EXCEEDS"
    opset = f", opset {record['opset']}" if "opset" in record else ""
    return (
        f"input {shape} {record['input']['dtype']}{opset}; on {check_['samples']} held-out "
        f"samples at batch {sizes}, max |diff| (relative to max |eager| "
        f"{check_['output_scale']:.3g}): {diffs} {verdict} {TOLERANCE:g}"
    )
