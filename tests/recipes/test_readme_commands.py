"""Commands the recipes' READMEs print for a user to paste: a "smoke run" is a few steps on a
small evaluation (not an epoch of ImageNet), its overrides are real config keys, and the output
quoted under it is of that command."""

from __future__ import annotations

import re
import shlex

from engine import catalog

MAX_SMOKE_STEPS = 20
MAX_SMOKE_EVAL = 512  # samples evaluated at the end


def readme(recipe: str) -> str:
    return (catalog.RECIPES_DIR / recipe / "README.md").read_text()


def smoke_command(text: str) -> tuple[str, str]:
    """The README's CPU command (`make train ... GPUS=0`, in a bash block) and the plain
    block quoting its output, the first one after it ("" when there is none)."""
    blocks = list(re.finditer(r"```([a-z]*)\n(.*?)```", text, flags=re.S))
    commands = [
        (line, block.end())
        for block in blocks
        if block.group(1) == "bash"
        for line in block.group(2).splitlines()
        if line.startswith("make train") and "GPUS=0" in line
    ]
    (line, end), *_ = commands
    quoted = [b.group(2) for b in blocks if b.group(1) == "" and b.start() >= end]
    return line, quoted[0] if quoted else ""


def make_request(line: str) -> tuple[str, dict[str, str], list[str]]:
    """`make TARGET VAR=value ...` as (target, variables, ARGS split into overrides)."""
    words = shlex.split(line, comments=True)
    assert words[0] == "make", line
    target = words[1]
    variables = dict(w.split("=", 1) for w in words[2:])
    return target, variables, shlex.split(variables.get("ARGS", ""))


def test_the_imagenet_smoke_run_is_a_few_steps_and_a_small_evaluation():
    line, output = smoke_command(readme("imagenet"))
    target, variables, overrides = make_request(line)
    assert (target, variables["RECIPE"], variables["GPUS"]) == ("train", "imagenet", "0")
    cfg, _ = catalog.load_config("imagenet", overrides)  # every key real, every value valid
    steps = [n for n in (cfg.train.max_steps, cfg.train.stop_at_step) if n]
    assert steps and min(steps) <= MAX_SMOKE_STEPS, "bound the steps: train.max_steps=N"
    assert cfg.data.synthetic, "a smoke run needs no data on disk"
    assert cfg.data.synthetic_val <= MAX_SMOKE_EVAL, "evaluate a few: data.synthetic_val=N"
    # The quoted output is that command's last line: the recipe, its step count, a run dir.
    (said,) = output.strip().splitlines() or [""]
    assert re.fullmatch(
        rf"imagenet: top1 .* in [0-9.]+s, {min(steps)} steps; run dir runs/imagenet/\S+", said
    ), said
