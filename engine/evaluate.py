"""Evaluation: each held-out sample exactly once over the ranks, the task's metrics exact for
any world size, optionally over the recipe's mirror view too (eval.hflip_tta)."""

from __future__ import annotations

import json

import torch
from torch import nn

from engine import distributed as D
from engine import hang
from engine.data.loaders import eval_loader
from engine.data.prefetch import finish_ahead
from engine.run import Run
from engine.tracking import ProgressBar


def run_eval(run: Run, bar: ProgressBar) -> dict:
    """Evaluate the model (and its EMA), record the result and say it in one line."""
    hang.beat("evaluation", run.progress.step)
    result = evaluate(run, run.net.eval_model)
    if run.net.ema is not None:
        averaged = evaluate(run, run.net.ema.module)
        result |= {f"ema_{k}": averaged[k] for k in metric_names(averaged)}
    record = {"kind": "eval", "step": run.progress.step, "epoch": run.progress.epoch} | result
    run.records.tracker.write(record)
    epoch = run.progress.epoch_number()  # from 1, as the step lines count
    text = f"eval epoch {epoch} step {record['step']}: {run.task.describe(result)}"
    if run.net.ema is not None:
        headline = run.task.headline
        text += f", EMA {headline} {result['ema_' + headline]:.4f}"
    bar.message(text)
    return record


def metric_names(result: dict) -> list[str]:
    """The metrics of an evaluation result (not its sample counts)."""
    return [k for k in result if k not in ("count", "skipped")]


def predict(run: Run, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Logits; a compiled model sees every batch at the full eval batch size (the last one
    padded), so a shard's shorter last batch costs no recompilation."""
    size = run.cfg.eval.batch_size
    if model is run.net.eval_model is not run.net.bare and len(x) < size:
        padding = x.new_zeros((size - len(x), *x.shape[1:]))
        x = torch.cat([x, padding]).contiguous(memory_format=run.net.layout)
    with run.autocast():
        logits = model(x)
        if run.cfg.eval.hflip_tta:  # the mirror view is as likely; average both
            logits = (logits + model(run.recipe.mirror(x))) / 2
    return logits.float()


@torch.no_grad()
def evaluate(run: Run, model: nn.Module) -> dict:
    """Each held-out sample exactly once across ranks; the task's per-sample sums reduced
    over ranks, then divided by the summed count. A file that could not be read
    (data.skip_bad) is left out of the sums and counted as skipped."""
    was_training = model.training
    model.eval()
    D.broadcast_buffers(model)  # what the checkpoint (rank 0's) holds
    loader = eval_loader(
        run.feed.eval_data,
        run.cfg.eval.batch_size,
        run.denv.dp_rank,
        run.denv.dp_size,
        run.cfg.loader,
        run.device,
        run.health.skip_bad,
    )
    ahead = run.cfg.loader.decode_ahead
    loader = finish_ahead(loader, run.feed.eval_data, run.device, ahead, run.net.layout)
    names = [*run.task.metrics, "count"]
    totals, seen = sum_batches(run, model, loader, names)
    D.all_reduce_sum(totals)
    if run.cfg.log.sample_ids:
        write_ids(run, {"kind": "eval", "step": run.progress.step, "ids_by_rank": seen})
    *sums, count, samples, skipped = totals.tolist()
    if int(samples + skipped) != len(run.feed.eval_data):
        raise RuntimeError(f"evaluated {int(samples)} samples, expected {len(run.feed.eval_data)}")
    model.train(was_training)
    result = {
        name: value / max(count, 1) for name, value in zip(run.task.metrics, sums, strict=True)
    }
    result |= run.task.derived(result)
    result["count"] = int(count)
    return result | ({"skipped": int(skipped)} if run.health.skip_bad else {})


def sum_batches(run: Run, model: nn.Module, loader, names: list[str]):
    """This rank's sums of `names`, then its kept and skipped sample counts (float64, on the
    device), and the ids it evaluated (log.sample_ids)."""
    device = run.device
    totals = torch.zeros(len(names) + 2, dtype=torch.float64, device=device)  # + kept, skipped
    seen, x = [], None
    # FSDP gathers weights from all ranks in every forward pass: all make as many passes
    # as the rank with the most batches (agreed before the first pass; the extra ones are
    # thrown away).
    passes = D.max_over_ranks(len(loader), device) if run.net.strategy.shards else len(loader)
    for batch in loader:
        hang.touch()  # progress for the hang watchdog: no system call
        if run.cfg.log.sample_ids:
            seen += batch.index.tolist()
        x, y = run.to_device(batch.x, batch.y, run.feed.eval_data)
        keep = (batch.replaced == 0).to(device, non_blocking=True)
        sums = run.task.eval_sums(predict(run, model, x)[: len(y)], y)
        kept = [sums[name].double()[keep].sum() for name in names]
        totals += torch.stack([*kept, keep.sum().double(), (~keep).sum().double()])
    for _ in range(passes - len(loader)):
        if x is None:  # this rank had no batch at all: any valid input will do
            x, _ = run.to_device(*first_sample(run), run.feed.eval_data)
        predict(run, model, x)
    return totals, seen


def first_sample(run: Run):
    x, y = run.feed.eval_data[0]
    return x.unsqueeze(0), torch.as_tensor(y).unsqueeze(0)


def write_ids(run: Run, record: dict) -> None:
    """log.sample_ids: which samples each rank evaluated, to eval_samples.jsonl (tests)."""
    record["ids_by_rank"] = D.gather_objects(record["ids_by_rank"], data=True)
    if run.denv.is_main:
        with (run.run_dir / "eval_samples.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")
