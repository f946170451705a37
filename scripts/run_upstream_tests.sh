#!/usr/bin/env bash
# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
#
# Runs a Megatron-LM checkout's own optimizer and dist-checkpointing unit tests twice, against
# the installed megatron-core 0.19.2 as it is (MEGATRON_OPTIMIZER_FORK=0) and with this
# repository's overlay on, and prints pass/fail/skip counts side by side plus every test whose
# outcome differs. Nothing of the checkout is copied here: its tests run from where they are.
#
#   scripts/run_upstream_tests.sh <megatron-lm-checkout> [pytest args]
#   scripts/run_upstream_tests.sh <checkout> tests/unit_tests/test_optimizer.py -k distrib
#
# The default selection is the optimizer, DDP-layout and dist-checkpointing test files below
# that exist in the checkout; a first argument that is not an option replaces it (paths are
# relative to the checkout). Use the checkout at the release matching megatron-core 0.19.2:
# branch core_r0.19.0 of NVIDIA/Megatron-LM (its distrib_optimizer.py equals 0.19.2's).
#
# How `megatron` and `tests` are resolved: pytest runs from the checkout with PYTHONSAFEPATH=1
# (the working directory is not put on sys.path) and --import-mode=append (the checkout root is
# added to the END of sys.path), so `tests` comes from the checkout while `megatron.core` comes
# from the installed megatron-core, with this repository (PYTHONPATH) providing the overlay.
# The overlay's finder is installed by loading megatron_optimizer_fork._pth_hook as a pytest
# plugin, so no installed wheel is needed. A preflight check in each mode aborts if any of this
# resolves differently.
#
# Settings (environment): PYTHON (default python3), NPROC (ranks; default: visible GPUs, at
# most 2), OUT_DIR (JUnit reports and logs; default: a new temporary folder), ALLOW_NETWORK=1
# (let the checkout's conftest try its dataset download; off by default).
#
# Offline on the GPU machine (device `run`): the machine has torch and pytest but neither
# megatron-core nor network access. Here, once, in the repository root:
#   echo /.mlm/ >> .git/info/exclude
#   mkdir -p .mlm && git -C <Megatron-LM clone> archive core_r0.19.0 pyproject.toml \
#       tests/__init__.py tests/unit_tests tests/test_utils/python_scripts | tar -x -C .mlm
# (about 7 MiB), and keep megatron-core's wheel in the ignored .whl/ folder
#   (python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux_2_28_x86_64 -d .whl megatron-core==0.19.2).
# Then run with carry [".mlm", ".whl"]:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/megatron_core-*.whl \
#     .whl/mock-*.whl \
#     && export PYTHONPATH=/tmp/site && scripts/run_upstream_tests.sh .mlm -x
# The checkout's test helpers import the `mock` package, which that machine lacks: download its
# wheel into .whl too (same command, `mock`) and install it with megatron-core's. A test file
# that fails to import (Transformer Engine, say, where no TE build is installed) counts as one
# error in both modes and the other files still run; compare the columns, not the absolute
# numbers.
set -euo pipefail

