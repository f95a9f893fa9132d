#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
#
# The attention stash's GPU check: one command on a lent H200 (Python 3.12, torch 2.11 with CUDA 13, transformers 5.17,
# no DeepSpeed, no network) that, within 10 minutes, installs what it needs offline and writes $OUT/RESULTS.md:
#   1. the test suite with its GPU tests, under the image's transformers (leg 1) and under transformers 5.24.0 from the
#      wheel folder (leg 2, run after steps 2 and 3), each test's outcome recorded from pytest's junit XML; among the
#      GPU tests, a model loaded by from_pretrained at its defaults (use_kernels among them), trained on CUDA with and
#      without the stash in both checkpoint modes;
#   2. the benchmark's Qwen3-30B-A3B preset (bf16, sequence 4096, micro-batch 4, 32 query and 4 key/value heads of
#      dimension 128), all arms, --json and --plot under $OUT;
#   3. the op-level figures (gpu_op_figures.py): the attention forward per fused backend, the saving per stashed
#      layer and micro-batch, the bytes kept per layer against the planner, peak memory per arm; then the long-sequence
#      leg: the benchmark's sweep of Llama-8B-shaped attention (32 query and 8 key/value heads of dimension 128,
#      bf16, 2 layers, micro-batch 1) over 8k, 16k and 32k tokens, as far as its limit allows; then the offload leg
#      (the benchmark's --offload), the same shapes in 4 layers at 16k and at 32k tokens, a step each: plain
#      recompute, the checkpoints' inputs offloaded (transformers' activation_checkpointing_enable(offload=True) under
#      leg 2's transformers, DeepSpeed's CheckpointHiddenStatesOffload under 5.17, which lacks it; the log and the
#      report say which), the stash on all layers, and the stash with the offload (offload=None): each arm's median
#      step time with its IQR and its peak memory, the bytes the stash offloaded and took back, its recomputes served
#      (the step fails where one was not, or where it offloaded nothing or took back less), and the two expectations
#      judged by the noise rule: the stash with offload peaks within one layer's kept bytes of the offload alone, and
#      steps within 2% of the stash alone;
#   4. flash-attn 4 (run before leg 2): where the wheel folder holds a flash_attn_4-*.whl, the newest one and the
#      wheels there of its dependencies (gpu_check_report.py flash4-wheels; none of them goes into the venv, where
#      the suite's CPU double of flash-attn 4 runs) are installed into their own target folder, first on PYTHONPATH
#      for this step alone (install-flash4, over leg 2's transformers where it installed), and
#      test_attention_stash_flash4_cuda.py runs (flash4): the real flash-attn 4's stock and stashed steps, bitwise,
#      with its kernel functions' calls counted; a test that cannot run there fails instead of skipping. Without such
#      a wheel the step is reported as skipped, with the reason, which is not a failure;
#   5. the report, dated, with GPU, driver, torch, CUDA, cuDNN and transformers versions (gpu_check_report.py).
# Each step runs under its own timeout inside the whole run's budget; one that fails or times out is reported as a
# failure and the next one runs. Exit status: 0 when every step passed (or was skipped for a reason: "skipped: ..."),
# 1 when one did not, 2 when no report came.
#
# Usage, with the device tool (the wheels must travel: ../shared is not there on the device machine):
#   here, in the checkout:  rm -rf .whl && cp -r ../shared/wheels .whl      (.whl/ is in .gitignore)
#                           and, for step 4, a flash-attn-4 wheel and those of its dependencies the image lacks
#   device run:             command "bash tests/benchmarks/gpu_check.sh", carry [".whl"], timeout_s 600
#   RESULTS.md, gpu_check.log, junit-*.xml, bench.json, bench.png, op_figures.json and long.json come back from $OUT
#   (the device tool brings 8 files back at most: the offload leg's JSON and flash-attn 4's junit XML stay in the
#   work folder, their figures and outcomes are in RESULTS.md). The steps' caps add up to more than the run's budget:
#   the ones that come last (leg 2's suite) get what is left; where that cuts them short, run again with the benchmark
#   steps done, or raise GPU_CHECK_BUDGET.
# Before a device is spent on it, on any machine (CPU, tiny shapes, about 50 s on 2 idle cores; the CI test runs it):
#   bash tests/benchmarks/gpu_check.sh --dry-run
# The dry run runs every step the same way; it swaps only the device (CPU), the shapes (tiny), the tests (a few, by
# -k, the CPU replay case among them; for step 4, the CPU double's flash-attn 4 steps at 4.0.0b40, installing no
# flash-attn 4) and the wheel folder: one it builds of this project's own wheel, plus transformers' pure-Python wheel
# when a wheel folder is at hand, since the H200's cp312 wheels do not install here.
#
# Environment: OUT (default: a new temporary folder), GPU_CHECK_WHEELS (the wheel folder; default .whl, else
# ../shared/wheels), GPU_CHECK_WORK (the venv, target folder and logs; default a temporary folder, removed at exit),
# GPU_CHECK_BUDGET (seconds for the whole run, default 570), PYTHON (default python3).
#
# The Python it needs (PYTHON): on the H200, the image's own python3, with torch, transformers and pytest. The dry run
# also needs DeepSpeed and a setuptools that builds wheels (70.1 or newer, or the wheel package): the Python of the
# README's test environment, after the README's test command, for example
#   PYTHON=/path/to/venv/bin/python bash tests/benchmarks/gpu_check.sh --dry-run
# A machine's own python3 may lack them. The script checks that Python first and stops with one message naming what is
# missing (exit status 2, no step run).
set -uo pipefail

