#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
#
# The attention stash's GPU check, in two commands that each fit one call of the device tool on a lent H100 or H200
# (Python 3.12, torch 2.11 with CUDA 13, transformers 5.17, no DeepSpeed, no network). A task is lent 15 minutes of
# device time in all, at most 10 a call, and a machine's start costs minutes of them: each command fits 9 minutes by
# its own steps' caps, and the two together 12 (Budgets, below). Each installs what it needs offline (the shared
# setup) and writes its own report, $OUT/RESULTS-<command>.md, which says what it skipped and why.
#
# protocol: the seed's protocol, under the image's transformers (AutoEP needs 5.22 or older).
#   1. seed-tests: the seed's GPU tests in test_attention_stash.py: the replayed node against autograd's on each CUDA
#      backend (output, dK and dV bitwise, dQ as accurate as autograd's against FP32; its CPU case too) and a training
#      step of an AutoEP engine on a two-layer Mixtral with and without the stash (equal loss, attention gradients
#      within 1e-2 relative L2); each test's outcome from pytest's junit XML ($OUT/junit-seed.xml);
#   2. sweep: the stashed-layer sweep, the benchmark's Qwen3-30B-A3B preset (bf16, sequence 4096, micro-batch 4, 32
#      query and 4 key/value heads of dimension 128) without the selective arms (--no-sac): plain recompute and the
#      stash on half and on all layers, forward then reverse, --json and --plot under $OUT (sweep.json, sweep.png);
#   3. op-figures: the cuDNN numerics at the op level (gpu_op_figures.py): the attention forward per fused backend,
#      the saving per stashed layer and micro-batch, the bytes kept per layer against the planner, peak memory per
#      arm ($OUT/op_figures.json).
# suite: the suite's CUDA tests, the peer comparison and the offload leg.
#   4. suite-image, suite-wheel: the suite's CUDA tests, with the few CPU tests beside them, under the image's
#      transformers (leg 1) and under transformers 5.24.0 from the wheel folder (leg 2, run last): the replay on each
#      backend, the two-layer CUDA step on each backend in both checkpoint modes, and a model loaded by from_pretrained
#      at its defaults (use_kernels among them) trained on CUDA with and without the stash in both modes; each test's
#      outcome from pytest's junit XML ($OUT/junit-image.xml, $OUT/junit-wheel.xml);
#   5. peer: the peer comparison, as the GPU check ran it in one command before: the same preset with every arm, the
#      stash in both checkpoint modes against TRL's selective activation checkpointing (selective=True) and its
#      non-reentrant control, under leg 2's transformers where it installed ($OUT/peer.json, peer.png);
#   6. offload-16384, offload-32768: the offload leg (the benchmark's --offload), Llama-8B-shaped attention (32 query
#      and 8 key/value heads of dimension 128, bf16) in 4 layers at 16k and at 32k tokens, a step each: plain
#      recompute, the checkpoints' inputs offloaded (transformers' activation_checkpointing_enable(offload=True) under
#      leg 2's transformers, DeepSpeed's CheckpointHiddenStatesOffload under 5.17, which lacks it; the log and the
#      report say which), the stash on all layers, and the stash with the offload (offload=None): each arm's median
#      step time with its IQR and its peak memory, the bytes the stash offloaded and took back, its recomputes served
#      (the step fails where one was not, or where it offloaded nothing or took back less), and the two expectations
#      judged by the noise rule: the stash with offload peaks within one layer's kept bytes of the offload alone, and
#      steps within 2% of the stash alone. Each length's JSON stays in the work folder; its figures are in the report;
#   7. flash4: flash-attn 4, reported as skipped in one line, with nothing installed and no device time spent: its
#      GPU stack cannot travel (its nvidia-cutlass-dsl-libs-cu13 wheel is 92 MB, over the device tool's 64 MiB limit
#      on what travels) and the device image has no CUTLASS DSL. test_attention_stash_flash4_cuda.py runs the real
#      one where it is installed.
# long: the long-sequence sweep, a call of its own outside the two calls' 12 minutes, for a session with the time:
#   8. long-sequence: the benchmark's sweep of Llama-8B-shaped attention (2 layers, micro-batch 1) over 8k, 16k and
#      32k tokens, plain recompute against the stash, under leg 2's transformers where it installed ($OUT/long.json).
# Each command's report (gpu_check_report.py) is dated and gives GPU, driver, torch, CUDA, cuDNN and transformers
# versions, the budget, every step with its command, outcome and limit, and what the command skipped and why; every
# step's log is in $OUT/gpu_check-<command>.log. Each step runs under its own cap; one that fails or times out is
# reported as a failure and the next one runs. Exit status: 0 when every step passed (or was skipped for a reason:
# "skipped: ..."), 1 when one did not, 2 when no report came.
#
# Budgets: each step's cap is in the table CAP below; a command's need is its setup steps' caps, its own steps' caps,
# the report's reserve and a margin (the time between steps, a killed step's grace); its default budget covers its
# need and is at most 9 minutes (540 s), a minute under the device tool's 10 a call; the two calls' defaults together
# are at most 12 minutes (720 s), which leaves a machine's start inside a task's 15. `--budgets` prints the table and
# checks it; each run checks it too (its budget step). The caps are estimates for one H100 or H200, which no run has
# measured yet: retune them from a report's steps table. GPU_CHECK_BUDGET overrides a command's budget; a step gets
# its cap, or what is left of the budget where less is.
#   protocol: setup 50 s + steps 175 s + report 15 s + margin 15 s = 255 s, its default budget
#   suite:    setup 85 s + steps 340 s + report 15 s + margin 15 s = 455 s, its default budget
#   long:     setup 85 s + steps 100 s + report 15 s + margin 15 s = 215 s, its default budget
#
# Usage, with the device tool (the wheels must travel: ../shared is not there on the device machine):
#   here, in the checkout:  rm -rf .whl && cp -r ../shared/wheels .whl      (.whl/ is in .gitignore)
#   device run 1:           command "bash tests/benchmarks/gpu_check.sh protocol", carry [".whl"], timeout_s 285
#   device run 2, at once:  command "bash tests/benchmarks/gpu_check.sh suite", carry [".whl"], timeout_s 485
#   (a timeout_s of the budget and 30 s: the script ends by its budget). The second call follows the first while the
#   machine is still warm (30 s), so one start serves both. What comes back from $OUT (8 files a call at most):
#   protocol: RESULTS-protocol.md, gpu_check-protocol.log, junit-seed.xml, sweep.json, sweep.png, op_figures.json;
#   suite: RESULTS-suite.md, gpu_check-suite.log, junit-image.xml, junit-wheel.xml, peer.json, peer.png;
#   long (command "bash tests/benchmarks/gpu_check.sh long", carry [".whl"], timeout_s 245): RESULTS-long.md,
#   gpu_check-long.log, long.json.
# Before a device is spent on it, on any machine (CPU, tiny shapes; the CI test runs it):
#   bash tests/benchmarks/gpu_check.sh --dry-run              (every command: protocol, suite and long)
#   bash tests/benchmarks/gpu_check.sh --dry-run protocol     (one of them)
# The dry run sets up once for all the commands it runs, then runs them side by side (one thread each), each one's
# steps the same way; it swaps only the device (CPU), the shapes (tiny), the limits (each step's cap times 3: a busy
# CPU is no measure of a GPU's time), the wheel folder (one it builds of this project's own wheel, plus transformers'
# pure-Python wheel when a wheel folder is at hand, since the H200's cp312 wheels do not install here), the offload
# leg (one length), the AutoEP engine step (deselected: on CPU it trains its engine for about 40 s under transformers
# 5.22 and older, and skips on newer ones) and flash-attn 4 (the CPU double's steps at 4.0.0b40, Llama on a plain and
# a packed batch in both modes, installing no flash-attn 4; the report says what the GPU run skips instead). About
# 50 s on 2 idle cores.
#   bash tests/benchmarks/gpu_check.sh --budgets              (the budget table and its check; no Python)
#
# Environment: OUT (default: a new temporary folder), GPU_CHECK_WHEELS (the wheel folder; default .whl, else
# ../shared/wheels), GPU_CHECK_WORK (the venv, target folder and logs; default a temporary folder, removed at exit),
# GPU_CHECK_BUDGET (seconds for each command run, default its budget above), PYTHON (default python3).
#
# The Python it needs (PYTHON): on the device machine, the image's own python3, with torch, transformers and pytest.
# The dry run also needs DeepSpeed and a setuptools that builds wheels (70.1 or newer, or the wheel package): the
# Python of the README's test environment, after the README's test command, for example
#   PYTHON=/path/to/venv/bin/python bash tests/benchmarks/gpu_check.sh --dry-run
# A machine's own python3 may lack them. The script checks that Python first and stops with one message naming what is
# missing (exit status 2, no step run).
set -uo pipefail