if [[ $# -lt 1 || "$1" == -* ]]; then
    sed -n '3,13p' "$0" >&2
    exit 2
fi
CHECKOUT="$(cd "$1" && pwd)"
shift
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
OUT_DIR="${OUT_DIR:-$(mktemp -d -t upstream_tests.XXXXXX)}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"

if [[ ! -f "$CHECKOUT/tests/unit_tests/conftest.py" ]]; then
    echo "run_upstream_tests: $CHECKOUT has no tests/unit_tests/conftest.py" >&2
    exit 2
fi

DEFAULT_TESTS=(
    tests/unit_tests/test_optimizer.py
    tests/unit_tests/test_optimizer_cpu_offloading.py
    tests/unit_tests/test_lion_optimizer.py
    tests/unit_tests/test_layer_wise_optimizer.py
    tests/unit_tests/optimizer
    tests/unit_tests/distributed/test_param_and_grad_buffer.py
    tests/unit_tests/distributed/test_param_layout.py
    tests/unit_tests/distributed/test_distributed_data_parallel.py
    tests/unit_tests/dist_checkpointing/test_optimizer.py
)
SELECTION=()
if [[ $# -gt 0 && "$1" != -* ]]; then
    SELECTION=("$@")
    set --
else
    for path in "${DEFAULT_TESTS[@]}"; do
        if [[ -e "$CHECKOUT/$path" ]]; then
            SELECTION+=("$path")
        else
            echo "run_upstream_tests: not in this checkout, skipped: $path" >&2
        fi
    done
fi
EXTRA=("$@")

if [[ -z "${NPROC:-}" ]]; then
    NPROC="$("$PYTHON" -c 'import torch; print(min(max(torch.cuda.device_count(), 1), 2))')"
fi

export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONSAFEPATH=1
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
# The checkout's conftest downloads datasets into /opt/data when that folder is missing; the
# tests run here need none, so requests go to a closed local port unless ALLOW_NETWORK=1.
if [[ "${ALLOW_NETWORK:-0}" != 1 ]]; then
    export HTTP_PROXY=http://127.0.0.1:9 HTTPS_PROXY=http://127.0.0.1:9 NO_PROXY=
    export http_proxy="$HTTP_PROXY" https_proxy="$HTTPS_PROXY" no_proxy=
fi

# Proves, with the interpreter setup pytest will have, where each name comes from.
preflight() {
    local mode="$1"
    (cd "$CHECKOUT" && "$PYTHON" - "$mode" "$CHECKOUT" "$REPO_ROOT" <<'PYEOF'
import importlib
import os
import sys

mode, checkout, repo = sys.argv[1:]
import megatron_optimizer_fork._pth_hook  # the plugin pytest loads first

sys.path.append(checkout)  # what --import-mode=append does for the tests package
core = importlib.import_module("megatron.core")
module = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
tests = importlib.import_module("tests")
real = lambda path: os.path.realpath(path)
problems = []
if real(core.__file__).startswith(real(checkout) + os.sep):
    problems.append(f"megatron.core comes from the checkout: {core.__file__}")
if not real(tests.__file__).startswith(real(checkout) + os.sep):
    problems.append(f"tests comes from {tests.__file__}, not the checkout")
in_fork = real(module.__file__).startswith(real(repo) + os.sep)
if in_fork != (mode == "fork"):
    problems.append(f"{mode} run resolves distrib_optimizer to {module.__file__}")
print(f"[{mode}] megatron.core: {core.__file__}")
print(f"[{mode}] distrib_optimizer: {module.__file__}")
print(f"[{mode}] tests: {tests.__file__}")
for problem in problems:
    print(f"[{mode}] PROBLEM: {problem}", file=sys.stderr)
sys.exit(1 if problems else 0)
PYEOF
    )
}

run_mode() {
    local mode="$1" flag="$2"
    local junit="$OUT_DIR/$mode"
    mkdir -p "$junit"
    rm -f "$junit"/*.xml
    echo "== $mode: ${NPROC} rank(s), log $OUT_DIR/$mode.log"
    MEGATRON_OPTIMIZER_FORK="$flag" preflight "$mode"
    set +e
    (
        cd "$CHECKOUT"
        # shellcheck disable=SC2016  # expanded by the per-rank shell, which knows LOCAL_RANK
        MEGATRON_OPTIMIZER_FORK="$flag" JUNIT_DIR="$junit" "$PYTHON" -m torch.distributed.run \
            --standalone --nproc-per-node "$NPROC" --no-python \
            bash -c 'exec "$0" -P -m pytest -p megatron_optimizer_fork._pth_hook \
                --import-mode=append -p no:cacheprovider --continue-on-collection-errors \
                --junitxml="$JUNIT_DIR/rank${LOCAL_RANK}.xml" \
                -m "not experimental and not flaky and not flaky_in_dev" "$@"' \
            "$PYTHON" "${SELECTION[@]}" ${EXTRA[@]+"${EXTRA[@]}"}
    ) >"$OUT_DIR/$mode.log" 2>&1
    echo "$?" >"$junit/exit_code"
    set -e
    tail -n 3 "$OUT_DIR/$mode.log"
}

run_mode upstream 0
run_mode fork 1

"$PYTHON" - "$OUT_DIR" "$NPROC" <<'PYEOF'
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

out, nproc = Path(sys.argv[1]), int(sys.argv[2])
MODES = ("upstream", "fork")
KINDS = ("passed", "failed", "error", "skipped")


def outcomes(path):
    """test id -> outcome, from one JUnit report."""
    found = {}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        tags = {child.tag for child in case}
        # A teardown error after a pass is recorded as a second element; the worst one wins.
        kind = "error" if "error" in tags else "failed" if "failure" in tags else (
            "skipped" if "skipped" in tags else "passed"
        )
        if found.get(name) not in ("error", "failed"):
            found[name] = kind
    return found


results, notes = {}, []
for mode in MODES:
    code = (out / mode / "exit_code").read_text().strip()
    reports = sorted((out / mode).glob("rank*.xml"))
    results[mode] = outcomes(reports[0]) if reports else {}
    if len(reports) < nproc:
        notes.append(f"{mode}: {len(reports)} of {nproc} ranks wrote a report (exit {code})")
    for other in reports[1:]:
        if outcomes(other) != results[mode]:
            notes.append(f"{mode}: {other.name} disagrees with {reports[0].name}")
    notes.append(f"{mode}: torchrun exit code {code}")

print(f"\n{'rank 0':12}" + "".join(f"{mode:>12}" for mode in MODES))
for kind in KINDS:
    counts = [sum(1 for v in results[m].values() if v == kind) for m in MODES]
    print(f"{kind:12}" + "".join(f"{count:>12}" for count in counts))
print(f"{'total':12}" + "".join(f"{len(results[m]):>12}" for m in MODES))
for note in notes:
    print(f"note: {note}")

changed = sorted(
    name
    for name in set(results["upstream"]) | set(results["fork"])
    if results["upstream"].get(name) != results["fork"].get(name)
)
if changed:
    print("\nOutcome differs (upstream -> fork):")
    for name in changed:
        print(f"  {results['upstream'].get(name, 'absent'):>8} -> "
              f"{results['fork'].get(name, 'absent'):<8} {name}")
regressed = [
    name
    for name in changed
    if results["upstream"].get(name) == "passed" and results["fork"].get(name) != "passed"
]
print(f"\nreports and logs: {out}")
sys.exit(1 if regressed or not results["fork"] else 0)
PYEOF
