"""The model and what wraps, averages and records it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

from engine.config import ConfigError
from engine.ema import ema_state, load_ema_state
from engine.parallel import Strategy
from engine.parts import Part, saved, transient


@dataclass
class Network(Part):
    # The bare model's tensors are the checkpoint format's (whole in one file, or each
    # rank's shards through DCP), loaded before wrapping from a file: not this part's.
    model: nn.Module = transient()  # wrapped for training (DDP/DP/compiled), sharded or bare
    bare: nn.Module = transient()  # the recipe's module (under FSDP: sharded parameters)
    eval_model: nn.Module = transient()  # the bare model, compiled when training is
    strategy: Strategy = transient()  # how it is wrapped and where its parameters live
    layout: torch.memory_format = transient(default=torch.contiguous_format)  # 4-d inputs
    trainable: list[nn.Parameter] = transient(default_factory=list)  # listed once
    # the trainable tensors are plain (not shards), of one device and dtype: the step's
    # gradient norm takes engine.optim.grad_norm_'s short path
    plain: bool = transient(default=False)
    ema: AveragedModel | None = saved(default=None)  # bare weights and n_averaged
    init_record: dict | None = saved(key="init", default=None)  # the first weights' file

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        if self.ema is not None:  # bare, loadable as a model of its own (engine.ema)
            out["ema"] = ema_state(self.ema)
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.ema is not None and "ema" not in state:
            raise ConfigError(
                "holds no EMA of the weights, but ema.decay is set; resume with the config "
                "that wrote it (ema.decay=0) or start a new run"
            )
        self.init_record = state.get("init", self.init_record)
        if self.ema is not None:
            load_ema_state(self.ema, state["ema"])
