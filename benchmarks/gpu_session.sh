#!/usr/bin/env bash
# Every GPU check of docs/gpu-checklist.md in one go: each item runs under its own timeout and the whole ends inside
# about 9 minutes.
#
#   OUT=/tmp/gpu-results bash benchmarks/gpu_session.sh
#
# Each item's output and files land in $OUT (at most 8 files come back, so the items' logs are packed into
# items_logs.tar.gz at the end): the CUDA tests' log, the five
# models' real training (MSR from max_memory_allocated, EOR, bit-identity), `tensile run --model`'s report, the
# hook's overhead (a log and, where there is one, a JSON file each), several jobs on the GPU at once (alone, capped at
# declared shares, under Tensile: a JSON file and its plot), what a process holds outside its caching allocator and
# whether the memory cap holds it to its admitted size (a JSON file), and this script's own log: the device, each
# item's exit status, seconds and last lines. Commit the JSON files under
# benchmarks/results/ (named by the device) and update benchmarks/README.md.
#
# Settings (environment): PYTHON (python3), ITEMS (which items, in order: context tests real_training run_model
# hook_overhead colocation), MODELS (real_training's, comma-separated; the paper's five by default), BATCH (16),
# COLOC_JOBS (colocation's MODEL@BATCH,...; its own default by device), and each item's timeout in seconds: CONTEXT_S
# (25), TESTS_S (105), REAL_S (140), RUN_S (45), OVERHEAD_S (75), COLOC_S (150): 540 s in all. On a machine without
# CUDA the same script runs on the CPU device (the CUDA tests skip, `context` refuses), in 1.5 to 3.5 minutes:
#   MODELS=resnet50 BATCH=2 OUT=/tmp/gs PYTHON=.venv/bin/python bash benchmarks/gpu_session.sh
set -uo pipefail
R=$(cd "$(dirname "$0")/.." && pwd)
cd "$R"
OUT=${OUT:?set OUT to a folder for the results}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)  # the items that run from /tmp write there too
PYTHON=${PYTHON:-python3}
# made absolute: the tests run from /tmp
case $PYTHON in */*) PYTHON="$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON")" ;; esac
ITEMS=${ITEMS:-context tests real_training run_model hook_overhead colocation}
BATCH=${BATCH:-16}
export PYTHONUNBUFFERED=1 COLUMNS=${COLUMNS:-160}  # rich's tables, unfolded in the logs
LOG="$OUT/session.log"
STARTED=$(mktemp)  # results files newer than this one were written by this call
trap 'rm -f "$STARTED"' EXIT

say() { echo "gpu_session: $*" | tee -a "$LOG"; }
python_c() { "$PYTHON" -c "$@"; }

# The device's python holds torch and this package's other needs, not the package: put the package's folders on
# the path as its editable install does (pyproject.toml's dev-mode-dirs; no build, no dependencies: the pins are for
# CI's CPU machines, not the device's image)
if ! python_c "import tensile_hook" 2>/dev/null; then
    FOLDERS=$(python_c "import sys, tomllib
dirs = tomllib.load(open(sys.argv[1], 'rb'))['tool']['hatch']['build']['targets']['wheel']['dev-mode-dirs']
print(':'.join(f'{sys.argv[2]}/{d}' for d in dirs))" "$R/pyproject.toml" "$R") || { say "reading the package's folders failed"; exit 1; }
    export PYTHONPATH=$FOLDERS${PYTHONPATH:+:$PYTHONPATH}
fi

read -r TORCH DEVICE < <(python_c "import torch; print(torch.__version__, 'cuda' if torch.cuda.is_available() else 'cpu')")
say "$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi");" \
    "torch $TORCH on $DEVICE"

item() {  # NAME SECONDS COMMAND...: one item under its timeout, its status and seconds in the log
    local name=$1 limit=$2 started=$SECONDS status
    shift 2
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    status=$?
    say "$name: exit $status after $((SECONDS - started)) s (limit $limit s)$([ $status = 124 ] && echo ', timed out')"
    tail -n 5 "$OUT/$name.log" | sed 's/^/    /' | tee -a "$LOG"
}

RESULTS=${TENSILE_BENCH_RESULTS:-benchmarks/results}  # where the benchmarks write (benchmarks/bench_results.py)
mkdir -p "$RESULTS"
fresh() {  # the results file an item wrote in this call (the folder holds earlier devices' files too)
    find "$RESULTS" -name "$1*.json" -newer "$STARTED" -exec cp {} "$OUT/" \;
}

for name in $ITEMS; do
    case $name in
        context)  # first, on a device no item has used yet
            item cuda_context "${CONTEXT_S:-25}" "$PYTHON" benchmarks/cuda_context.py
            fresh cuda_context ;;
        tests)  # `-m`, from outside the repository
            item cuda_tests "${TESTS_S:-105}" bash -c "cd /tmp && '$PYTHON' -m pytest -q -p no:cacheprovider \
                '$R/tests/hook/test_movers_cuda.py' '$R/tests/core/test_latency_cuda.py' \
                '$R/tests/hook/test_cuda.py'" ;;
        real_training)
            item real_training "${REAL_S:-140}" "$PYTHON" benchmarks/real_training.py --batch-size "$BATCH" \
                ${MODELS:+--models "$MODELS"}
            fresh real_training ;;
        run_model)  # the forecast traced for this device and planned with its preset; the plan applied if it matches
            item run_model "${RUN_S:-45}" bash -c "cd /tmp && '$PYTHON' -m tensile.cli run --model resnet50 \
                --batch-size $BATCH --memory-budget 0.6 --report '$OUT/run_model_report.json' -- '$PYTHON' \
                '$R/examples/train_zoo.py' resnet50 --batch-size $BATCH" ;;
        hook_overhead)
            item hook_overhead "${OVERHEAD_S:-75}" "$PYTHON" benchmarks/hook_overhead.py --device "$DEVICE" \
                --batch-size "$BATCH"
            fresh hook_overhead ;;
        colocation)  # several jobs at once on a simulated share of the GPU, each capped: alone, declared, Tensile
            item colocation "${COLOC_S:-150}" "$PYTHON" benchmarks/colocation.py ${COLOC_JOBS:+--jobs "$COLOC_JOBS"}
            fresh colocation
            find "$RESULTS" -name "colocation*.png" -newer "$STARTED" -exec cp {} "$OUT/" \; ;;
        *) say "unknown item '$name' (known: context tests real_training run_model hook_overhead colocation)" ;;
    esac
done
# at most 8 files come back: the items' logs travel as one archive (their last lines are in session.log)
(cd "$OUT" && ls ./*.log | grep -v session.log | xargs -r tar -czf items_logs.tar.gz --remove-files)
say "done after $SECONDS s"
