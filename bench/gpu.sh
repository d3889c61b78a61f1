#!/usr/bin/env bash
# The one-shot GPU benchmark (bench/gpu/, run as python -m bench.gpu; the docstring of each
# measurement's module there says what its figures mean):
#   bash bench/gpu.sh [--smoke] [--only NAMES] [--budget S] [--batch N] [--out PATH]
# Environment: GPU_BENCH_PYTHON (the interpreter, default python3), GPU_BENCH_BUDGET_S
# (seconds, default 440), OUT (write $OUT/gpu.json), GPU_BENCH_SMOKE=1 (same as --smoke).
# Prints the path of the JSON file that holds every figure.
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
if [ -z "${GPU_BENCH_SMOKE:-}" ] && "$python" -c "import pytest, torch; assert torch.cuda.is_available()" 2>/dev/null; then
    (cd "$repo" && timeout 120 "$python" -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_gpu_decode.py) \
        >"${out%.json}-tests.txt" 2>&1 || status=1
    echo "gpu.sh: GPU tests: $(tail -n 1 "${out%.json}-tests.txt")"
fi
if [ -f "$out" ]; then
    echo "gpu.sh: results in $out"
else
    echo "gpu.sh: no results file was written (exit $status)" >&2
fi
exit "$status"
