"""Export a checkpoint's weights as a plain state dict: `python -m engine.export CKPT OUT`.

CKPT is a single-file checkpoint (`step-<n>.pt`), a sharded checkpoint directory
(`step-<n>/`, gathered here into whole tensors, in one process) or a run directory (its
newest checkpoint that loads; with `--best`, the best of its best checkpoints, `best/`).
OUT ends in `.pt` (torch.save of {name: tensor}, for `torch.load(..., weights_only=True)`
and `model.load_state_dict`) or `.safetensors` (with recipe, step and source as metadata).
Names carry no wrapper prefixes (`module.`, `_orig_mod.`), tensors are contiguous and on the
CPU: a plain single-process model loads them with no distributed code. `--ema` exports the
exponential moving average of the weights instead.

`--average` exports the mean of several checkpoints' weights (as timm's
avg_checkpoints.py): a run directory's best checkpoints, or the CKPT paths given. Floating
tensors are averaged in float64 and cast back to their dtype; the others (BatchNorm's
num_batches_tracked) are the first checkpoint's; every checkpoint must hold the same names
with the same shapes and dtypes. With `--ema`, the mean of their EMAs. The metadata of a
`.safetensors` OUT names the steps averaged (`averaged_steps`, the first one first).

OUT ending in `.onnx` or `.pt2` exports the recipe's model itself with those weights, for
serving (ONNX through torch.onnx's dynamo exporter, or a torch.export program), checked on
the spot against the eager model on the recipe's held-out samples, the figures in
`<OUT>.json`: engine/export_graph.py. A model that cannot be exported, a missing package or a failed
check is one line and exit code 1.

A user mistake is one line on stderr and exit code 2; OUT is written under a temporary
name and renamed, so it is either complete or absent."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from engine import checkpoint as ckpt
from engine import export_graph
from engine.atomic import unwritable
from engine.checkpoint import best as best_checkpoints
from engine.config import ConfigError
from engine.weights import files as weight_files

SUFFIXES = (".pt", ".safetensors")


class ExportError(Exception):
    """A user mistake, said in one line."""


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_request(args)
        out = check_out(Path(args.out), args.force)
        sources = choose([Path(p) for p in args.checkpoints], args.best, args.average)
        if args.average:
            tensors, info = average(sources, args.ema)
        else:
            tensors, info = read_weights(sources[0], args.ema)
        if out.suffix in export_graph.FORMATS:
            return for_serving(sources, tensors, info, out, args.ema)
        write(tensors, out, info)
    except (ExportError, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except export_graph.ServingError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except OSError as err:  # reading a checkpoint (a write's error is an ExportError)
        where = err.filename or args.checkpoints[0]
        print(f"error: cannot read {where} ({err.strerror or err})", file=sys.stderr)
        return 2
    values = sum(t.numel() for t in tensors.values())
    what = "EMA weights" if args.ema else "weights"
    if args.average:
        steps = info["averaged_steps"].replace(",", ", ")
        count = f"{len(sources)} checkpoint{'s' if len(sources) != 1 else ''}"
        what = f"the mean of the {what} of {count} (steps {steps})"
    else:
        what = f"{what} of step {info['step']}"
    print(f"wrote {out}: {what}, {len(tensors)} tensors, {values:,} parameters (buffers included)")
    return 0


def for_serving(
    sources: list[Path],
    tensors: dict[str, torch.Tensor],
    info: dict[str, Any],
    out: Path,
    ema: bool,
) -> int:
    """The recipe's model with these weights as a checked .onnx or .pt2 (engine.export_graph)."""
    saved = _read_meta(sources[0]).get("config")
    with export_graph.served(sources, saved, tensors, info.get("recipe", "")) as model:
        line, _ = export_graph.export(model, out, info, ema)
    print(line)
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m engine.export",
        description="Export a checkpoint's weights to a plain .pt or .safetensors state dict, "
        "or the recipe's model with them to a checked .onnx or .pt2 (torch.export) for serving.",
    )
    parser.add_argument(
        "checkpoints",
        nargs="+",
        metavar="CKPT",
        help="step-N.pt file, sharded step-N/ directory, or run dir (several: with --average)",
    )
    parser.add_argument(
        "out", metavar="OUT", help="the file to write: *.pt, *.safetensors, *.onnx or *.pt2"
    )
    parser.add_argument("--ema", action="store_true", help="export the EMA of the weights")
    parser.add_argument(
        "--best", action="store_true", help="a run dir's best checkpoint (best/), not its newest"
    )
    parser.add_argument(
        "--average",
        action="store_true",
        help="the mean of the weights of a run dir's best checkpoints, or of the CKPTs given",
    )
    parser.add_argument("--force", action="store_true", help="replace OUT if it exists")
    return parser.parse_args(argv)


