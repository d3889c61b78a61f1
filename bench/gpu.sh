#!/usr/bin/env bash
# The one-shot GPU benchmark (bench/gpu/, run as python -m bench.gpu; the docstring of each
# measurement's module there says what its figures mean), then the tests marked gpu:
#   bash bench/gpu.sh [--smoke] [--only NAMES] [--budget S] [--batch N] [--out PATH]
# --only takes measurements or parts (resnet50_synthetic.eager, gpt.speed.compiled, ...); an
# unknown name is refused with the list of valid ones.
# Environment: GPU_BENCH_PYTHON (the interpreter, default python3), GPU_BENCH_BUDGET_S
# (seconds, default 330), OUT (write $OUT/gpu.json), GPU_BENCH_SMOKE=1 (same as --smoke),
# GPU_BENCH_TESTS=0 (no test run), GPU_BENCH_PLANT_STALL=<part> (that part stalls: the
# watchdog's test), GPU_BENCH_WHEELS (the folder of wheels to install, default .gpu-wheels).
# Packages the GPU machine lacks and cannot download (no network): `make gpu-wheels` puts
# torchcodec's wheel (the engine decodes images through it) and airbench's sdist in
# .gpu-wheels/; this script installs each wheel there with pip --no-deps (without pip: unzips
# it) into a temporary folder, unpacks each sdist (pure Python) beside it, and puts both on
# PYTHONPATH. A needed package that still does not import is named in one line; the parts
# that need it are skipped with the reason.
# After the benchmark, wherever pytest imports and torch sees a CUDA device (with or without
# --smoke or GPU_BENCH_SMOKE), every test marked gpu under tests/ runs (pytest -m gpu, at most
# 135 s) on the files that use the marker and tests/gpu/, not the whole suite: a module that
# needs what this machine lacks (hypothesis, W&B) stops no GPU test. Its output goes to
# <json path without .json>-tests.txt. On a machine without CUDA no test runs.
# A full run takes at most 8 minutes: the benchmark at most its budget plus 15 s, the tests at
# most 135 s. Prints the path of the JSON file that holds every figure.
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

wheels="${GPU_BENCH_WHEELS:-$repo/.gpu-wheels}"
if [ -d "$wheels" ]; then
    site="$(mktemp -d "${TMPDIR:-/tmp}/gpu-bench-site.XXXXXX")"
    trap 'rm -rf "$site"' EXIT
    for wheel in "$wheels"/*.whl; do
        [ -e "$wheel" ] || continue
        # without pip, a wheel unpacked is the same files in the same place
        "$python" -m pip install --quiet --disable-pip-version-check --no-index --no-deps \
            --target "$site/lib" "$wheel" >/dev/null 2>&1 \
            || "$python" -m zipfile -e "$wheel" "$site/lib" \
            || echo "gpu.sh: could not install $(basename "$wheel")"
    done
    for sdist in "$wheels"/*.tar.gz; do
        [ -e "$sdist" ] || continue
        mkdir -p "$site/src" && tar -xzf "$sdist" -C "$site/src"
        PYTHONPATH="$site/src/$(basename "$sdist" .tar.gz):$PYTHONPATH"
    done
    PYTHONPATH="$site/lib:$PYTHONPATH"
fi
# python -m bench.gpu first says which optional package a part needs does not import.
status=0
"$python" -m bench.gpu ${extra[@]+"${extra[@]}"} "$@" || status=$?
# The tests that need a CUDA device (marker gpu; deselected elsewhere), when pytest is there.
if [ "${GPU_BENCH_TESTS:-1}" != "0" ] \
    && grep -q '"cuda_available": true' "$out" 2>/dev/null && grep -q '"pytest": ' "$out"; then
    tests="${out%.json}-tests.txt"
    mkdir -p "$(dirname "$tests")"
    mapfile -t files < <(cd "$repo" && {
        if [ -d tests/gpu ]; then echo tests/gpu; fi
        grep -rlE --include='*.py' 'mark\.gpu\b' tests | grep -v '^tests/gpu/' || true
    } | sort)
    if [ "${#files[@]}" -eq 0 ]; then
        echo "gpu.sh: GPU tests: none marked gpu under tests/"
    else
        (cd "$repo" && timeout 135 "$python" -m pytest -q -p no:cacheprovider -m gpu \
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