MODE=gpu
for arg in "$@"; do
    case $arg in
        --dry-run) MODE=dry-run ;;
        -h | --help)
            awk 'NR > 4 && /^#/ { sub(/^# ?/, ""); print } /^set /{ exit }' "$0"
            exit 0
            ;;
        *)
            echo "gpu_check.sh: unknown option $arg (see --help)" >&2
            exit 2
            ;;
    esac
done

OUT=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 2
if [[ -n ${GPU_CHECK_WORK:-} ]]; then
    mkdir -p "$GPU_CHECK_WORK" && WORK=$(cd "$GPU_CHECK_WORK" && pwd) || exit 2
else
    WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_work.XXXXXX") || exit 2
    trap 'rm -rf "$WORK"' EXIT
fi
[[ -n ${GPU_CHECK_WHEELS:-} ]] && GPU_CHECK_WHEELS=$(cd "$GPU_CHECK_WHEELS" && pwd)
cd "$(dirname "$0")/../.." || exit 2
REPO=$(pwd)
PY=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET:-570}
START=$(date +%s)
DEADLINE=$((START + BUDGET))
REPORT_RESERVE=30 # seconds kept back for the report
HELPER=tests/benchmarks/gpu_check_report.py
mkdir -p "$WORK/logs"
: >"$WORK/steps.tsv"
: >"$WORK/meta.tsv"
export PYTHONUNBUFFERED=1 PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1

meta() { printf '%s\t%s\n' "$1" "$2" >>"$WORK/meta.tsv"; }

# A command as one line that a shell reads back the same: words with other characters than these in single quotes.
quoted() {
    local word words=()
    for word in "$@"; do
        if [[ $word =~ ^[A-Za-z0-9_./:=,+@%-]+$ ]]; then
            words+=("$word")
        else
            words+=("'${word//\'/\'\\\'\'}'")
        fi
    done
    echo "${words[*]}"
}