def check_request(args: argparse.Namespace) -> None:
    if not all(args.checkpoints) or not args.out:
        raise ExportError(
            "give the checkpoint and the file to write (make export CKPT=... OUT=...)"
        )
    if len(args.checkpoints) > 1 and not args.average:
        raise ExportError(
            f"{len(args.checkpoints)} checkpoints given: several are exported only as their "
            "average (--average, make export ... AVERAGE=1)"
        )
    if len(args.checkpoints) > 1 and args.best:
        raise ExportError("--best takes one run directory (its best/ checkpoints)")


def check_out(out: Path, force: bool) -> Path:
    if out.suffix not in SUFFIXES + export_graph.FORMATS:
        raise ExportError(
            f"{out}: unknown format {out.suffix or '(no suffix)'}; use .pt or .safetensors "
            "(weights), .onnx or .pt2 (the model, for serving)"
        )
    if out.suffix == ".safetensors":
        _save_safetensors()  # missing: said before any checkpoint is read
    export_graph.check_packages(out.suffix)  # .onnx's packages, likewise
    if out.is_dir():
        raise ExportError(f"{out} is a directory; name the file to write")
    beside = [out, export_graph.json_path(out)] if out.suffix in export_graph.FORMATS else [out]
    for path in beside:
        if path.exists() and not force:
            raise ExportError(
                f"{path} exists; pass --force (make export ... FORCE=1) to replace it"
            )
    check_writable(out)
    return out


def check_writable(out: Path) -> None:
    """OUT's folder takes a file, tried before any checkpoint is read: a file is created in
    it (or in its nearest existing parent, where the missing folders will be made) and
    removed, so nothing is left behind."""
    folder = out.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=f".{out.name}.", suffix=".tmp")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise ExportError(unwritable(out, err)) from None


def choose(paths: list[Path], best: bool, average: bool) -> list[Path]:
    """The checkpoints to read: the one given or a run directory's newest; with --best a run
    directory's best; with --average a run directory's best set, or the checkpoints given."""
    for path in paths:
        if not path.exists():
            raise ExportError(f"{path} does not exist")
    if len(paths) > 1:
        for path in paths:
            if not (path.is_file() or weight_files.is_sharded(path)):
                raise ExportError(
                    f"{path} is not a checkpoint (step-N.pt or step-N/): averaging several "
                    "takes checkpoints, a run directory alone averages its best ones"
                )
        return paths
    path = paths[0]
    if path.name == best_checkpoints.FOLDER and (path.parent / "checkpoints").is_dir():
        path, best = path.parent, True  # a run's best/ folder: its best checkpoints
    if not (best or average) or path.is_file() or weight_files.is_sharded(path):
        if best:
            raise ExportError(f"{path} is a checkpoint; --best takes a run directory")
        return [resolve(path)]
    ranked = best_set(path)
    if average:
        names = ", ".join(p.name for p, _ in ranked)
        print(f"averaging the {len(ranked)} best checkpoints in {path}: {names}")
        return [p for p, _ in ranked]
    first, entry = ranked[0]
    print(f"best checkpoint in {path}: {first.name} ({headline_of(path)} {entry['value']:.6g})")
    return [first]


def best_set(run_dir: Path) -> list[tuple[Path, dict]]:
    """A run directory's best checkpoints, best first, each with its ranking entry."""
    folder = best_checkpoints.folder(run_dir)
    try:
        ranked = best_checkpoints.ranking(folder, _read_meta)
    except ExportError:
        raise
    except Exception as err:  # not a checkpoint, torn, or holding arbitrary objects
        raise ExportError(f"{folder} holds an unreadable checkpoint ({ckpt.reason(err)})") from None
    if not ranked:
        raise ExportError(
            f"{run_dir} holds no best checkpoints (a run directory with best/ in it, trained "
            "with ckpt.best > 0)"
        )
    return ranked


def headline_of(run_dir: Path) -> str:
    """The metric the best checkpoints are ranked by, as the run's env.json names it."""
    try:
        return json.loads((run_dir / "env.json").read_text())["task"]["headline"]
    except (OSError, ValueError, KeyError, TypeError):
        return "headline"


def _read_meta(path: Path) -> dict[str, Any]:
    """A checkpoint's meta (its tensors mapped, not read)."""
    if path.is_dir():
        from engine.checkpoint import sharded  # start-up time: imports DCP

        return sharded.read_meta(path)
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if not isinstance(state, dict):
        raise ExportError(f"{path} is not a checkpoint")
    return state


def resolve(path: Path) -> Path:
    """The checkpoint to export: the path itself, or a run directory's newest valid one."""
    if not path.exists():
        raise ExportError(f"{path} does not exist")
    found = weight_files.newest(path)
    if found != path:
        print(f"newest valid checkpoint in {path}: {found.name}")
    return found


def read_weights(path: Path, ema: bool) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """({name: contiguous CPU tensor}, {recipe, step, source})."""
    if path.is_dir():
        state, weights = _read_meta(path), weight_files.checkpoint_tensors(path, ema)
    else:
        state = _read_file(path)
        weights = weight_files.bare(weight_files.of_state(state, ema, path))
    tensors = {name: value.contiguous() for name, value in weights.items()}
    if not tensors:
        raise ExportError(f"{path} holds no weights")
    info = {"recipe": recipe_of(state, path), "step": state.get("step", "?")}
    return tensors, info | {"source": source_of(path)}


