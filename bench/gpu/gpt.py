"""(f) gpt: recipes/gpt on this one GPU, outside the engine's loop: the recipe's model built on
the meta device, given storage on the GPU and filled per parameter name by the recipe's
init_weights (as engine/parallel/meta_init.py does, but drawn on the device), bf16 autocast,
AdamW (fused on CUDA; weight decay 0.1 on matrices only), gradient clipping at 1.0, random
byte tokens resident on the device.

speed: the `124m` variant at 16 x 1024 tokens per step: tokens/s, MFU
(recipes.gpt.model.flops_per_token x tokens/s over engine.speed's dense bf16 peak) and the
memory high-water mark, eager without and with activation checkpointing
(engine.parallel.activations on the blocks) and torch.compile'd (the whole model, as the
engine compiles a one-GPU or DDP run) without it.

micro_batch: the `124m` variant, eager, at twice and four times the speed parts' micro batch
(32 and 64 sequences): tokens/s and MFU against the batch, the 16 of speed.eager; running out
of memory is recorded as such.

memory: the `1b` variant at 4 x 2048 tokens per step, with and without activation
checkpointing: the high-water mark of training steps after the first (so AdamW's moments
exist) next to recipes/gpt/memory.py's estimate for the same micro batch on one GPU (its DDP
column); running out of memory is recorded as such.

The block keeps to its share of the budget (sizes.gpt_share_s, 50 s): a part that does not fit
what is left of it is skipped with the reason. Each part is filed under gpt.speed.<part>,
gpt.micro_batch.<part> or gpt.memory.<part> as soon as it ends."""

from __future__ import annotations

import dataclasses
import time
import zlib

import torch
import torch.nn.functional as F

from bench.gpu.harness import (
    Bench,
    attempt,
    device_peak,
    fmt,
    free_device_memory,
    get,
    mfu,
    peak_memory_gb,
    reset_peak,
    timed,
)
from engine import catalog
from engine.assemble import amp_dtype
from engine.parallel.activations import checkpoint_blocks
from engine.seeding import derive_seed
from recipes.gpt import memory as gpt_memory
from recipes.gpt.model import flops_per_token, parameter_count


def gpt(bench: Bench) -> dict:
    if "gpt" not in catalog.available():
        return {"status": "not present", "reason": "recipes/gpt does not exist in this checkout"}
    return attempt(bench, "gpt", "(f) gpt", lambda: gpt_measure(bench), need_s=bench.need(20))


def gpt_setup(variant: str, batch: int, seq: int | None):
    """The variant's model config and memory.py's Setup for `batch` sequences of `seq` tokens."""
    plan = gpt_memory.load(variant)
    return dataclasses.replace(plan, micro_batch=batch, seq_len=seq or plan.seq_len)


def gpt_estimate(plan) -> dict:
    """recipes/gpt/memory.py's estimate for this micro batch on one GPU (its DDP column), GiB."""
    rows = gpt_memory.estimate(plan, gpus=1)["ddp"]
    return {k: round(v / 2**30, 3) for k, v in rows.items()}


def gpt_model(recipe, cfg, device: torch.device):
    """Built on the meta device, given storage on `device`, each parameter filled by the
    recipe's init_weights from a generator seeded by its name (engine/parallel/meta_init.py's
    scheme, drawn on the device rather than the CPU: other values, the same distributions)."""
    with torch.device("meta"):
        model = recipe.build_model(dataclasses.replace(cfg))
    model.to_empty(device=device)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        generator = torch.Generator(device=device)
        generator.manual_seed(derive_seed(0, zlib.crc32(name.encode())))
        recipe.init_weights(cfg, name, tensor, generator)
    return model


class GptLoop:
    """The recipe's training step without the engine: next-byte cross entropy on random bytes
    under autocast to `amp` (bf16; None: float32, a CPU smoke run), backward, gradient
    clipping at 1.0, AdamW."""

    def __init__(
        self, model, forward, batch: int, seq: int, device: torch.device, amp=torch.bfloat16
    ):
        self.forward, self.device, self.amp = forward, device, amp
        self.params = list(model.parameters())
        matrices = [p for p in self.params if p.dim() >= 2]
        others = [p for p in self.params if p.dim() < 2]
        self.flags = {"fused": True} if device.type == "cuda" else {}
        self.optimizer = torch.optim.AdamW(
            [{"params": matrices, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}],
            lr=6e-4,
            betas=(0.9, 0.95),
            **self.flags,
        )
        gen = torch.Generator(device=device).manual_seed(0)
        pool = torch.randint(0, 256, (4, batch, seq + 1), generator=gen, device=device)
        # separate tensors: every step's input has the same strides and storage offset
        self.x = [chunk[:, :-1].contiguous() for chunk in pool]
        self.y = [chunk[:, 1:].contiguous() for chunk in pool]
        self.k = 0
        self.loss = None

    def steps(self, n: int) -> None:
        for _ in range(n):
            i = self.k % len(self.x)
            self.k += 1
            with torch.autocast(self.device.type, dtype=self.amp, enabled=self.amp is not None):
                logits = self.forward(self.x[i])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), self.y[i].flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.params, 1.0)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.loss = loss.detach()