# --- the commands, their steps' caps and their budgets ---------------------------------------------------------------
COMMANDS=(protocol suite long)
# The shared setup: every command's steps, then leg 2's for a command that runs under transformers from the wheel
# folder. install-base stands in for venv and install-venv where no venv can be made.
SETUP_STEPS=(venv install-venv probe-image)
LEG2_STEPS=(install-target probe-wheel)
declare -A STEPS=(
    [protocol]="seed-tests sweep op-figures"
    [suite]="suite-image peer offload-16384 offload-32768 flash4 suite-wheel"
    [long]="long-sequence"
)
declare -A LEG2=([protocol]=0 [suite]=1 [long]=1)
# Seconds. flash4 takes none on the GPU: it is skipped there, with its reason.
declare -A CAP=(
    [venv]=5 [install-venv]=20 [probe-image]=25 [install-target]=15 [probe-wheel]=20
    [seed-tests]=60 [sweep]=80 [op-figures]=35
    [suite-image]=50 [peer]=110 [offload-16384]=50 [offload-32768]=80 [flash4]=0 [suite-wheel]=50
    [long-sequence]=100
)
declare -A DEFAULT_BUDGET=([protocol]=255 [suite]=455 [long]=215)
REPORT_RESERVE=15 # seconds kept back for the report
MARGIN=15         # seconds for the time between steps, and a killed step's grace (timeout -k)
CALL_LIMIT=540    # a command's budget at most: 9 minutes, a minute under the device tool's 10 a call
TWO_CALLS_LIMIT=720 # protocol's and suite's budgets together at most: 12 minutes of a task's 15
# The dry run: each step's cap times DRY_FACTOR, and the caps of the steps that the GPU run has not.
DRY_FACTOR=3
declare -A DRY_CAP=([build-wheels]=120 [offload-32]=60 [flash4]=60)

