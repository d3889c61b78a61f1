"""recipes/gpt: the model is causal, initialises the same on the meta device as on the CPU,
has the sizes its variants claim and the FLOPs it declares; the data are non-overlapping
shifted blocks; the README's memory table is the script's output."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from engine.config import ConfigError
from recipes.gpt import memory
from recipes.gpt.data import ByteBlocks, DataConfig, build_datasets, split
from recipes.gpt.model import (
    ModelConfig,
    build_model,
    flops_per_token,
    init_weights,
    parameter_count,
)

REPO = Path(__file__).resolve().parents[2]
TINY = ModelConfig(context=16, n_layer=2, n_head=2, d_model=32)


def generator(name: str) -> torch.Generator:
    return torch.Generator().manual_seed(sum(name.encode()) * 1009 + len(name))


def initialised(model, cfg):
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            init_weights(cfg, name, tensor, generator(name))
    return model


def test_position_t_sees_only_tokens_up_to_t():
    torch.manual_seed(0)
    model = initialised(build_model(TINY), TINY).eval()
    x = torch.randint(0, 256, (2, 16))
    for t in (0, 7, 14):
        changed = x.clone()
        changed[:, t + 1] = (changed[:, t + 1] + 1) % 256
        before, after = model(x), model(changed)
        assert torch.equal(before[:, : t + 1], after[:, : t + 1])
        assert not torch.equal(before[:, t + 1], after[:, t + 1])


def test_model_holds_no_buffers_and_refuses_long_sequences():
    model = build_model(TINY)
    assert list(model.buffers()) == []
    with pytest.raises(ConfigError, match="data.block_size.*model.context") as err:
        model(torch.zeros(1, 17, dtype=torch.long))
    assert "\n" not in str(err.value)


def test_meta_build_then_init_equals_cpu_build_then_init():
    cfg = ModelConfig(context=16, n_layer=2, n_head=2, d_model=32, bias=True)
    with torch.device("meta"):
        meta = build_model(cfg)
    meta.to_empty(device="cpu")
    cpu = build_model(cfg)
    a, b = initialised(meta, cfg).state_dict(), initialised(cpu, cfg).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    std = b["blocks.0.attn.proj.weight"].std().item()
    assert std == pytest.approx(0.02 / 2, rel=0.1)  # residual projection: 0.02 / sqrt(2 * 2)
    assert torch.equal(b["blocks.1.ln_2.weight"], torch.ones(32)) and not b["head.bias"].any()


def test_init_weights_refuses_an_unknown_name():
    with pytest.raises(KeyError, match="blocks.0.attn.rotary"):
        init_weights(TINY, "blocks.0.attn.rotary", torch.empty(4), torch.Generator())


def variant_params(variant: str) -> int:
    return memory.unit_sizes(memory.load(variant).model)[0]


@pytest.mark.parametrize(
    "variant, low, high",
    [("config", 1e5, 1e6), ("124m", 0.95 * 124e6, 1.05 * 124e6), ("1b", 0.9e9, 1.1e9)],
)
def test_variant_sizes(variant, low, high):
    params = variant_params(variant)
    assert low <= params <= high
    assert params == parameter_count(memory.load(variant).model)


def test_declared_flops_match_the_counted_forward_times_three():
    setup = memory.load("config")
    cfg, t = setup.model, setup.seq_len
    with torch.device("meta"):
        model = build_model(cfg)
    with FlopCounterMode(display=False) as counter:
        model(torch.zeros(2, t, dtype=torch.long, device="meta"))
    counted = 3 * counter.get_total_flops() / (2 * t)
    assert flops_per_token(cfg, t) == pytest.approx(counted, rel=0.1)


@settings(max_examples=40, deadline=None)
@given(st.binary(min_size=2, max_size=300), st.integers(1, 40))
def test_blocks_are_disjoint_shifted_and_cover_the_text_once(raw, block):
    data = torch.tensor(list(raw), dtype=torch.uint8)
    blocks = ByteBlocks(data, block)
    assert len(blocks) == (len(raw) - 1) // block
    xs = [blocks[i][0] for i in range(len(blocks))]
    ys = [blocks[i][1] for i in range(len(blocks))]
    n = len(blocks) * block
    if blocks:
        assert all(x.dtype == torch.int64 and x.shape == (block,) for x in xs)
        assert torch.equal(torch.cat(xs), data[:n].long())  # each byte is an input once
        assert torch.equal(torch.cat(ys), data[1 : n + 1].long())  # y is x moved on by one
    assert len(raw) - 1 - n < block  # what is left out is shorter than one block
    with pytest.raises(IndexError):
        blocks[len(blocks)]


def test_split_puts_the_end_of_the_text_aside():
    data = torch.arange(100, dtype=torch.uint8)
    train, held_out = split(data, 0.1)
    assert torch.equal(torch.cat([train, held_out]), data) and len(held_out) == 10


def test_default_corpus_loads_offline():
    train, held_out = build_datasets(DataConfig())
    x, y = train[0]
    assert (len(train) + len(held_out)) * 64 > 100_000
    assert x.shape == y.shape == (64,) and x.dtype == torch.int64


def test_unreadable_or_short_text_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="data.path") as err:
        build_datasets(DataConfig(path=str(tmp_path / "missing.txt")))
    assert "\n" not in str(err.value)
    short = tmp_path / "short.txt"
    short.write_bytes(b"x" * 100)
    with pytest.raises(ConfigError, match="evaluation text has 10 bytes") as err:
        build_datasets(DataConfig(path=str(short), block_size=16))
    assert "\n" not in str(err.value)


def test_readme_memory_table_is_the_scripts_output():
    out = subprocess.run(
        [sys.executable, "-m", "recipes.gpt.memory"], cwd=REPO, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    readme = (REPO / "recipes" / "gpt" / "README.md").read_text()
    assert out.stdout.strip() in readme


def test_tensor_parallel_divides_activations_and_gathered_weights_by_tp():
    est = memory.estimate(memory.load("1b"))
    for key in ("acts", "acts_ckpt", "bf16"):
        assert est["tp"][key] == pytest.approx(est["fsdp"][key] / memory.TP), key
    assert est["tp"]["weights"] == est["fsdp"]["weights"]  # sharded over every GPU either way


def test_fsdp_needs_less_memory_per_gpu_than_ddp():
    est = memory.estimate(memory.load("1b"))
    assert est["fsdp"]["total"] < est["ddp"]["total"]
    assert est["fsdp"]["total_ckpt"] < est["ddp"]["total_ckpt"] < est["ddp"]["total"]