def source_of(path: Path) -> str:
    """<run name>/<checkpoint> (<run name>/best/<checkpoint> for a best checkpoint)."""
    where = Path(os.path.abspath(path))
    if where.parent.name == best_checkpoints.FOLDER:
        return f"{where.parent.parent.name}/{where.parent.name}/{where.name}"
    return f"{path.parent.parent.name}/{path.name}"


def average(paths: list[Path], ema: bool) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The mean of the checkpoints' weights (their EMAs with `ema`), read one at a time:
    floating tensors summed in float64 and cast back, the others the first checkpoint's."""
    first, info = read_weights(paths[0], ema)
    sums = {n: t.double() if t.is_floating_point() else t for n, t in first.items()}
    steps, sources = [str(info["step"])], [info["source"]]
    for path in paths[1:]:
        tensors, other = read_weights(path, ema)
        check_same(first, paths[0], tensors, path)
        for name, tensor in tensors.items():
            if tensor.is_floating_point():
                sums[name] += tensor.double()
        steps.append(str(other["step"]))
        sources.append(other["source"])
    mean = {
        n: (s / len(paths)).to(first[n].dtype) if first[n].is_floating_point() else s
        for n, s in sums.items()
    }
    info = {"recipe": info["recipe"], "averaged_steps": ",".join(steps)}
    return mean, info | {"source": ",".join(sources)}


def check_same(a: dict[str, torch.Tensor], a_path: Path, b: dict[str, torch.Tensor], b_path: Path):
    """Checkpoints averaged together hold the same names with the same shapes and dtypes;
    the first difference is the error."""
    for name, tensor in a.items():
        other = b.get(name)
        if other is None:
            raise ExportError(f"cannot average: {b_path} has no tensor {name} ({a_path} has)")
        if other.shape != tensor.shape:
            raise ExportError(
                f"cannot average: {name} is {list(tensor.shape)} in {a_path} but "
                f"{list(other.shape)} in {b_path}"
            )
        if other.dtype != tensor.dtype:
            raise ExportError(
                f"cannot average: {name} is {tensor.dtype} in {a_path} but {other.dtype} in "
                f"{b_path}"
            )
    extra = next((name for name in b if name not in a), None)
    if extra is not None:
        raise ExportError(f"cannot average: {b_path} has a tensor {extra} that {a_path} has not")


def recipe_of(state: dict[str, Any], path: Path) -> str:
    """The recipe that trained the checkpoint: its config's `recipe`, else the run directory's
    place, <run.root>/<recipe>/<run name>/checkpoints/<checkpoint> (where the engine writes
    every checkpoint; best/ for the best ones); "" when neither tells."""
    config = state.get("config")
    recipe = config.get("recipe") if isinstance(config, dict) else None
    if isinstance(recipe, str) and recipe:
        return recipe
    where = Path(os.path.abspath(path))  # `..` resolved, symbolic links kept
    in_folder = where.parent.name in ("checkpoints", best_checkpoints.FOLDER)
    inside_a_run = in_folder and len(where.parents) > 3
    return where.parents[2].name if inside_a_run else ""


def _read_file(path: Path) -> dict[str, Any]:
    try:
        state = ckpt.load(path)
    except ConfigError:
        raise
    except Exception as err:  # not a torch file, torn, or holding arbitrary objects
        raise ExportError(f"{path} is not a readable checkpoint ({ckpt.reason(err)})") from None
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise ExportError(f"{path} is not a checkpoint (no model state in it)")
    return state


def write(tensors: dict[str, torch.Tensor], out: Path, info: dict[str, Any]) -> None:
    """Write under a temporary name in OUT's folder, then rename: complete or absent."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
        os.close(fd)
    except OSError as err:
        raise ExportError(unwritable(out, err)) from None
    try:
        if out.suffix == ".safetensors":
            metadata = {key: str(value) for key, value in info.items()}
            _save_safetensors()(_unshared(tensors), tmp, metadata=metadata)
        else:
            torch.save(tensors, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except OSError as err:  # a full disk, a quota
        Path(tmp).unlink(missing_ok=True)
        raise ExportError(unwritable(out, err)) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _save_safetensors():
    """safetensors' save_file, or a one-line error naming the fix when it is not installed."""
    try:
        from safetensors.torch import save_file  # optional: only for .safetensors
    except ImportError:
        raise ExportError(
            "writing .safetensors needs the safetensors package, which is not installed: pip "
            "install safetensors (the project's requirements.lock has it), or export to .pt"
        ) from None
    return save_file


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (tied weights): each gets its own copy,
    so every name the model expects is in the file."""
    seen, out = set(), {}
    for name, tensor in tensors.items():
        storage = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if storage in seen else tensor
        seen.add(storage)
    return out


if __name__ == "__main__":
    sys.exit(main())