# run_step NAME CAP COMMAND...: COMMAND under a timeout of CAP seconds, or less where the run's budget is nearly spent;
# its output goes to logs/NAME.log, its outcome to steps.tsv. SIGINT first, so that pytest still writes its junit XML.
run_step() {
    local name=$1 cap=$2
    shift 2
    local log="$WORK/logs/$name.log" left limit begin rc status seconds command
    left=$((DEADLINE - $(date +%s) - REPORT_RESERVE))
    limit=$((cap < left ? cap : left))
    command=$(quoted "$@")
    printf '$ %s\n' "$command" >"$log"
    if ((limit < 5)); then
        status="skipped (out of time)" rc=- seconds=0 limit=0
        echo "out of time: the run's budget of $BUDGET s is spent" >>"$log"
    else
        begin=$(date +%s.%N)
        timeout -s INT -k 15 "$limit" "$@" >>"$log" 2>&1
        rc=$?
        seconds=$(awk -v a="$begin" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
        case $rc in
            0) status=passed ;;
            124 | 137) status="timed out" ;;
            *) status=failed ;;
        esac
    fi
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$seconds" "$limit" "$command" >>"$WORK/steps.tsv"
    echo "[gpu_check] $name: $status (rc $rc, $seconds s, limit $limit s)"
    [[ $status == passed ]]
}

# skip_step NAME REASON: a step not run for REASON, which is no failure: its status "skipped: REASON".
skip_step() {
    printf 'not run: %s\n' "$2" >"$WORK/logs/$1.log"
    printf '%s\tskipped: %s\t-\t0\t0\t-\n' "$1" "$2" >>"$WORK/steps.tsv"
    echo "[gpu_check] $1: skipped: $2"
}

if [[ $MODE == gpu ]]; then
    DEVICE=cuda
    SHAPES=(--preset qwen3-30b-a3b --device cuda --dtype bfloat16 --sequence 4096 --micro-batch 4)
    LONG=(--preset llama-8b-long --sequence 8192,16384,32768)
    # The offload leg: length and cap (seconds) of each step. 4 layers, so that a stash that kept its outputs on the
    # device would peak layers beyond the one that the expectation allows over the offload (with 2 it could not).
    OFFLOAD_STEPS=("16384 60" "32768 90")
    OFFLOAD=(--preset llama-8b-long --layers 4 --offload --warmup 1 --steps 2)
    OFFLOAD_ENV=()
    # Not this check's own dry-run test: it would run the dry run inside each leg.
    SUITE=(tests/unit/runtime/activation_checkpointing
        --ignore tests/unit/runtime/activation_checkpointing/test_attention_stash_gpu_check.py)
    # The real flash-attn 4's tests; where its wheel is at hand, one that would skip fails (see the file).
    FLASH4_TESTS=(tests/unit/runtime/activation_checkpointing/test_attention_stash_flash4_cuda.py)
    FLASH4_ENV=(ATTENTION_STASH_FLASH_ATTN_4=required)
else
    DEVICE=cpu
    SHAPES=(--preset cpu --device cpu --dtype float32 --layers 2 --sequence 64 --micro-batch 1 --experts 2 --warmup 1
        --steps 1)
    LONG=(--preset llama-long-cpu --sequence 32,64)
    OFFLOAD_STEPS=("32 60")
    OFFLOAD=(--preset llama-long-cpu --layers 4 --offload)
    # One thread: on 2 cores that another process keeps busy, OpenMP's waits make the tiny steps 50 times slower.
    OFFLOAD_ENV=(OMP_NUM_THREADS=1)
    SUITE=(tests/unit/runtime/activation_checkpointing/test_attention_stash.py
        tests/unit/runtime/activation_checkpointing/test_attention_stash_from_pretrained.py
        -k "replay_matches_autograd or cuda or kept_bytes_are_one_output or from_pretrained")
    # The CPU double's flash-attn 4 steps at its newest release: Llama on a plain and a packed batch, both modes.
    FLASH4_TESTS=(tests/unit/runtime/activation_checkpointing/test_attention_stash_flash4.py
        -k "test_a_step_is_stock and 4.0.0b40 and llama and (plain or packed_position_ids)")
    FLASH4_ENV=()
