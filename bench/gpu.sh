#!/usr/bin/env bash
# The one-shot GPU benchmark (bench/gpu/, run as python -m bench.gpu; the docstring of each
# measurement's module there says what its figures mean), then the tests marked gpu:
#   bash bench/gpu.sh [--smoke] [--only NAMES] [--budget S] [--batch N] [--out PATH]
# --only takes measurements or parts (resnet50_synthetic.eager, gpt.speed.compiled, ...); an
# unknown name is refused with the list of valid ones.
# Environment: GPU_BENCH_PYTHON (the interpreter, default python3), GPU_BENCH_BUDGET_S
# (seconds, default 340), OUT (write $OUT/gpu.json), GPU_BENCH_SMOKE=1 (same as --smoke),
# GPU_BENCH_TESTS=0 (no test run), GPU_BENCH_PLANT_STALL=<part> (that part stalls: the
# watchdog's test).
# After the benchmark, wherever pytest imports and torch sees a CUDA device (with or without
# --smoke or GPU_BENCH_SMOKE), every test marked gpu under tests/ runs (pytest -m gpu, at most
# 150 s) on the files that use the marker and tests/gpu/, not the whole suite: a module that
# needs what this machine lacks (hypothesis, W&B) stops no GPU test. Its output goes to
# <json path without .json>-tests.txt. On a machine without CUDA no test runs.
# A full run takes about 7 minutes: the benchmark at most its budget plus 15 s, the tests
# about 1.5. Prints the path of the JSON file that holds every figure.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${GPU_BENCH_PYTHON:-python3}"

out=""
previous=""
for arg in "$@"; do
    case "$arg" in
        --out=*) out="${arg#--out=}" ;;
    esac
    if [ "$previous" = "--out" ]; then
        out="$arg"
    fi
    previous="$arg"
done
extra=()
if [ -z "$out" ]; then
    if [ -n "${OUT:-}" ]; then
        out="$OUT/gpu.json"
    else
        out="$repo/runs/bench/gpu-$(date +%Y%m%d-%H%M%S).json"
    fi
    extra=(--out "$out")
fi

# bench.gpu reads GPU_BENCH_BUDGET_S, GPU_BENCH_SMOKE and OUT itself; relative paths are
# taken from the caller's directory (the repository is found through PYTHONPATH).
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
status=0
"$python" -m bench.gpu ${extra[@]+"${extra[@]}"} "$@" || status=$?
# The tests that need a CUDA device (marker gpu; deselected elsewhere), when pytest is there.
if [ "${GPU_BENCH_TESTS:-1}" != "0" ] \
    && "$python" -c "import pytest, torch; assert torch.cuda.is_available()" 2>/dev/null; then
    tests="${out%.json}-tests.txt"
    mkdir -p "$(dirname "$tests")"
    mapfile -t files < <(cd "$repo" && {
        if [ -d tests/gpu ]; then echo tests/gpu; fi
        grep -rlE --include='*.py' 'mark\.gpu\b' tests | grep -v '^tests/gpu/' || true
    } | sort)
    if [ "${#files[@]}" -eq 0 ]; then
        echo "gpu.sh: GPU tests: none marked gpu under tests/"
    else
        (cd "$repo" && timeout 150 "$python" -m pytest -q -p no:cacheprovider -m gpu \
            "${files[@]}") >"$tests" 2>&1 || status=1
        echo "gpu.sh: GPU tests: $(tail -n 1 "$tests") (output in $tests)"
    fi
fi
if [ -f "$out" ]; then
    echo "gpu.sh: results in $out"
else
    echo "gpu.sh: no results file was written (exit $status)" >&2
fi
exit "$status"
