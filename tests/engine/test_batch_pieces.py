"""MixUp/CutMix draws, progressive resizing, EMA and parameter groups: the pieces the image
recipes switch on, each checked on its own."""

import torch
from torch import nn

from engine.config import EmaConfig, MixConfig, OptimConfig
from engine.data.mix import BatchMix
from engine.ema import build_ema, update_ema
from engine.optim import build_optimizer
from engine.vision.images import ImageAugment, TrainTransform, ramp_size


def test_mix_is_a_function_of_seed_epoch_and_position_and_leaves_the_rng_alone():
    mix = BatchMix(MixConfig(mixup_alpha=0.2, cutmix_alpha=1.0), num_classes=4, seed=1)
    x, y = torch.rand(6, 3, 8, 8), torch.tensor([0, 1, 2, 3, 0, 1])
    torch.manual_seed(0)
    expected_next = torch.rand(2)
    torch.manual_seed(0)
    a = mix(x, y, epoch=2, position=48)
    assert torch.equal(torch.rand(2), expected_next)
    b = mix(x, y, epoch=2, position=48)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    others = [mix(x, y, 2, 54), mix(x, y, 3, 48)]
    assert all(not torch.equal(o[1], a[1]) for o in others)
    assert a[1].shape == (6, 4) and torch.allclose(a[1].sum(1), torch.ones(6))


def test_progressive_resizing_follows_the_epoch_in_multiples_of_32():
    cfg = ImageAugment(train_size=192, ramp_from_size=160, ramp_start_epoch=11, ramp_end_epoch=13)
    assert [ramp_size(cfg, e) for e in (0, 11, 12, 13, 15)] == [160, 160, 192, 192, 192]
    transform = TrainTransform(cfg)
    image = torch.randint(0, 255, (3, 300, 280), dtype=torch.uint8)
    assert transform(image).shape == (3, 160, 160)
    transform.set_epoch(14)
    assert transform(image).shape == (3, 192, 192) and transform(image).dtype == torch.uint8


def test_ema_copies_during_warmup_then_averages():
    model = nn.Linear(2, 1)
    ema = build_ema(model, EmaConfig(decay=0.5, every_steps=2, warmup_steps=2))
    with torch.no_grad():
        model.weight.fill_(4.0)
    update_ema(ema, model, step=1, cfg=EmaConfig(decay=0.5, every_steps=2, warmup_steps=2))
    assert not torch.equal(ema.module.weight, model.weight)  # not an update step
    update_ema(ema, model, step=2, cfg=EmaConfig(decay=0.5, every_steps=2, warmup_steps=2))
    assert torch.equal(ema.module.weight, model.weight)  # warmup: a copy
    with torch.no_grad():
        model.weight.fill_(0.0)
    update_ema(ema, model, step=4, cfg=EmaConfig(decay=0.5, every_steps=2, warmup_steps=2))
    assert torch.allclose(ema.module.weight, torch.full_like(model.weight, 2.0))


def test_param_groups_lr_scaling_rule_norm_decay_and_lr_scale():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    model[1].bias.lr_scale = 64.0
    cfg = OptimConfig(lr=0.1, lr_reference_batch=256, weight_decay=1e-4)
    groups = build_optimizer(model, cfg, 1024, torch.device("cpu")).param_groups
    by_size = {sum(p.numel() for p in g["params"]): g for g in groups}
    assert by_size[108]["lr"] == 0.4 and by_size[108]["weight_decay"] == 1e-4  # conv weight
    assert by_size[8]["weight_decay"] == 0.0  # conv bias + BN weight: no decay by default
    assert by_size[4]["lr"] == 0.4 * 64  # the BN bias
    cfg.decay_norm_bias = True
    groups = build_optimizer(model, cfg, 256, torch.device("cpu")).param_groups
    assert {g["weight_decay"] for g in groups} == {1e-4, 1e-4 / 64}
