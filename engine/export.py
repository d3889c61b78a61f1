"""Export a checkpoint's weights as a plain state dict: `python -m engine.export CKPT OUT`.

CKPT is a single-file checkpoint (`step-<n>.pt`), a sharded checkpoint directory
(`step-<n>/`, gathered here into whole tensors, in one process) or a run directory (its
newest checkpoint that loads). OUT ends in `.pt` (torch.save of {name: tensor}, for
`torch.load(..., weights_only=True)` and `model.load_state_dict`) or `.safetensors`
(with recipe, step and source as metadata). Names carry no wrapper prefixes (`module.`,
`_orig_mod.`), tensors are contiguous and on the CPU: a plain single-process model loads
them with no distributed code. `--ema` exports the average of the weights instead.

A user mistake is one line on stderr and exit code 2; OUT is written under a temporary
name and renamed, so it is either complete or absent."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from engine import checkpoint as ckpt
from engine.config import ConfigError

SUFFIXES = (".pt", ".safetensors")


class ExportError(Exception):
    """A user mistake, said in one line."""


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if not args.checkpoint or not args.out:
            raise ExportError(
                "give the checkpoint and the file to write (make export CKPT=... OUT=...)"
            )
        out = check_out(Path(args.out), args.force)
        source = resolve(Path(args.checkpoint))
        tensors, info = read_weights(source, args.ema)
        write(tensors, out, info)
    except (ExportError, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"error: could not write {args.out}: {err.strerror or err}", file=sys.stderr)
        return 2
    values = sum(t.numel() for t in tensors.values())
    what = "EMA weights" if args.ema else "weights"
    print(
        f"wrote {out}: {what} of step {info['step']}, {len(tensors)} tensors, "
        f"{values:,} parameters (buffers included)"
    )
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m engine.export",
        description="Export a checkpoint's weights to a plain .pt or .safetensors state dict.",
    )
    parser.add_argument("checkpoint", help="step-N.pt file, sharded step-N/ directory, or run dir")
    parser.add_argument("out", help="the file to write: *.pt or *.safetensors")
    parser.add_argument("--ema", action="store_true", help="export the EMA of the weights")
    parser.add_argument("--force", action="store_true", help="replace OUT if it exists")
    return parser.parse_args(argv)


def check_out(out: Path, force: bool) -> Path:
    if out.suffix not in SUFFIXES:
        raise ExportError(
            f"{out}: unknown format {out.suffix or '(no suffix)'}; use .pt or .safetensors"
        )
    if out.is_dir():
        raise ExportError(f"{out} is a directory; name the file to write")
    if out.exists() and not force:
        raise ExportError(f"{out} exists; pass --force (make export ... FORCE=1) to replace it")
    return out


def resolve(path: Path) -> Path:
    """The checkpoint to export: the path itself, or a run directory's newest valid one."""
    if not path.exists():
        raise ExportError(f"{path} does not exist")
    if path.is_file() or _is_sharded(path):
        return path
    folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    found = ckpt.latest_valid(folder)
    if found is None:
        raise ExportError(
            f"{path} is not a checkpoint (step-N.pt or step-N/) nor a run directory holding one"
        )
    print(f"newest valid checkpoint in {path}: {found[0].name}")
    return found[0]


def _is_sharded(path: Path) -> bool:
    return path.is_dir() and ((path / ".metadata").exists() or (path / "meta.pt").exists())


def read_weights(path: Path, ema: bool) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """({name: contiguous CPU tensor}, {recipe, step, source})."""
    if path.is_dir():
        state, weights = _read_sharded(path, ema)
    else:
        state = _read_file(path)
        weights = _ema_weights(state, path) if ema else state["model"]
    tensors = {
        name: value.detach().cpu().contiguous()
        for name, value in ckpt.strip_prefixes(weights).items()
        if isinstance(value, torch.Tensor) and name != "n_averaged"
    }
    if not tensors:
        raise ExportError(f"{path} holds no weights")
    info = {"recipe": recipe_of(state, path), "step": state.get("step", "?")}
    return tensors, info | {"source": f"{path.parent.parent.name}/{path.name}"}


def recipe_of(state: dict[str, Any], path: Path) -> str:
    """The recipe that trained the checkpoint: its config's `recipe`, else the run directory's
    place, <run.root>/<recipe>/<run name>/checkpoints/<checkpoint> (where the engine writes
    every checkpoint); "" when neither tells."""
    config = state.get("config")
    recipe = config.get("recipe") if isinstance(config, dict) else None
    if isinstance(recipe, str) and recipe:
        return recipe
    where = Path(os.path.abspath(path))  # `..` resolved, symbolic links kept
    inside_a_run = where.parent.name == "checkpoints" and len(where.parents) > 3
    return where.parents[2].name if inside_a_run else ""


def _read_file(path: Path) -> dict[str, Any]:
    try:
        state = ckpt.load(path)
    except ConfigError:
        raise
    except Exception as err:  # not a torch file, torn, or holding arbitrary objects
        raise ExportError(f"{path} is not a readable checkpoint ({_reason(err)})") from None
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise ExportError(f"{path} is not a checkpoint (no model state in it)")
    return state


def _read_sharded(path: Path, ema: bool) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    from engine.checkpoint import sharded  # start-up time: imports DCP

    try:
        meta = sharded.read_meta(path)
        if ema:
            return meta, _ema_weights(meta, path)
        return meta, sharded.model_tensors(path)
    except ExportError:
        raise
    except Exception as err:  # a directory that is not (or not wholly) a sharded checkpoint
        raise ExportError(f"{path} is not a complete sharded checkpoint ({_reason(err)})") from None


def _reason(err: Exception) -> str:
    first = " ".join(str(err).split()).split(". ")[0][:160]
    return f"{type(err).__name__}: {first}" if first else type(err).__name__


def _ema_weights(state: dict[str, Any], path: Path) -> dict[str, torch.Tensor]:
    """engine.ema's layout: state["ema"] = {"model": the averaged module's state dict, ...}."""
    average = state.get("ema")
    if not isinstance(average, dict) or not isinstance(average.get("model"), dict):
        raise ExportError(f"{path} holds no EMA of the weights (trained with ema.decay=0?)")
    return average["model"]


def write(tensors: dict[str, torch.Tensor], out: Path, info: dict[str, Any]) -> None:
    """Write under a temporary name in OUT's folder, then rename: complete or absent."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    os.close(fd)
    try:
        if out.suffix == ".safetensors":
            from safetensors.torch import save_file  # optional: only for .safetensors

            metadata = {key: str(value) for key, value in info.items()}
            save_file(_unshared(tensors), tmp, metadata=metadata)
        else:
            torch.save(tensors, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