def fill_segment(bench: Bench, loop: GptLoop) -> int:
    """Steps that fill gpt_segment_s (half of it when the budget is tight), within bounds."""
    step_s = timed(bench, lambda: loop.steps(2)) / 2
    lo, hi = bench.sizes.gpt_steps
    aim = bench.sizes.gpt_segment_s / (2 if bench.tight("gpt") else 1)
    return int(min(hi, max(lo, round(aim / max(step_s, 1e-6)))))


def timed_steps(bench: Bench, loop: GptLoop, plan, steps: int) -> dict:
    """tokens/s and MFU of `steps` steps, their memory high-water mark, and (on CUDA) what
    stays allocated between steps and the allocator's reserved high-water mark."""
    device, tokens = bench.device, plan.micro_batch * plan.seq_len
    bench.sync()
    resident = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    reset_peak(device)
    seconds = timed(bench, lambda: loop.steps(steps))
    tokens_per_s = steps * tokens / seconds
    peak, _ = device_peak(device)
    out = {
        "timed_steps": steps,
        "step_ms": round(1000 * seconds / steps, 2),
        "tokens_per_s": round(tokens_per_s, 1),
        "mfu": mfu(tokens_per_s, flops_per_token(plan.model, plan.seq_len), peak),
        "peak_step_gib": peak_memory_gb(device),
        "last_loss": round(float(loop.loss), 4),  # ~ln 256 = 5.55 on random bytes
    }
    if device.type == "cuda":
        out["resident_gib"] = round(resident / 2**30, 3)
        out["peak_step_reserved_gib"] = round(torch.cuda.max_memory_reserved(device) / 2**30, 3)
    return out


def gpt_train(
    bench: Bench,
    plan,
    checkpointing: bool,
    compiled: bool,
    steps: int | None = None,
    warmup: int | None = None,
) -> dict:
    """Train `plan`'s model on one device; time `steps` steps after the first and `warmup`
    more (steps None: as many as fill gpt_segment_s). Memory: the high-water mark of the
    timed steps, and what stays allocated between steps (weights, AdamW's moments)."""
    recipe = catalog.load("gpt")
    model = gpt_model(recipe, plan.model, bench.device)
    if checkpointing:
        checkpoint_blocks(recipe.blocks(model))
    forward = torch.compile(model) if compiled else model
    amp = amp_dtype(bench.sizes.amp, bench.device)  # the engine's reading of train.amp
    loop = GptLoop(model, forward, plan.micro_batch, plan.seq_len, bench.device, amp)
    try:
        out = {
            "activation_checkpointing": checkpointing,
            "compiled": compiled,
            "optimizer_flags": loop.flags,
        }
        out["first_step_s"] = round(timed(bench, lambda: loop.steps(1)), 3)
        loop.steps(bench.sizes.gpt_warmup_steps if warmup is None else warmup)
        if steps is None:
            steps = fill_segment(bench, loop)
            out["budget_tight"] = bench.tight("gpt")
        return out | timed_steps(bench, loop, plan, steps)
    finally:
        forward = loop = model = None  # free the device memory before the next part
        if compiled:
            torch._dynamo.reset()  # its graphs hold the model's tensors


def out_of_memory_entry(bench: Bench, err: Exception, **fields) -> dict:
    """An out-of-memory error as a result: the message, the device memory freed."""
    message = " ".join(str(err).split())[:600]
    free_device_memory(bench.device)
    return {"status": "out of memory", "error": message, **fields}


def micro_batch_part(bench: Bench, plan) -> dict:
    """gpt_train, eager, at this micro batch; out of memory is a result, not an error."""
    try:
        out = gpt_train(bench, plan, False, False)
    except torch.cuda.OutOfMemoryError as err:
        return out_of_memory_entry(bench, err, micro_batch=plan.micro_batch)
    return {
        "micro_batch": plan.micro_batch,
        "tokens_per_step": plan.micro_batch * plan.seq_len,
    } | out