# A command's setup steps, on one line.
setup_steps() {
    local steps=("${SETUP_STEPS[@]}")
    if ((LEG2[$1])); then
        steps+=("${LEG2_STEPS[@]}")
    fi
    echo "${steps[*]}"
}

sum_caps() {
    local name total=0
    for name in "$@"; do
        total=$((total + CAP[$name]))
    done
    echo "$total"
}

# The budget table: each command's caps and its need against its default budget, which must cover the need and be at
# most CALL_LIMIT, and protocol's and suite's defaults together at most TWO_CALLS_LIMIT. 1 where one does not hold.
budgets() {
    local command name setup steps need budget status=0 problems=()
    printf '%-9s %6s %6s %7s %7s %5s %7s %6s\n' command setup steps report margin need budget limit
    for command in "${COMMANDS[@]}"; do
        # shellcheck disable=SC2046 # the step names are words
        setup=$(sum_caps $(setup_steps "$command"))
        # shellcheck disable=SC2086
        steps=$(sum_caps ${STEPS[$command]})
        need=$((setup + steps + REPORT_RESERVE + MARGIN))
        budget=${DEFAULT_BUDGET[$command]}
        printf '%-9s %6s %6s %7s %7s %5s %7s %6s\n' "$command" "$setup" "$steps" "$REPORT_RESERVE" "$MARGIN" "$need" \
            "$budget" "$CALL_LIMIT"
        ((need > budget)) && problems+=("$command: its caps and reserves need $need s, over its budget of $budget s")
        ((budget > CALL_LIMIT)) && problems+=("$command: its budget of $budget s is over a call's $CALL_LIMIT s")
    done
    for command in "${COMMANDS[@]}"; do
        printf 'caps %s:' "$command"
        for name in $(setup_steps "$command") ${STEPS[$command]}; do
            printf ' %s=%s' "$name" "${CAP[$name]}"
        done
        echo
    done
    local two=$((DEFAULT_BUDGET[protocol] + DEFAULT_BUDGET[suite]))
    echo "protocol + suite: $two s of $TWO_CALLS_LIMIT s"
    ((two > TWO_CALLS_LIMIT)) && problems+=("protocol + suite: $two s, over the two calls' $TWO_CALLS_LIMIT s")
    printf 'dry run: each cap times %s; its own caps:' "$DRY_FACTOR"
    for name in $(printf '%s\n' "${!DRY_CAP[@]}" | sort); do
        printf ' %s=%s' "$name" "${DRY_CAP[$name]}"
    done
    echo
    if ((${#problems[@]})); then
        printf 'NOT HELD: %s\n' "${problems[@]}"
        status=1
    else
        echo "every budget holds"
    fi
    return $status
}

MODE=gpu
SHOW_BUDGETS=0
NAMED=()
for arg in "$@"; do
    case $arg in
        --dry-run) MODE=dry-run ;;
        --budgets) SHOW_BUDGETS=1 ;;
        protocol | suite | long) NAMED+=("$arg") ;;
        -h | --help)
            awk 'NR > 4 && /^#/ { sub(/^# ?/, ""); print } /^set /{ exit }' "$0"
            exit 0
            ;;
        *)
            echo "gpu_check.sh: unknown argument $arg (see --help)" >&2
            exit 2
            ;;
    esac
done
if ((SHOW_BUDGETS)); then
    budgets
    exit $?
