#!/usr/bin/env bash
# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
#
# The checks that need a GPU, by name, each writing its full log to OUT_DIR (default
# ./gpu_checks) and printing a short summary. Run it where torch, megatron-core 0.19.2 and the
# fork are already installed (the fork as a wheel or `pip install .`); on a CPU-only host the
# GPU tests skip and the benchmarks label their figures as host-only.
#
#   scripts/run_gpu_checks.sh unit resume-w1 bench
#
# Checks:
#   unit         every unit test (the GPU ones included)
#   hdo          the HybridDeviceOptimizer's test files (its step's copies, streams and TE's
#                in-place step are only exercised with CUDA)
#   upstream-off the tests that a fix needs, against upstream 0.19.2 (MEGATRON_OPTIMIZER_FORK=0):
#                they must fail there
#   resume-w1    checkpoint resume matrix, world size 1, all directions (tools/distopt_resume.py)
#   resume-w2    the same on two GPUs, fork->fork and upstream->fork
#   resume-te    the TE FusedAdam and precision-aware cases, on the visible GPUs
#   resume-w4    the multi-rank matrix (tests/unit_tests/test_distrib_optimizer_multirank.py)
#                with NCCL on 4 GPUs: worlds of 2 and 4 ranks, resharding between them, faults
#   resume-w8    the same on 8 GPUs, worlds of 8 ranks included
#   bench        HDO step time against its floor, overlap on and off (benchmarks/hdo_step.py)
#   iteration    a training iteration of a 1.3B GPTModel, the optimizer on the GPU or offloaded,
#                upstream beside the fork, the step behind the forward on and off
#                (benchmarks/offload_iteration.py; ITERATION_ARGS adds options)
#   load-memory  GPU memory and time of each load phase, upstream beside the fork
#                (benchmarks/load_memory.py; its TE rows need Transformer Engine)
#   main         the README's main job (tools/resume_check.py)
#
# Settings (environment): PYTHON (default python3), OUT_DIR, TIMEOUT (seconds per check,
# default 560), BENCH_ARGS and ITERATION_ARGS (extra arguments for those benchmarks),
# RESUME_FILTER (a pytest -k expression ANDed to the resume checks' own, e.g. "w2"). The resume
# checks also write every case's merged result (errors, mismatches, memory figures) to
# OUT_DIR/resume_results/.
set -uo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
OUT_DIR="${OUT_DIR:-$PWD/gpu_checks}"
TIMEOUT="${TIMEOUT:-560}"
mkdir -p "$OUT_DIR"
cd "$REPO_ROOT"

RESUME=tests/unit_tests/test_distrib_optimizer_resume.py
HDO_TESTS=(
    tests/unit_tests/test_optimizer_cpu_offloading.py tests/unit_tests/test_hybrid_optimizer_*.py
)
# Tests written for fixes (HDO ring and pinning, decoupled gradients, lazy build, bucketing,
# step counts across in-place optimizers, a client's reset of the group steps).
FIX_TESTS="bit_for_bit or ring or slots or slot_stages or decoupled or pins_no_more or first_use"
FIX_TESTS="$FIX_TESTS or replace or bucketed or small"
FIX_TESTS="$FIX_TESTS or steps_resume or any_step_count or crosses_twice or never_stepped_counts"
FIX_TESTS="$FIX_TESTS or slime_reset or restarted_count or written_with_the_reset"

# Runs one pytest selection; keeps the whole log and prints the outcome lines.
run_pytest() {
    local name="$1"
    shift
    timeout "$TIMEOUT" "$PYTHON" -m pytest -q -p no:warnings -rfExX --tb=short "$@" \
        >"$OUT_DIR/$name.txt" 2>&1
    echo "== $name (exit $?)"
    grep -E "^(FAILED|ERROR|XPASS)|[0-9]+ (passed|failed)" "$OUT_DIR/$name.txt" | cut -c1-240
}

# Runs a selection of the resume matrix: its own -k expression AND RESUME_FILTER.
run_resume() {
    local name="$1" select="$2"
    [[ -n "${RESUME_FILTER:-}" ]] && select="($select) and ($RESUME_FILTER)"
    DISTOPT_RESUME_RESULTS_DIR="$OUT_DIR/resume_results" run_pytest "$name" "$RESUME" -k "$select"
}

for check in "$@"; do
    case "$check" in
        unit) run_pytest unit tests/unit_tests --deselect "$RESUME" ;;
        hdo) run_pytest hdo "${HDO_TESTS[@]}" ;;
        upstream-off)
            MEGATRON_OPTIMIZER_FORK=0 run_pytest upstream-off \
                tests/unit_tests/test_optimizer_cpu_offloading.py \
                tests/unit_tests/test_hybrid_optimizer_step_counts.py \
                tests/unit_tests/test_hybrid_optimizer_client_resets.py -k "$FIX_TESTS"
            ;;
        resume-w1) run_resume resume-w1 "w1 and not fused_adam and not precision_aware" ;;
        resume-w2)
            run_resume resume-w2 \
                "w2 and not fused_adam and not precision_aware and (fork2fork or upstream2fork)"
            ;;
        resume-te) run_resume resume-te "fused_adam or precision_aware" ;;
        resume-w4 | resume-w8)
            MULTIRANK_DEVICE=cuda MULTIRANK_FULL=1 MULTIRANK_MAX_WORLD="${check#resume-w}" \
                run_pytest "$check" tests/unit_tests/test_distrib_optimizer_multirank.py
            ;;
        bench)
            # shellcheck disable=SC2086
            timeout "$TIMEOUT" "$PYTHON" benchmarks/hdo_step.py --out "$OUT_DIR" ${BENCH_ARGS:-} \
                >"$OUT_DIR/bench.txt" 2>&1
            echo "== bench (exit $?)"
            grep -v Warn "$OUT_DIR/bench.txt" | tail -14
            ;;
        iteration)
            # shellcheck disable=SC2086
            timeout "$TIMEOUT" "$PYTHON" benchmarks/offload_iteration.py \
                --json "$OUT_DIR/offload_iteration.json" ${ITERATION_ARGS:-} \
                >"$OUT_DIR/iteration.txt" 2>"$OUT_DIR/iteration.log"
            echo "== iteration (exit $?)"
            grep -E "^\|" "$OUT_DIR/iteration.txt"
            ;;
        load-memory)
            timeout "$TIMEOUT" "$PYTHON" benchmarks/load_memory.py --out "$OUT_DIR/load_memory.json" \
                >"$OUT_DIR/load_memory.txt" 2>&1
            echo "== load-memory (exit $?)"
            grep -v Warn "$OUT_DIR/load_memory.txt" | tail -60
            ;;
        main)
            timeout "$TIMEOUT" "$PYTHON" tools/resume_check.py --out "$OUT_DIR/main" \
                >"$OUT_DIR/main.txt" 2>&1
            echo "== main (exit $?)"
            grep -v Warn "$OUT_DIR/main.txt" | tail -60
            ;;
        *)
            echo "unknown check: $check (see the header of $0)" >&2
            exit 2
            ;;
    esac
done