def run_micro_batches(bench: Bench, share: BlockShare, micro: dict, speed_plan) -> None:
    """The speed parts' model, eager, at 2x and 4x their micro batch."""
    for factor in (2, 4):
        plan = dataclasses.replace(speed_plan, micro_batch=factor * speed_plan.micro_batch)
        micro[f"x{factor}"] = share.part(
            f"gpt.micro_batch.x{factor}",
            f"(f) gpt speed, eager, micro batch {plan.micro_batch}",
            lambda p=plan: micro_batch_part(bench, p),
            6 + 2 * factor,
        )


def gpt_memory_part(bench: Bench, plan, checkpointing: bool, estimate: dict) -> dict:
    """gpt_train at a fixed step count, its high-water mark against the estimate; running out
    of memory is a result here, not an error."""
    key = "total_ckpt" if checkpointing else "total"
    try:
        out = gpt_train(
            bench, plan, checkpointing, False, steps=bench.sizes.gpt_memory_steps, warmup=0
        )
    except torch.cuda.OutOfMemoryError as err:
        return out_of_memory_entry(
            bench, err, activation_checkpointing=checkpointing, estimate_gib=estimate[key]
        )
    out["estimate_gib"] = estimate[key]
    if out.get("peak_step_gib") is not None:
        out["measured_over_estimate"] = round(out["peak_step_gib"] / estimate[key], 3)
    return out


class BlockShare:
    """The gpt block's share of the budget, counted from its start: a part starts only while
    what is left of the share has room for it."""

    def __init__(self, bench: Bench, share_s: float):
        self.bench, self.share_s, self.started = bench, share_s, time.perf_counter()

    def part(self, key: str, label: str, fn, need_s: float) -> dict:
        """attempt(), or a skipped entry saying how much of the share is left."""
        need_s = self.bench.need(need_s)
        left = self.share_s - (time.perf_counter() - self.started)
        if left < need_s and self.bench.selected(key):
            reason = (
                f"needs ~{need_s:.0f} s, {max(left, 0):.0f} s left of the gpt "
                f"block's {self.share_s:.0f} s"
            )
            return self.bench.file(key, {"status": "skipped", "reason": reason})
        return attempt(self.bench, key, label, fn, need_s=need_s)


def plan_entry(variant: str, plan) -> dict:
    """What a part trains: the variant's model, its tokens per step and memory.py's estimate."""
    m = plan.model
    return {
        "variant": variant,
        "parameters": parameter_count(m),
        "n_layer": m.n_layer,
        "d_model": m.d_model,
        "n_head": m.n_head,
        "micro_batch": plan.micro_batch,
        "seq_len": plan.seq_len,
        "tokens_per_step": plan.micro_batch * plan.seq_len,
        "flops_per_token": flops_per_token(m, plan.seq_len),
        "estimate_gib": gpt_estimate(plan),
    }


def gpt_notes(peak_source: str) -> dict:
    return {
        "data": "random bytes (0-255) resident on the device, 4 batches in turn",
        "step": "bf16 autocast forward (float32 in a CPU smoke run), fp32 cross entropy, "
        "backward, clip_grad_norm 1.0, AdamW (fused on CUDA), zero_grad(set_to_none=True); "
        "one device, no engine loop",
        "peak": peak_source,
        "flops_note": "recipes.gpt.model.flops_per_token: 6 x non-embedding parameters + "
        "12 x n_layer x d_model x T (attention), per trained token",
        "memory_note": "peak_step_gib: torch.cuda.max_memory_allocated over the timed steps "
        "(after the first, so AdamW's moments exist); resident_gib: allocated between steps; "
        "the estimate leaves out the logits, the CUDA context and allocator fragmentation",
    }


def run_parts(bench: Bench, share: BlockShare, out: dict, speed_plan, memory_plan):
    """The parts in the README's order, compilation last: it is the longest and least
    predictable, and the share skips what no longer fits."""
    speed, memory = out["speed"], out["memory"]
    speed["eager"] = share.part(
        "gpt.speed.eager",
        "(f) gpt speed, eager",
        lambda: gpt_train(bench, speed_plan, False, False),
        12,
    )
    speed["eager_checkpointing"] = share.part(
        "gpt.speed.eager_checkpointing",
        "(f) gpt speed, eager, activation checkpointing",
        lambda: gpt_train(bench, speed_plan, True, False),
        10,
    )
    run_micro_batches(bench, share, out["micro_batch"], speed_plan)
    estimate = memory["estimate_gib"]
    memory["checkpointing"] = share.part(
        "gpt.memory.checkpointing",
        "(f) gpt memory, activation checkpointing",
        lambda: gpt_memory_part(bench, memory_plan, True, estimate),
        12,
    )
    memory["no_checkpointing"] = share.part(
        "gpt.memory.no_checkpointing",
        "(f) gpt memory, no activation checkpointing",
        lambda: gpt_memory_part(bench, memory_plan, False, estimate),
        10,
    )
    speed["compiled"] = share.part(
        "gpt.speed.compiled",
        "(f) gpt speed, torch.compile",
        lambda: gpt_train(bench, speed_plan, False, True),
        30,
    )