fi

# --- the Python: what the steps import, checked before any of them runs --------------------------------------------
if [[ $MODE == gpu ]]; then
    NEEDED=(torch transformers pytest)
else
    NEEDED=(torch transformers deepspeed pytest setuptools)
fi
MISSING=$("$PY" -c '
import importlib.util, os, sys
# Installed packages only: not the checkout'"'"'s own deepspeed/ folder, which the working directory would give.
sys.path = [path for path in sys.path if path not in ("", os.getcwd())]
missing = [name for name in sys.argv[2:] if importlib.util.find_spec(name) is None]
if sys.argv[1] == "dry-run" and "setuptools" not in missing and not (
        importlib.util.find_spec("setuptools.command.bdist_wheel") or importlib.util.find_spec("wheel")):
    missing.append("wheel (its setuptools builds no wheels: 70.1 or newer does)")
print(", ".join(missing))' "$MODE" "${NEEDED[@]}" 2>&1) || MISSING="a Python that runs (${MISSING:-not found})"
if [[ -n $MISSING ]]; then
    MESSAGE="gpu_check.sh ($MODE) needs a Python with $(echo "${NEEDED[*]}" | sed 's/ /, /g') as PYTHON, got $PY \
without: $MISSING. On the H200 use the image's python3; elsewhere, the Python of the README's test environment: make a \
virtual environment, run the README's test command in it (pip install -r requirements/requirements-dev.txt && pip \
install .), and pass PYTHON=/path/to/venv/bin/python."
    echo "$MESSAGE" >&2
    printf '# Attention stash: GPU check (%s): NO STEP RAN\n\n%s\n' "$MODE" "$MESSAGE" >"$OUT/RESULTS.md"
    exit 2
fi

meta mode "$MODE"
meta date "$(date -u '+%Y-%m-%d %H:%M:%S UTC')"
meta commit "$(git rev-parse --short HEAD 2>/dev/null || echo 'unknown (no git here)')"
meta host "$(hostname 2>/dev/null || echo '?'), $(nproc 2>/dev/null || echo '?') cores"
meta budget "$BUDGET"
meta suite "pytest $(quoted "${SUITE[@]}")"
echo "[gpu_check] $MODE: output in $OUT, work in $WORK, budget $BUDGET s"

# --- the wheel folder ------------------------------------------------------------------------------------------------
SOURCE_WHEELS=${GPU_CHECK_WHEELS:-}
if [[ -z $SOURCE_WHEELS ]]; then
    for candidate in "$REPO/.whl" "$REPO/../shared/wheels"; do
        if [[ -d $candidate ]]; then
            SOURCE_WHEELS=$(cd "$candidate" && pwd)
            break
        fi
    done
fi
if [[ $MODE == gpu ]]; then
    WHEELS=${SOURCE_WHEELS:-$REPO/.whl}
    meta wheels_note "as carried"
else
    # This project's wheel, built here from a copy of its sources (no build files left in the checkout), stands in
    # for DeepSpeed's; transformers' wheel is pure Python, so it installs here as on the H200.
    WHEELS=$WORK/wheels
    mkdir -p "$WHEELS" "$WORK/src"
    cp -r setup.py deepspeed "$WORK/src/"
    run_step build-wheels 120 "$PY" -m pip wheel --no-deps --no-build-isolation --no-index -w "$WHEELS" "$WORK/src"
    note="dry run: built here"
    if [[ -n $SOURCE_WHEELS ]] && compgen -G "$SOURCE_WHEELS/transformers-*-py3-none-any.whl" >/dev/null; then
        cp "$SOURCE_WHEELS"/transformers-*-py3-none-any.whl "$WHEELS/"
        note="$note, with transformers' wheel from $SOURCE_WHEELS"
    fi
    meta wheels_note "$note"
fi
meta wheels "$WHEELS"
# Step 4's wheels: the newest flash-attn-4 wheel and its dependencies' in the folder, kept out of the venv.
FLASH4_WHEELS=()
if [[ $MODE == gpu ]] && compgen -G "$WHEELS/flash_attn_4-*.whl" >/dev/null; then
    mapfile -t FLASH4_WHEELS < <("$PY" "$HELPER" flash4-wheels "$WHEELS" 2>/dev/null)
fi
BASE_WHEELS=() LEG2_WHEELS=()
if [[ -d $WHEELS ]]; then
    mapfile -t BASE_WHEELS < <(find "$WHEELS" -maxdepth 1 -name '*.whl' ! -name 'transformers-*' ! -name 'regex-*' \
        ! -name 'flash_attn_4-*' | sort)
    mapfile -t LEG2_WHEELS < <(find "$WHEELS" -maxdepth 1 \( -name 'transformers-*.whl' -o -name 'regex-*.whl' \) |
        sort)
fi
if ((${#BASE_WHEELS[@]} && ${#FLASH4_WHEELS[@]})); then
    mapfile -t BASE_WHEELS < <(printf '%s\n' "${BASE_WHEELS[@]}" | grep -vxF -f <(printf '%s\n' "${FLASH4_WHEELS[@]}"))
fi

# --- the offline install: a fresh venv for DeepSpeed and its missing dependencies, a target folder for leg 2 ---------
VENV=$WORK/venv
TARGET=$WORK/site-transformers
BASE_PATH=${PYTHONPATH:-}
if run_step venv 60 "$PY" "$HELPER" venv "$VENV"; then
    VPY=$VENV/bin/python
    meta venv "$VENV"
    meta venv_note "python -m venv --system-site-packages, plus the maker's site-packages"
    run_step install-venv 120 "$VPY" -m pip install --no-index --no-deps --no-compile --ignore-installed \
        --find-links "$WHEELS" "${BASE_WHEELS[@]}"
    PLACE=(--venv "$VENV")
else
    # No venv here: the same wheels into a target folder on PYTHONPATH, as the wheel folder's README says.
    VPY=$PY
    meta venv "none"
    meta venv_note "FAILED to make one; installed into $WORK/site-base on PYTHONPATH instead"
    run_step install-base 120 "$VPY" -m pip install --no-index --no-deps --no-compile --target "$WORK/site-base" \
        --find-links "$WHEELS" "${BASE_WHEELS[@]}"
    BASE_PATH=$WORK/site-base${BASE_PATH:+:$BASE_PATH}
    PLACE=(--target "$WORK/site-base")
fi
meta target "$TARGET"
run_step probe-image 90 env PYTHONPATH="$BASE_PATH" "$VPY" "$HELPER" probe --out "$WORK/probe-image.json" \
    --device "$DEVICE" "${PLACE[@]}" "${BASE_WHEELS[@]}"
LEG2_PATH=$BASE_PATH
if ((${#LEG2_WHEELS[@]})); then
    run_step install-target 120 "$VPY" -m pip install --no-index --no-deps --no-compile --target "$TARGET" \
        --find-links "$WHEELS" "${LEG2_WHEELS[@]}"
    LEG2_PATH=$TARGET${BASE_PATH:+:$BASE_PATH}
    meta leg2_note "$(basename -a "${LEG2_WHEELS[@]}" | paste -sd ' ') in the target folder, first on PYTHONPATH"
else
    meta leg2_note "no transformers wheel in the wheel folder: leg 2 REUSES the installed transformers (a dry run \
without a wheel folder at hand; on the H200 this is a failure of the check)"
    [[ $MODE == gpu ]] && run_step install-target 5 false
fi
run_step probe-wheel 90 env PYTHONPATH="$LEG2_PATH" "$VPY" "$HELPER" probe --out "$WORK/probe-wheel.json" \
    --device "$DEVICE" --target "$TARGET" "${LEG2_WHEELS[@]}"
LEG2_OK=$?

# --- 1. the suite with its GPU tests under the image's transformers (leg 2 runs last: see below) ---------------------
# A test that hangs fails alone, where pytest-timeout is there (the H200 has it), instead of taking the leg's time.
PYTEST=(-m pytest "${SUITE[@]}" -p no:cacheprovider -p no:randomly -v -rfEs)
if env PYTHONPATH="$BASE_PATH" "$VPY" -c "import pytest_timeout" 2>/dev/null; then
    PYTEST+=(--timeout 120)
fi
run_step suite-image 170 env PYTHONPATH="$BASE_PATH" "$VPY" "${PYTEST[@]}" --junitxml "$OUT/junit-image.xml"

# --- 2. the benchmark's preset, all arms, under leg 2's transformers where it installed ------------------------------
BENCH_PATH=$BASE_PATH BENCH_NOTE="under leg 1's transformers (leg 2's did not install)"
if ((LEG2_OK == 0)); then
    BENCH_PATH=$LEG2_PATH BENCH_NOTE="under leg 2's transformers"
fi
meta bench_note "$BENCH_NOTE"
PLOT=()
if env PYTHONPATH="$BENCH_PATH" "$VPY" -c "import matplotlib" 2>/dev/null; then
    PLOT=(--plot "$OUT/bench.png")
    meta plot_note "--plot"
else
    meta plot_note "no plot: matplotlib does not import"
fi
# A free port for DeepSpeed's process group, not a fixed one.
PORT=$("$VPY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
run_step bench 170 env PYTHONPATH="$BENCH_PATH" DS_ACCELERATOR="$DEVICE" RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 \
    MASTER_ADDR=127.0.0.1 MASTER_PORT="${PORT:-29500}" "$VPY" tests/benchmarks/attention_stash_bench.py \
    "${SHAPES[@]}" --json "$OUT/bench.json" "${PLOT[@]}"

# --- 3. the op-level figures at the same shapes ----------------------------------------------------------------------
run_step op-figures 60 env PYTHONPATH="$BENCH_PATH" DS_ACCELERATOR="$DEVICE" "$VPY" \
    tests/benchmarks/gpu_op_figures.py --out "$OUT/op_figures.json" --bench-json "$OUT/bench.json" -- "${SHAPES[@]}"

# --- 3b. the long-sequence leg: Llama-8B-shaped attention in 2 layers over 8k, 16k and 32k tokens, plain recompute
# against the stash; the JSON is written after each length, so a leg cut short by its limit keeps the lengths it did.
run_step long-sequence 100 env PYTHONPATH="$BENCH_PATH" DS_ACCELERATOR="$DEVICE" RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 \
    MASTER_ADDR=127.0.0.1 MASTER_PORT="${PORT:-29500}" "$VPY" tests/benchmarks/attention_stash_bench.py \
    "${LONG[@]}" --json "$OUT/long.json"

# --- 3c. the offload leg: Llama-8B-shaped attention in 4 layers at 16k and 32k tokens, four arms (plain, the inputs
# offloaded, the stash, the stash with the offload), a step per length (one cut short by its cap keeps the other's),
# each length's JSON in the work folder: the report gives their figures, and the device tool brings 8 files back from
# $OUT at most.
for step in "${OFFLOAD_STEPS[@]}"; do
    read -r n cap <<<"$step"
    run_step "offload-$n" "$cap" env PYTHONPATH="$BENCH_PATH" DS_ACCELERATOR="$DEVICE" RANK=0 LOCAL_RANK=0 \
        WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT="${PORT:-29500}" "${OFFLOAD_ENV[@]}" "$VPY" \
        tests/benchmarks/attention_stash_bench.py "${OFFLOAD[@]}" --sequence "$n" --json "$WORK/offload-$n.json"
done

# --- 4. flash-attn 4: the real one's tests, where its wheel is at hand, with its wheels in a target folder first on
# PYTHONPATH for this step alone, over leg 2's transformers where it installed; the CPU double's in the dry run. The
# junit XML stays in the work folder (the device tool brings 8 files back at most); the report gives each outcome.
FLASH4_TARGET=$WORK/site-flash4
FLASH4_PYTEST=(-m pytest "${FLASH4_TESTS[@]}" -p no:cacheprovider -p no:randomly -v -rfEs --junitxml
    "$WORK/junit-flash4.xml")
if [[ $MODE == dry-run ]]; then
    meta flash4_note "dry run: the CPU double's flash-attn 4 tests, no flash-attn 4 installed; $BENCH_NOTE"
    run_step flash4 60 env PYTHONPATH="$BENCH_PATH" "$VPY" "${FLASH4_PYTEST[@]}"
elif ((${#FLASH4_WHEELS[@]})); then
    meta flash4_note "$(basename -a "${FLASH4_WHEELS[@]}" | paste -sd ' ') in $FLASH4_TARGET, first on PYTHONPATH \
for this step alone; $BENCH_NOTE"
    if run_step install-flash4 90 "$VPY" -m pip install --no-index --no-deps --no-compile --target "$FLASH4_TARGET" \
        --find-links "$WHEELS" "${FLASH4_WHEELS[@]}"; then
        run_step flash4 120 env PYTHONPATH="$FLASH4_TARGET${BENCH_PATH:+:$BENCH_PATH}" "${FLASH4_ENV[@]}" "$VPY" \
            "${FLASH4_PYTEST[@]}"
    fi
elif compgen -G "$WHEELS/flash_attn_4-*.whl" >/dev/null; then
    meta flash4_note "the wheel folder's flash-attn-4 wheels could not be listed (see install-flash4)"
    run_step install-flash4 30 "$PY" "$HELPER" flash4-wheels "$WHEELS"
else
    meta flash4_note "no flash_attn_4-*.whl in the wheel folder: the real flash-attn 4 was not tested"
    skip_step flash4 "no flash_attn_4-*.whl in the wheel folder $WHEELS"
fi

# --- 1, leg 2: the suite under transformers 5.24.0, after the figures that nothing else gives: where the time runs
# short, its GPU tests, which come first in the suite's order, have run.
run_step suite-wheel 150 env PYTHONPATH="$LEG2_PATH" "$VPY" "${PYTEST[@]}" --junitxml "$OUT/junit-wheel.xml"

# --- 5. the report ---------------------------------------------------------------------------------------------------
STATUS=0
[[ -n $(cut -f2 "$WORK/steps.tsv" | grep -vx passed | grep -v '^skipped: ') ]] && STATUS=1
timeout -k 10 "$REPORT_RESERVE" env PYTHONPATH="$BASE_PATH" "$VPY" "$HELPER" report --work "$WORK" --out "$OUT" \
    >"$WORK/logs/report.log" 2>&1
if (($? != 0)) || [[ ! -s $OUT/RESULTS.md ]]; then
    STATUS=2
    {
        echo "# Attention stash: GPU check ($MODE): THE REPORT STEP FAILED"
        echo
        echo "Date: $(date -u '+%Y-%m-%d %H:%M:%S UTC'). The steps (name, status, rc, seconds, limit, command):"
        echo
        echo '```'
        cat "$WORK/steps.tsv"
        echo
        tail -n 40 "$WORK/logs/report.log"
        echo '```'
    } >"$OUT/RESULTS.md"
fi
for log in "$WORK"/logs/*.log; do
    printf '\n===== %s =====\n' "$(basename "$log" .log)"
    cat "$log"
done >"$OUT/gpu_check.log"
echo "[gpu_check] $(($(date +%s) - START)) s; report $OUT/RESULTS.md; exit status $STATUS"
exit $STATUS