fi
# The commands to run, in their order; the dry run runs them all unless told which.
RUN=()
for command in "${COMMANDS[@]}"; do
    for named in "${NAMED[@]}"; do
        if [[ $named == "$command" ]]; then
            RUN+=("$command")
            break
        fi
    done
done
if ((${#RUN[@]} == 0)); then
    if [[ $MODE == dry-run ]]; then
        RUN=("${COMMANDS[@]}")
    else
        echo "gpu_check.sh: name the command: protocol or suite (a device call each), or long (see --help)" >&2
        exit 2
    fi
fi
NEEDS_LEG2=0
for command in "${RUN[@]}"; do
    ((LEG2[$command])) && NEEDS_LEG2=1
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
START=$(date +%s)
HELPER=tests/benchmarks/gpu_check_report.py
# Where the steps write their rows, logs and notes: the setup's folder, then each command's.
STEPDIR=$WORK/setup
mkdir -p "$STEPDIR/logs"
: >"$STEPDIR/steps.tsv"
: >"$STEPDIR/meta.tsv"
export PYTHONUNBUFFERED=1 PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1

meta() { printf '%s\t%s\n' "$1" "$2" >>"$STEPDIR/meta.tsv"; }

# skipped WHAT WHY: a line of the report's "skipped here" list, for what the command leaves to another or to the GPU.
skipped() { printf '%s\t%s\n' "$1" "$2" >>"$STEPDIR/skipped.tsv"; }

# A step's cap: its own on the GPU; in the dry run its own times DRY_FACTOR, or the dry run's own.
cap_of() {
    if [[ $MODE == gpu ]]; then
        echo "${CAP[$1]}"
    elif [[ -n ${DRY_CAP[$1]:-} ]]; then
        echo "${DRY_CAP[$1]}"
    else
        echo $((CAP[$1] * DRY_FACTOR))
    fi
}

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

# record NAME STATUS RC SECONDS LIMIT COMMAND: a step's row in steps.tsv, and its line on the console.
record() {
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >>"$STEPDIR/steps.tsv"
    echo "[gpu_check] $1: $2 (rc $3, $4 s, limit $5 s)"
}

# run_step NAME COMMAND...: COMMAND under a timeout of the step's cap (cap_of NAME), or less where the budget is nearly
# spent; its output goes to logs/NAME.log, its outcome to steps.tsv. SIGINT first, so that pytest still writes its
# junit XML.
run_step() {
    local name=$1
    shift
    local log="$STEPDIR/logs/$name.log" cap left limit begin rc status seconds command
    cap=$(cap_of "$name")
    left=$((DEADLINE - $(date +%s) - REPORT_RESERVE))
    limit=$((cap < left ? cap : left))
    command=$(quoted "$@")
    printf '$ %s\n' "$command" >"$log"
    if ((limit < 5)); then
        status="skipped (out of time)" rc=- seconds=0 limit=0
        echo "out of time: the budget of $BUDGET s is spent" >>"$log"
    else
        begin=$(date +%s.%N)
        timeout -s INT -k 10 "$limit" "$@" >>"$log" 2>&1
        rc=$?
        seconds=$(awk -v a="$begin" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
        case $rc in
            0) status=passed ;;
            124 | 137) status="timed out" ;;
            *) status=failed ;;
        esac
    fi
    record "$name" "$status" "$rc" "$seconds" "$limit" "$command"
    [[ $status == passed ]]
}

# skip_step NAME REASON: a step not run for REASON, which is no failure: its status "skipped: REASON".
skip_step() {
    printf 'not run: %s\n' "$2" >"$STEPDIR/logs/$1.log"
    printf '%s\tskipped: %s\t-\t0\t0\t-\n' "$1" "$2" >>"$STEPDIR/steps.tsv"
    echo "[gpu_check] $1: skipped: $2"
}

# flash-attn 4 on the GPU: one line, nothing installed.
FLASH4_GPU_SKIP="flash-attn 4's GPU stack cannot travel to the device machine: its nvidia-cutlass-dsl-libs-cu13 wheel \
is 92 MB, over the device tool's 64 MiB limit on what travels, and the device image has no CUTLASS DSL; nothing was \
installed and no device time spent (test_attention_stash_flash4_cuda.py runs the real one where it is installed)"
SUITE_FILES=(tests/unit/runtime/activation_checkpointing/test_attention_stash.py
    tests/unit/runtime/activation_checkpointing/test_attention_stash_from_pretrained.py)
# The suite's CUDA tests and the few CPU tests beside them, the same on the GPU and in the dry run.
SUITE=("${SUITE_FILES[@]}" -k "replay_matches_autograd or cuda or kept_bytes_are_one_output or from_pretrained")
# The seed's GPU tests: the replay against autograd and the AutoEP engine step.
SEED=("${SUITE_FILES[0]}" -k "replay_matches_autograd or autoep_engine_step")
AUTOEP_TEST=${SUITE_FILES[0]}::test_autoep_engine_step_with_and_without_the_stash
if [[ $MODE == gpu ]]; then
    DEVICE=cuda
    SHAPES=(--preset qwen3-30b-a3b --device cuda --dtype bfloat16 --sequence 4096 --micro-batch 4)
    LONG=(--preset llama-8b-long --sequence "8192,16384,32768")
    # The offload leg's lengths. 4 layers, so that a stash that kept its outputs on the device would peak layers
    # beyond the one that the expectation allows over the offload (with 2 it could not).
    OFFLOAD_LENGTHS=(16384 32768)
    OFFLOAD=(--preset llama-8b-long --layers 4 --offload --warmup 1 --steps 2)
    OFFLOAD_ENV=()
else
    DEVICE=cpu
    SHAPES=(--preset cpu --device cpu --dtype float32 --layers 2 --sequence 64 --micro-batch 1 --experts 2 --warmup 1
        --steps 1)
    LONG=(--preset llama-long-cpu --sequence "32,64")
    OFFLOAD_LENGTHS=(32)
    OFFLOAD=(--preset llama-long-cpu --layers 4 --offload)
    # One thread: on 2 cores that another process keeps busy, OpenMP's waits make the tiny steps 50 times slower.
    OFFLOAD_ENV=(OMP_NUM_THREADS=1)
    # On CPU the AutoEP step trains its engine for about 40 s under transformers 5.22 and older (it skips on newer).
    SEED+=(--deselect "$AUTOEP_TEST")
    # The CPU double's flash-attn 4 steps at its newest release: Llama on a plain and a packed batch, both modes.
    FLASH4_TESTS=(tests/unit/runtime/activation_checkpointing/test_attention_stash_flash4.py
        -k "test_a_step_is_stock and 4.0.0b40 and llama and (plain or packed_position_ids)")
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
    printf -v NEEDED_LIST '%s, ' "${NEEDED[@]}"
    MESSAGE="gpu_check.sh ($MODE) needs a Python with ${NEEDED_LIST%, } as PYTHON, got $PY \
without: $MISSING. On the device machine use the image's python3; elsewhere, the Python of the README's test \
environment: make a virtual environment, run the README's test command in it (pip install -r \
requirements/requirements-dev.txt && pip install .), and pass PYTHON=/path/to/venv/bin/python."
    echo "$MESSAGE" >&2
    for command in "${RUN[@]}"; do
        printf '# Attention stash: GPU check, %s (%s): NO STEP RAN\n\n%s\n' "$command" "$MODE" "$MESSAGE" \
            >"$OUT/RESULTS-$command.md"
    done
    exit 2
fi

# The budget of a command (GPU_CHECK_BUDGET, else its default; the dry run's times DRY_FACTOR), and the caps of its
# setup steps, which the shared setup has spent before its own steps start.
budget_of() {
    local budget=${GPU_CHECK_BUDGET:-${DEFAULT_BUDGET[$1]}}
    [[ $MODE == dry-run && -z ${GPU_CHECK_BUDGET:-} ]] && budget=$((budget * DRY_FACTOR))
    echo "$budget"
}
setup_caps_of() {
    local name total=0
    for name in $(setup_steps "$1"); do
        total=$((total + $(cap_of "$name")))
    done
    echo "$total"
}
BUDGET=$(budget_of "${RUN[0]}")
DEADLINE=$((START + BUDGET))

meta mode "$MODE"
meta date "$(date -u '+%Y-%m-%d %H:%M:%S UTC')"
meta commit "$(git rev-parse --short HEAD 2>/dev/null || echo 'unknown (no git here)')"
meta host "$(hostname 2>/dev/null || echo '?'), $(nproc 2>/dev/null || echo '?') cores"
echo "[gpu_check] $MODE, ${RUN[*]}: output in $OUT, work in $WORK"

# --- the shared setup: the wheel folder ------------------------------------------------------------------------------
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
    run_step build-wheels "$PY" -m pip wheel --no-deps --no-build-isolation --no-index -w "$WHEELS" "$WORK/src"
    note="dry run: built here"
    if [[ -n $SOURCE_WHEELS ]] && compgen -G "$SOURCE_WHEELS/transformers-*-py3-none-any.whl" >/dev/null; then
        cp "$SOURCE_WHEELS"/transformers-*-py3-none-any.whl "$WHEELS/"
        note="$note, with transformers' wheel from $SOURCE_WHEELS"
    fi
    meta wheels_note "$note"
fi
meta wheels "$WHEELS"
# A flash-attn-4 wheel and its dependencies' in the folder stay out of the venv (the dry run's CPU double runs there);
# nothing installs them.
FLASH4_WHEELS=()
if compgen -G "$WHEELS/flash_attn_4-*.whl" >/dev/null; then
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

# --- the shared setup: a fresh venv for DeepSpeed and its missing dependencies, a target folder for leg 2 ------------
VENV=$WORK/venv
TARGET=$WORK/site-transformers
BASE_PATH=${PYTHONPATH:-}
if run_step venv "$PY" "$HELPER" venv "$VENV"; then
    VPY=$VENV/bin/python
    meta venv "$VENV"
    meta venv_note "python -m venv --system-site-packages, plus the maker's site-packages"
    run_step install-venv "$VPY" -m pip install --no-index --no-deps --no-compile --ignore-installed \
        --find-links "$WHEELS" "${BASE_WHEELS[@]}"
    PLACE=(--venv "$VENV")
else
    # No venv here: the same wheels into a target folder on PYTHONPATH, as the wheel folder's README says.
    VPY=$PY
    CAP[install-base]=${CAP[install-venv]}
    meta venv "none"
    meta venv_note "FAILED to make one; installed into $WORK/site-base on PYTHONPATH instead"
    run_step install-base "$VPY" -m pip install --no-index --no-deps --no-compile --target "$WORK/site-base" \
        --find-links "$WHEELS" "${BASE_WHEELS[@]}"
    BASE_PATH=$WORK/site-base${BASE_PATH:+:$BASE_PATH}
    PLACE=(--target "$WORK/site-base")
fi
meta target "$TARGET"
run_step probe-image env PYTHONPATH="$BASE_PATH" "$VPY" "$HELPER" probe --out "$STEPDIR/probe-image.json" \
    --device "$DEVICE" "${PLACE[@]}" "${BASE_WHEELS[@]}"
LEG2_PATH=$BASE_PATH
LEG2_OK=1
if ((NEEDS_LEG2)); then
    if ((${#LEG2_WHEELS[@]})); then
        run_step install-target "$VPY" -m pip install --no-index --no-deps --no-compile --target "$TARGET" \
            --find-links "$WHEELS" "${LEG2_WHEELS[@]}"
        LEG2_PATH=$TARGET${BASE_PATH:+:$BASE_PATH}
        meta leg2_note "$(basename -a "${LEG2_WHEELS[@]}" | paste -sd ' ') in the target folder, first on PYTHONPATH"
    else
        meta leg2_note "no transformers wheel in the wheel folder: leg 2 REUSES the installed transformers (a dry \
run without a wheel folder at hand; on the device machine this is a failure of the check)"
        [[ $MODE == gpu ]] && run_step install-target false
    fi
    run_step probe-wheel env PYTHONPATH="$LEG2_PATH" "$VPY" "$HELPER" probe --out "$STEPDIR/probe-wheel.json" \
        --device "$DEVICE" --target "$TARGET" "${LEG2_WHEELS[@]}"
    LEG2_OK=$?
fi

# A test that hangs fails alone, where pytest-timeout is there (the device image has it), instead of taking the step.
PYTEST=(-p no:cacheprovider -p no:randomly -v -rfEs)
if env PYTHONPATH="$BASE_PATH" "$VPY" -c "import pytest_timeout" 2>/dev/null; then
    PYTEST+=(--timeout 120)
fi

# The benchmarks' transformers: leg 2's where it installed (suite, long), else leg 1's; and --plot where matplotlib
# imports there.
bench_under_leg2() {
    if ((LEG2_OK == 0)); then
        BENCH_PATH=$LEG2_PATH BENCH_NOTE="under leg 2's transformers"
    else
        BENCH_PATH=$BASE_PATH BENCH_NOTE="under leg 1's transformers (leg 2's did not install)"
    fi
    meta bench_note "$BENCH_NOTE"
}
plot_to() {
    PLOT=()
    if env PYTHONPATH="$BENCH_PATH" "$VPY" -c "import matplotlib" 2>/dev/null; then
        PLOT=(--plot "$OUT/$1")
        meta plot_note "--plot"
    else
        meta plot_note "no plot: matplotlib does not import"
    fi
}
bench() {
    local name=$1
    shift
    run_step "$name" env PYTHONPATH="$BENCH_PATH" DS_ACCELERATOR="$DEVICE" "${RANKS[@]}" "$@"
}

# --- protocol: the seed's GPU tests, the stashed-layer sweep and the op-level figures, under leg 1 ------------------
run_protocol() {
    meta legs image
    meta seed_tests "pytest $(quoted "${SEED[@]}")"
    if [[ $MODE == dry-run ]]; then
        meta seed_note "the AutoEP engine step ($AUTOEP_TEST) is deselected in the dry run: on CPU it trains its \
engine for about 40 s under transformers 5.22 and older, and skips on newer ones; on the GPU it runs"
        skipped "the AutoEP engine step" "deselected in the dry run (about 40 s of CPU under transformers 5.22 and \
older, skipped on newer); on the GPU it runs"
    fi
    skipped "the suite's CUDA tests, the peer comparison (TRL's selective), the offload leg and flash-attn 4" \
        "another call's: gpu_check.sh suite"
    skipped "the long-sequence sweep" "a call of its own (gpu_check.sh long), outside the two calls' 12 minutes"
    run_step seed-tests env PYTHONPATH="$BASE_PATH" "$VPY" -m pytest "${SEED[@]}" "${PYTEST[@]}" \
        --junitxml "$OUT/junit-seed.xml"
    # The seed ran its protocol on the image's transformers: so does this, the AutoEP step's leg.
    BENCH_PATH=$BASE_PATH BENCH_NOTE="under leg 1's transformers, the seed's protocol's"
    meta bench_note "$BENCH_NOTE"
    plot_to sweep.png
    bench sweep "$VPY" tests/benchmarks/attention_stash_bench.py "${SHAPES[@]}" --no-sac --json "$OUT/sweep.json" \
        "${PLOT[@]}"
    run_step op-figures env PYTHONPATH="$BENCH_PATH" DS_ACCELERATOR="$DEVICE" "$VPY" \
        tests/benchmarks/gpu_op_figures.py --out "$OUT/op_figures.json" --bench-json "$OUT/sweep.json" -- \
        "${SHAPES[@]}"
}

# --- suite: the suite's CUDA tests under both transformers, the peer comparison, the offload leg, flash-attn 4 ------
run_suite() {
    meta legs "image wheel"
    meta suite "pytest $(quoted "${SUITE[@]}")"
    skipped "the seed's GPU tests (the replay, the AutoEP engine step), the stashed-layer sweep and the op-level \
figures" "another call's: gpu_check.sh protocol"
    skipped "the long-sequence sweep" "a call of its own (gpu_check.sh long), outside the two calls' 12 minutes"
    run_step suite-image env PYTHONPATH="$BASE_PATH" "$VPY" -m pytest "${SUITE[@]}" "${PYTEST[@]}" \
        --junitxml "$OUT/junit-image.xml"
    bench_under_leg2
    plot_to peer.png
    bench peer "$VPY" tests/benchmarks/attention_stash_bench.py "${SHAPES[@]}" --json "$OUT/peer.json" "${PLOT[@]}"
    # A step per length (one cut short by its cap keeps the other's), each length's JSON in the work folder.
    local n
    for n in "${OFFLOAD_LENGTHS[@]}"; do
        bench "offload-$n" "${OFFLOAD_ENV[@]}" "$VPY" tests/benchmarks/attention_stash_bench.py "${OFFLOAD[@]}" \
            --sequence "$n" --json "$STEPDIR/offload-$n.json"
    done
    if [[ $MODE == dry-run ]]; then
        meta flash4_note "dry run: the CPU double's flash-attn 4 tests, no flash-attn 4 installed; $BENCH_NOTE"
        meta flash4_gpu "$FLASH4_GPU_SKIP"
        run_step flash4 env PYTHONPATH="$BENCH_PATH" "$VPY" -m pytest "${FLASH4_TESTS[@]}" "${PYTEST[@]}" \
            --junitxml "$STEPDIR/junit-flash4.xml"
    else
        meta flash4_note "not installed: its GPU stack cannot travel"
        skip_step flash4 "$FLASH4_GPU_SKIP"
    fi
    # Leg 2 last, after the figures that nothing else gives.
    run_step suite-wheel env PYTHONPATH="$LEG2_PATH" "$VPY" -m pytest "${SUITE[@]}" "${PYTEST[@]}" \
        --junitxml "$OUT/junit-wheel.xml"
}

# --- long: the long-sequence sweep; its JSON is written after each length, so a cut keeps the lengths it did --------
run_long() {
    meta legs "image wheel"
    skipped "everything else" "the two calls' commands: gpu_check.sh protocol and gpu_check.sh suite"
    bench_under_leg2
    bench long-sequence "$VPY" tests/benchmarks/attention_stash_bench.py "${LONG[@]}" --json "$OUT/long.json"
}

# --- each command: the setup's rows that it needs, its budget, its steps, its report ----------------------------------
run_command() {
    local command=$1 name status keep
    STEPDIR=$WORK/$command
    rm -rf "$STEPDIR"
    mkdir -p "$STEPDIR/logs"
    keep=" build-wheels install-base $(setup_steps "$command") "
    awk -F '\t' -v keep="$keep" 'index(keep, " " $1 " ")' "$WORK/setup/steps.tsv" >"$STEPDIR/steps.tsv"
    while IFS=$'\t' read -r name _; do
        cp "$WORK/setup/logs/$name.log" "$STEPDIR/logs/"
    done <"$STEPDIR/steps.tsv"
    cp "$WORK/setup/meta.tsv" "$STEPDIR/meta.tsv"
    cp "$WORK/setup/probe-image.json" "$STEPDIR/" 2>/dev/null
    ((LEG2[$command])) && cp "$WORK/setup/probe-wheel.json" "$STEPDIR/" 2>/dev/null
    # A free port for DeepSpeed's process group, each command's own, not a fixed one.
    PORT=$("$VPY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    RANKS=(RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT="${PORT:-29500}")
    BUDGET=$(budget_of "$command")
    # The setup ran once, before the commands: each command's budget less its setup's caps starts now.
    DEADLINE=$(($(date +%s) + BUDGET - $(setup_caps_of "$command")))
    meta command "$command"
    meta budget "$BUDGET"
    meta budget_default "${DEFAULT_BUDGET[$command]}"
    # shellcheck disable=SC2046,SC2086
    meta budget_parts "$(sum_caps $(setup_steps "$command")) $(sum_caps ${STEPS[$command]}) $REPORT_RESERVE $MARGIN"
    meta budget_limits "$CALL_LIMIT $TWO_CALLS_LIMIT $((DEFAULT_BUDGET[protocol] + DEFAULT_BUDGET[suite]))"
    meta dry_factor "$DRY_FACTOR"
    # The budget step: the table's check, on any machine before a device is spent.
    printf '$ %s\n' "bash tests/benchmarks/gpu_check.sh --budgets" >"$STEPDIR/logs/budget.log"
    if budgets >>"$STEPDIR/logs/budget.log"; then
        record budget passed 0 0.0 0 "bash tests/benchmarks/gpu_check.sh --budgets"
    else
        record budget failed 1 0.0 0 "bash tests/benchmarks/gpu_check.sh --budgets"
    fi
    echo "[gpu_check] $command: budget $BUDGET s"
    case $command in
        protocol) run_protocol ;;
        suite) run_suite ;;
        long) run_long ;;
    esac

    # The report, within its reserve.
    status=0
    # 1 where a step neither passed nor was skipped for a reason.
    if awk -F '\t' '$2 != "passed" && $2 !~ /^skipped: / { bad = 1 } END { exit !bad }' "$STEPDIR/steps.tsv"; then
        status=1
    fi
    local results=$OUT/RESULTS-$command.md
    if ! timeout -k 5 "$REPORT_RESERVE" env PYTHONPATH="$BASE_PATH" "$VPY" "$HELPER" report --work "$STEPDIR" \
        --out "$OUT" >"$STEPDIR/logs/report.log" 2>&1 || [[ ! -s $results ]]; then
        status=2
        {
            echo "# Attention stash: GPU check, $command ($MODE): THE REPORT STEP FAILED"
            echo
            echo "Date: $(date -u '+%Y-%m-%d %H:%M:%S UTC'). The steps (name, status, rc, seconds, limit, command):"
            echo
            echo '```'
            cat "$STEPDIR/steps.tsv"
            echo
            tail -n 40 "$STEPDIR/logs/report.log"
            echo '```'
        } >"$results"
    fi
    local log
    for log in "$STEPDIR"/logs/*.log; do
        printf '\n===== %s =====\n' "$(basename "$log" .log)"
        cat "$log"
    done >"$OUT/gpu_check-$command.log"
    echo "[gpu_check] $command: report $results; exit status $status"
    return $status
}

# On the GPU one command after another (a call runs one), so that no step's timing shares the machine; the dry run,
# whose timings mean nothing, runs its commands side by side, each in its own subshell, one thread each (OpenMP's
# waits on cores that another process keeps busy would make its tiny steps many times slower), and prints each one's
# console in their order. The exit status: the worst of the commands'.
STATUS=0
if [[ $MODE == dry-run ]] && ((${#RUN[@]} > 1)); then
    export OMP_NUM_THREADS=1
    PIDS=()
    for command in "${RUN[@]}"; do
        run_command "$command" >"$WORK/console-$command.txt" 2>&1 &
        PIDS+=($!)
    done
    for index in "${!RUN[@]}"; do
        wait "${PIDS[$index]}"
        status=$?
        cat "$WORK/console-${RUN[$index]}.txt"
        ((status > STATUS)) && STATUS=$status
    done
else
    for command in "${RUN[@]}"; do
        run_command "$command"
        status=$?
        ((status > STATUS)) && STATUS=$status
    done
fi
echo "[gpu_check] $(($(date +%s) - START)) s; exit status $STATUS"
exit $STATUS