def gpt_measure(bench: Bench) -> dict:
    s = bench.sizes
    share = BlockShare(bench, s.gpt_share_s)
    _, peak_source = device_peak(bench.device)
    speed_plan = gpt_setup(s.gpt_speed_variant, s.gpt_speed_batch, s.gpt_seq)
    memory_plan = gpt_setup(s.gpt_memory_variant, s.gpt_memory_batch, s.gpt_seq)
    out = bench.entry("gpt")  # in the JSON from the start, the parts with it
    out |= gpt_notes(peak_source)
    speed = out["speed"] = plan_entry(s.gpt_speed_variant, speed_plan)
    memory = out["memory"] = plan_entry(s.gpt_memory_variant, memory_plan)
    out["micro_batch"] = {"variant": s.gpt_speed_variant, "compiled": False}
    run_parts(bench, share, out, speed_plan, memory_plan)
    ran = [k for k in ("compiled", "eager") if speed[k].get("status") == "ok"]
    if ran:
        best = speed[ran[0]]
        out["headline"] = {
            "mode": ran[0],
            "tokens_per_s": best["tokens_per_s"],
            "mfu": best["mfu"],
            "peak_step_gib": best["peak_step_gib"],
        }
    parts = [speed[k] for k in ("eager", "eager_checkpointing", "compiled")]
    parts += [out["micro_batch"][k] for k in ("x2", "x4")]
    parts += [memory[k] for k in ("checkpointing", "no_checkpointing")]
    if all(p.get("status") == "error" for p in parts):
        return out | {"status": "error", "error": "every gpt part failed (see each)"}
    return out


def summary(entry: dict) -> list[str]:
    """tokens/s, MFU and peak memory of each speed part; peak against the estimate of each
    memory part; or why a part has none."""
    lines = []
    for key in ("eager", "eager_checkpointing", "compiled"):
        e = get(entry, "speed", key)
        if isinstance(e, dict) and e.get("status") == "ok":
            lines.append(
                f"  (f) gpt {entry['speed']['variant']} {key:19s} {e['tokens_per_s']:10.0f} tok/s, "
                f"MFU {fmt(e['mfu'], '.3f')}, peak {fmt(e['peak_step_gib'], '.2f')} GiB"
            )
        elif isinstance(e, dict):
            lines.append(f"  (f) gpt {key}: {e.get('status')} {e.get('reason', '')}")
    lines += micro_batch_summary(entry)
    for key in ("checkpointing", "no_checkpointing"):
        e = get(entry, "memory", key)
        if isinstance(e, dict) and "estimate_gib" in e:
            lines.append(
                f"  (f) gpt {entry['memory']['variant']} {key:17s} peak "
                f"{fmt(e.get('peak_step_gib'), '.2f')} GiB ({e['status']}), estimate "
                f"{e['estimate_gib']:.2f} GiB (recipes/gpt/memory.py, 1 GPU)"
            )
        elif isinstance(e, dict):
            lines.append(f"  (f) gpt memory {key}: {e.get('status')} {e.get('reason', '')}")
    return lines


def micro_batch_summary(entry: dict) -> list[str]:
    """MFU, eager, at the speed parts' micro batch and at 2x and 4x it."""
    parts = [get(entry, "speed", "eager"), get(entry, "micro_batch", "x2")]
    parts.append(get(entry, "micro_batch", "x4"))
    batch = get(entry, "speed", "micro_batch")
    if not all(isinstance(p, dict) for p in parts) or batch is None:
        return []
    figures = []
    for factor, e in zip((1, 2, 4), parts, strict=True):
        value = fmt(e.get("mfu"), ".3f") if e.get("status") == "ok" else e.get("status")
        figures.append(f"{factor * batch}: {value}")
    return [
        f"  (f) gpt {entry['speed']['variant']} eager MFU by micro batch: " + ", ".join(figures)
    ]
