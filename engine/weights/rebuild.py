"""A run's model back in plain PyTorch, in one call:

    import torch
    from engine.weights import load_model
    model = load_model("runs/digits/NAME", "digits.pt")  # or a checkpoint, or the run alone
    with torch.no_grad():
        print(model(torch.zeros(1, 1, 8, 8)).argmax(1))

The run's config.yaml says which recipe built the model and with which settings; its model
section also holds the engine's weight keys (model.init_from, ...), which the recipe's own
ModelConfig does not take, so `ModelConfig(**cfg["model"])` fails: the config is resolved
here as the engine resolves it. The weights are read as model.init_from reads them (an
export, a checkpoint file or sharded folder, a run folder's newest) and must match every
tensor by name and shape. No data is read, no process group started, nothing downloaded."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from engine import catalog
from engine.config import ConfigError
from engine.weights import files


def load_model(run: str | Path, weights: str | Path | None = None, ema: bool = False) -> nn.Module:
    """The recipe's model as `run` (a run folder or its config.yaml) configured it, holding
    `weights` (default: the run's newest checkpoint; ema: their average), on the CPU, in
    evaluation mode."""
    config = run_config(Path(run))
    name = catalog.file_recipe(str(config))
    if not name:
        raise ConfigError(f"{config} names no recipe: give a run's config.yaml")
    cfg, recipe = catalog.load_config(name, ["run.name="], str(config))
    model = recipe.build_model(cfg.model)
    source = Path(weights) if weights is not None else config.parent
    tensors, _ = files.read(source, ema)
    try:
        mismatch = model.load_state_dict(tensors, strict=False)
    except RuntimeError as err:  # a shape differs
        raise ConfigError(
            f"{source} does not fit {name}'s model as {config} builds it: "
            f"{str(err).strip().splitlines()[-1].strip()}"
        ) from None
    wrong = [*mismatch.missing_keys, *mismatch.unexpected_keys]
    if wrong:
        raise ConfigError(
            f"{source} does not hold {name}'s model as {config} builds it: "
            f"{len(mismatch.missing_keys)} tensor(s) missing, "
            f"{len(mismatch.unexpected_keys)} unexpected (first: {wrong[0]})"
        )
    return model.eval()


def run_config(path: Path) -> Path:
    config = path / "config.yaml" if path.is_dir() else path
    if not config.is_file():
        raise ConfigError(f"{config} not found: give a run folder or its config.yaml")
    return config
