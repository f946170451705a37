#!/usr/bin/env bash
# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
#
# Applies this repository's optimizer modules and tests to a Megatron-LM checkout, as the change
# an upstream pull request makes, and optionally runs the checkout's own optimizer and
# checkpointing unit tests there.
#
#   scripts/upstream_change.sh <megatron-lm-checkout> [options] [-- pytest args]
#
# Options:
#   --run-tests      after applying, run the checkout's optimizer and checkpointing tests in it
#   --compare DIR    also run the same selection in DIR, an unmodified checkout of the same
#                    commit, and print both columns and every test whose outcome differs
#                    (implies --run-tests)
#   --fork-tests     also run the tests this change adds, in the checkout (one process)
#   --tests PATHS    replace the default selection (checkout-relative, space-separated)
#   --nproc N        ranks per selection (default: the visible GPUs, at most 8; 1 on the CPU)
#   --python PY      interpreter with torch and pytest (default: $PYTHON or python3)
#   --out DIR        JUnit reports and logs (default: a new temporary folder)
#   --dry-run        say what would be copied; change nothing
#   -h, --help       this text
#
# What it copies (again on every run: a second run changes nothing):
#   megatron/**.py      every module of this repository at the same path. Two replace upstream's
#                       files by design (optimizer/distrib_optimizer.py and
#                       optimizer/cpu_offloading/hybrid_optimizer.py); the rest are new. No
#                       __init__.py is shipped or touched.
#   tests/unit_tests/   the tests, beside upstream's. Upstream's test_optimizer_cpu_offloading.py
#                       is kept: ours lands as test_hybrid_optimizer.py (imports of it rewritten).
#                       Tests of this repository's own tools and packaging are left out.
# A file at a target path that neither is one of the two replaced modules nor carries this
# repository's copyright line is upstream's: the script stops before writing anything. A file
# with that line that this repository no longer has is removed.
#
# Runs are vendored: the checkout itself is `megatron.core` (PYTHONPATH=<checkout>), whatever
# megatron-core the interpreter has installed. An installed fork overlay is switched off
# (MEGATRON_OPTIMIZER_FORK=0) and a preflight check proves where each module comes from.
# Besides torch and pytest, the checkout's conftest needs `requests`: the script names what is
# missing and stops. A test file that needs an absent package (at main, test_optimizer.py needs
# Transformer Engine, and `mock` through tests/unit_tests/test_utils.py) is named with the
# package and counts as one error in every column. On a CPU-only host most
# of the selection asks for CUDA and NCCL and fails the same way with and without the change:
# compare the columns. The checkout's conftest downloads test data into /opt/data; requests go
# to a closed local port unless ALLOW_NETWORK=1.
set -euo pipefail

usage() {
    awk 'NR > 3 && !/^#/ { exit } NR > 3 { sub(/^# ?/, ""); print }' "$0"
}

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The line every file of this repository starts with: it tells ours from upstream's.
FORK_MARK='Megatron optimizer fork contributors'
# Upstream files this change replaces by design (checkout-relative).
REPLACED=(
    megatron/core/optimizer/distrib_optimizer.py
    megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py
)
# Our test file whose name upstream already uses for tests of its own: source=target.
RENAMED_TESTS=("test_optimizer_cpu_offloading.py=test_hybrid_optimizer.py")
# Tests of this repository's packaging, tools and benchmarks (shell patterns): they need what
# only this repository has and skip in any Megatron-LM tree.
REPOSITORY_ONLY_TESTS=(
    test_optimizer_fork_packaging.py
    'test_*_tool.py'
    'test_*_benchmark.py'
)
# The checkout's own optimizer and checkpointing tests (globs, checkout-relative); files this
# change adds are never part of it, so both checkouts run the same selection.
DEFAULT_TESTS=(
    'tests/unit_tests/test_*optimizer*.py'
    tests/unit_tests/optimizer
    'tests/unit_tests/distributed/test_param_*.py'
    tests/unit_tests/distributed/test_distributed_data_parallel.py
    'tests/unit_tests/dist_checkpointing/test_*optimizer*.py'
    tests/unit_tests/test_checkpointing.py
)
MARKERS="not experimental and not flaky and not flaky_in_dev"

die() {
    echo "upstream_change: $*" >&2
    exit 2
}

CHECKOUT="" COMPARE="" RUN_TESTS=0 FORK_TESTS=0 DRY_RUN=0 NPROC="" OUT_DIR=""
PYTHON="${PYTHON:-python3}"
SELECTION=()
PYTEST_ARGS=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        -h | --help) usage; exit 0 ;;
        --run-tests) RUN_TESTS=1 ;;
        --fork-tests) RUN_TESTS=1 FORK_TESTS=1 ;;
        --compare)
            [[ $# -ge 2 ]] || die "--compare needs a folder"
            COMPARE="$2" RUN_TESTS=1
            shift
            ;;
        --tests) [[ $# -ge 2 ]] || die "--tests needs paths"; read -r -a SELECTION <<<"$2"; shift ;;
        --nproc) [[ $# -ge 2 ]] || die "--nproc needs a number"; NPROC="$2"; shift ;;
        --python) [[ $# -ge 2 ]] || die "--python needs an interpreter"; PYTHON="$2"; shift ;;
        --out) [[ $# -ge 2 ]] || die "--out needs a folder"; OUT_DIR="$2"; shift ;;
        --dry-run) DRY_RUN=1 ;;
        --) shift; PYTEST_ARGS=("$@"); break ;;
        -*) usage >&2; die "unknown option $1" ;;
        *) [[ -z "$CHECKOUT" ]] || die "one checkout only (got $CHECKOUT and $1)"; CHECKOUT="$1" ;;
    esac
    shift
done
[[ -n "$CHECKOUT" ]] || { usage >&2; exit 2; }
[[ -d "$CHECKOUT" ]] || die "no such folder: $CHECKOUT"
CHECKOUT="$(cd "$CHECKOUT" && pwd)"
[[ "$CHECKOUT" != "$REPO_ROOT" ]] || die "the checkout is this repository itself"

for path in "${REPLACED[@]}" tests/unit_tests/conftest.py; do
    [[ -f "$CHECKOUT/$path" ]] || die "$CHECKOUT is no Megatron-LM checkout: no $path"
done

# ---------------------------------------------------------------------------------------------
# What this repository ships: files git knows (tracked, or new and not ignored) that exist.
repo_files() {
    local folder="$1"
    if git -C "$REPO_ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
        git -C "$REPO_ROOT" ls-files --cached --others --exclude-standard -- "$folder"
    else
        (cd "$REPO_ROOT" && find "$folder" -type f)
    fi | grep '\.py$' | sort -u | while read -r path; do
        [[ -f "$REPO_ROOT/$path" ]] && echo "$path"
    done
}

renamed_target() {
    local name="$1" pair
    for pair in "${RENAMED_TESTS[@]}"; do
        [[ "$name" == "${pair%%=*}" ]] && { echo "${pair#*=}"; return; }
    done
    echo "$name"
}

is_listed() {
    local item="$1"
    shift
    local entry
    for entry in "$@"; do
        [[ "$entry" == "$item" ]] && return 0
    done
    return 1
}

matches_any() {
    local name="$1"
    shift
    local pattern
    for pattern in "$@"; do
        # shellcheck disable=SC2053  # the pattern is meant to match as a glob
        [[ "$name" == $pattern ]] && return 0
    done
    return 1
}

STAGE="$(mktemp -d -t upstream_change.XXXXXX)"
trap 'rm -rf "$STAGE"' EXIT

# Stage every file as it will stand in the checkout: source path -> target path.
declare -A TARGET_OF=()
while read -r path; do
    [[ "$(basename "$path")" != "__init__.py" ]] || die "refusing to ship $path"
    TARGET_OF["$path"]="$path"
done < <(repo_files megatron)
[[ ${#TARGET_OF[@]} -gt 0 ]] || die "found no modules under $REPO_ROOT/megatron"
while read -r path; do
    name="$(basename "$path")"
    matches_any "$name" "${REPOSITORY_ONLY_TESTS[@]}" && continue
    TARGET_OF["$path"]="tests/unit_tests/$(renamed_target "$name")"
done < <(repo_files tests/unit_tests)

RENAME_SED=()
for pair in "${RENAMED_TESTS[@]}"; do
    old="${pair%%=*}" new="${pair#*=}"
    RENAME_SED+=(-e "s/^(\\s*from (tests\\.unit_tests\\.)?)${old%.py} import/\\1${new%.py} import/")
    RENAME_SED+=(-e "s/sibling\\(\"${old%.py}\"\\)/sibling(\"${new%.py}\")/g")
done
for source in "${!TARGET_OF[@]}"; do
    staged="$STAGE/${TARGET_OF[$source]}"
    mkdir -p "$(dirname "$staged")"
    if [[ "$source" == tests/* ]]; then
        sed -E "${RENAME_SED[@]}" "$REPO_ROOT/$source" >"$staged"
    else
        cp "$REPO_ROOT/$source" "$staged"
    fi
done

# Check every target before writing any.
PLAN=()
conflicts=0
for target in $(printf '%s\n' "${TARGET_OF[@]}" | sort); do
    if [[ ! -e "$CHECKOUT/$target" ]]; then
        PLAN+=("new       $target")
    elif cmp -s "$STAGE/$target" "$CHECKOUT/$target"; then
        PLAN+=("unchanged $target")
    elif is_listed "$target" "${REPLACED[@]}" || grep -q "$FORK_MARK" "$CHECKOUT/$target"; then
        PLAN+=("update    $target")
    else
        echo "upstream_change: $target is upstream's file; this change would overwrite it" >&2
        conflicts=$((conflicts + 1))
    fi
done
[[ $conflicts -eq 0 ]] || die "$conflicts upstream file(s) in the way; nothing was written"

# Ours from an earlier run that this repository no longer ships.
STALE=()
while read -r path; do
    relative="${path#"$CHECKOUT"/}"
    is_listed "$relative" "${TARGET_OF[@]}" || STALE+=("$relative")
done < <(
    find "$CHECKOUT/megatron/core/optimizer" "$CHECKOUT/tests/unit_tests" -maxdepth 2 -name '*.py' \
        -type f -exec grep -l "$FORK_MARK" {} + 2>/dev/null | sort
)

printf '%s\n' "${PLAN[@]}" | grep -v '^unchanged' || true
for relative in ${STALE[@]+"${STALE[@]}"}; do
    echo "remove    $relative"
done
echo "upstream_change: $(printf '%s\n' "${PLAN[@]}" | grep -vc '^unchanged') of ${#PLAN[@]} files" \
    "to write, ${#STALE[@]} to remove, in $CHECKOUT"
if [[ $DRY_RUN -eq 1 ]]; then
    echo "upstream_change: dry run, nothing written"
    exit 0
fi
for source in "${!TARGET_OF[@]}"; do
    target="${TARGET_OF[$source]}"
    if ! cmp -s "$STAGE/$target" "$CHECKOUT/$target" 2>/dev/null; then
        mkdir -p "$(dirname "$CHECKOUT/$target")"
        cp "$STAGE/$target" "$CHECKOUT/$target"
    fi
done
for relative in ${STALE[@]+"${STALE[@]}"}; do
    rm -f "$CHECKOUT/$relative"
done
[[ $RUN_TESTS -eq 1 ]] || exit 0

# ---------------------------------------------------------------------------------------------
# Tests.
if [[ -n "$COMPARE" ]]; then
    [[ -d "$COMPARE" ]] || die "no such folder: $COMPARE"
    COMPARE="$(cd "$COMPARE" && pwd)"
    [[ "$COMPARE" != "$CHECKOUT" ]] || die "--compare needs another, unmodified checkout"
    if grep -q "FORK_IMPLEMENTATION" "$COMPARE/${REPLACED[0]}"; then
        die "$COMPARE already has this change applied; --compare needs an unmodified checkout"
    fi
    checkout_head="$(git -C "$CHECKOUT" rev-parse HEAD 2>/dev/null || true)"
    compare_head="$(git -C "$COMPARE" rev-parse HEAD 2>/dev/null || true)"
    if [[ "$checkout_head" != "$compare_head" ]]; then
        echo "upstream_change: WARNING: the checkouts are at different commits" \
            "(${checkout_head:-unknown} and ${compare_head:-unknown})" >&2
    fi
fi
command -v "$PYTHON" >/dev/null || die "no interpreter $PYTHON (set --python)"
OUT_DIR="${OUT_DIR:-$(mktemp -d -t upstream_change_tests.XXXXXX)}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
if [[ ${#SELECTION[@]} -eq 0 ]]; then
    mapfile -t SELECTION < <(
        cd "$CHECKOUT" && for pattern in "${DEFAULT_TESTS[@]}"; do
            # shellcheck disable=SC2086  # the pattern is meant to expand here
            for path in $pattern; do
                [[ -e "$path" ]] || continue
                [[ -f "$path" ]] && grep -q "$FORK_MARK" "$path" && continue
                echo "$path"
            done
        done
    )
    [[ ${#SELECTION[@]} -gt 0 ]] || die "none of the default tests is in $CHECKOUT"
fi
if [[ -z "$NPROC" ]]; then
    NPROC="$("$PYTHON" -c 'import torch; print(min(max(torch.cuda.device_count(), 1), 8))')"
fi

export MEGATRON_OPTIMIZER_FORK=0 NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
if [[ "${ALLOW_NETWORK:-0}" != 1 ]]; then
    export HTTP_PROXY=http://127.0.0.1:9 HTTPS_PROXY=http://127.0.0.1:9 NO_PROXY=
    export http_proxy="$HTTP_PROXY" https_proxy="$HTTPS_PROXY" no_proxy=
fi

# Where megatron.core and the two modules come from, with the checkout on PYTHONPATH.
preflight() {
    local tree="$1" expect_fork="$2"
    local log="$3"
    (cd "$tree" && PYTHONPATH="$tree" PYTHONWARNINGS=ignore "$PYTHON" - "$tree" "$expect_fork" \
        >"$log" 2>&1 <<'PYEOF'
import importlib
import os
import sys

tree, expect_fork = sys.argv[1], sys.argv[2] == "1"
root = os.path.realpath(tree) + os.sep
problems = []
for name in (
    "megatron.core",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.cpu_offloading.hybrid_optimizer",
):
    module = importlib.import_module(name)
    if not os.path.realpath(module.__file__).startswith(root):
        problems.append(f"{name} comes from {module.__file__}, not {tree}")
    is_ours = bool(getattr(module, "FORK_IMPLEMENTATION", False))
    if name != "megatron.core" and is_ours != expect_fork:
        problems.append(f"{name} is {'not ' if expect_fork else ''}this change's module")
core = importlib.import_module("megatron.core")
print(f"  megatron.core {getattr(core, '__version__', '?')} from {os.path.dirname(core.__file__)}")
for problem in problems:
    print(f"  PROBLEM: {problem}", file=sys.stderr)
sys.exit(1 if problems else 0)
PYEOF
    )
    local status=$?
    grep -E '^  (megatron|PROBLEM)' "$log" || tail -n 5 "$log"
    return $status
}

# Collects the selection once and names each test file that cannot be imported, with the
# package it lacks; stops where the checkout's conftest itself cannot be imported.
check_imports() {
    local tree="$1" log="$2"
    shift 2
    set +e
    (cd "$tree" && PYTHONPATH="$tree" "$PYTHON" -m pytest -p no:cacheprovider --collect-only -q \
        --continue-on-collection-errors "$@") >"$log" 2>&1
    set -e
    "$PYTHON" - "$log" <<'PYEOF'
import re
import sys

text = open(sys.argv[1], encoding="utf-8", errors="replace").read()
missing = lambda part: sorted(set(re.findall(r"No module named '([^']+)'", part)))
if "ImportError while loading conftest" in text:
    print("  the checkout's conftest cannot be imported; missing: "
          f"{', '.join(missing(text)) or 'see ' + sys.argv[1]}", file=sys.stderr)
    print("  install them into the interpreter the tests run with "
          "(python -m pip install <package>) and run again", file=sys.stderr)
    sys.exit(3)
for path, body in re.findall(r"_+ ERROR collecting (\S+) _+\n(.*?)(?=\n_+ |\n=+ )", text, re.S):
    needs = missing(body)
    reason = f"needs {', '.join(needs)} (not installed)" if needs else "cannot be collected"
    print(f"  {path}: {reason}; it counts as one error")
PYEOF
}

# Runs the selection in one tree: one pytest per rank under torchrun, or plain pytest.
run_selection() {
    local tree="$1" report="$2" ranks="$3"
    shift 3
    mkdir -p "$report"
    rm -f "$report"/*.xml
    set +e
    (
        cd "$tree"
        export PYTHONPATH="$tree" JUNIT_DIR="$report"
        if [[ "$ranks" -gt 1 ]]; then
            # shellcheck disable=SC2016  # expanded by each rank's shell, which knows LOCAL_RANK
            "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$ranks" --no-python \
                bash -c 'exec "$0" -m pytest -p no:cacheprovider --continue-on-collection-errors \
                    --junitxml="$JUNIT_DIR/rank${LOCAL_RANK}.xml" "$@"' "$PYTHON" "$@"
        else
            "$PYTHON" -m pytest -p no:cacheprovider --continue-on-collection-errors \
                --junitxml="$JUNIT_DIR/rank0.xml" "$@"
        fi
    ) >"$report.log" 2>&1
    echo "$?" >"$report/exit_code"
    set -e
    echo "  $(grep -E '[0-9]+ (passed|failed|skipped|error)' "$report.log" | tail -n 1)"
}

COLUMNS_ARGS=()
echo "== this change: $CHECKOUT (${NPROC} rank(s)); reports in $OUT_DIR"
preflight "$CHECKOUT" 1 "$OUT_DIR/changed-preflight.log" || die "preflight failed in $CHECKOUT"
check_imports "$CHECKOUT" "$OUT_DIR/changed-collect.log" "${SELECTION[@]}"
run_selection "$CHECKOUT" "$OUT_DIR/changed" "$NPROC" -m "$MARKERS" "${SELECTION[@]}" \
    ${PYTEST_ARGS[@]+"${PYTEST_ARGS[@]}"}
COLUMNS_ARGS+=("with the change=$OUT_DIR/changed")
if [[ -n "$COMPARE" ]]; then
    echo "== unmodified: $COMPARE"
    preflight "$COMPARE" 0 "$OUT_DIR/unmodified-preflight.log" || die "preflight failed in $COMPARE"
    check_imports "$COMPARE" "$OUT_DIR/unmodified-collect.log" "${SELECTION[@]}"
    run_selection "$COMPARE" "$OUT_DIR/unmodified" "$NPROC" -m "$MARKERS" "${SELECTION[@]}" \
        ${PYTEST_ARGS[@]+"${PYTEST_ARGS[@]}"}
    COLUMNS_ARGS=("unmodified=$OUT_DIR/unmodified" "${COLUMNS_ARGS[@]}")
fi
status=0
"$PYTHON" - "$NPROC" "${COLUMNS_ARGS[@]}" <<'PYEOF' || status=1
import collections
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ranks = int(sys.argv[1])
columns = [argument.split("=", 1) for argument in sys.argv[2:]]
KINDS = ("passed", "failed", "error", "skipped")


def read_report(path):
    """test id -> (outcome, first line of its message) from one JUnit file."""
    cases = {}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        found = {child.tag: child for child in case}
        for tag, kind in (("error", "error"), ("failure", "failed"), ("skipped", "skipped")):
            if tag in found:
                message = (found[tag].get("message") or found[tag].text or "").strip()
                outcome = (kind, message.splitlines()[0][:160] if message else "")
                break
        else:
            outcome = ("passed", "")
        # A teardown error after a pass is a second record of the same test: the worse counts.
        if cases.get(name, ("passed",))[0] in ("passed", "skipped"):
            cases[name] = outcome
    return cases


results, notes = {}, []
for label, folder in columns:
    reports = sorted(Path(folder).glob("rank*.xml"))
    exit_code = (Path(folder) / "exit_code").read_text().strip()
    results[label] = read_report(reports[0]) if reports else {}
    if len(reports) < ranks:
        notes.append(f"{label}: {len(reports)} of {ranks} ranks wrote a report (exit {exit_code})")
    notes += [
        f"{label}: {other.name} disagrees with {reports[0].name}"
        for other in reports[1:]
        if read_report(other) != results[label]
    ]

labels = [label for label, _ in columns]
width = max(16, *(len(label) + 2 for label in labels))
print()
print("rank 0".ljust(12) + "".join(label.rjust(width) for label in labels))
for kind in KINDS + ("total",):
    counts = [
        sum(1 for outcome, _ in results[label].values() if kind in ("total", outcome))
        for label in labels
    ]
    print(kind.ljust(12) + "".join(str(count).rjust(width) for count in counts))
for note in notes:
    print(f"note: {note}")

last = labels[-1]
reasons = collections.Counter(
    message for outcome, message in results[last].values() if outcome != "passed"
)
if reasons:
    print(f"\nmost common reasons for not passing ({last}):")
for message, count in reasons.most_common(8):
    print(f"  {count:5}  {message or '(no message)'}")

regressed = []
if len(labels) == 2:
    before, after = (results[label] for label in labels)
    absent = ("absent", "")
    changed = sorted(
        name
        for name in set(before) | set(after)
        if before.get(name, absent)[0] != after.get(name, absent)[0]
    )
    print(f"\noutcome differs ({labels[0]} -> {labels[1]}): {len(changed)}")
    for name in changed:
        old, new = before.get(name, absent), after.get(name, absent)
        print(f"  {old[0]:>8} -> {new[0]:<8} {name}")
        for outcome, message in (old, new):
            if outcome not in ("passed", "absent") and message:
                print(f"{'':22}{outcome}: {message}")
        # Worse with the change: a pass that no longer passes, or a new failure.
        broken = ("failed", "error")
        if (old[0] == "passed") or (new[0] in broken and old[0] not in broken):
            regressed.append(name)
print(f"\nreports and logs: {Path(columns[0][1]).parent}")
sys.exit(1 if regressed or not results[last] else 0)
PYEOF

if [[ $FORK_TESTS -eq 1 ]]; then
    FORK_SELECTION=()
    for source in "${!TARGET_OF[@]}"; do
        target="${TARGET_OF[$source]}"
        [[ "$(basename "$target")" == test_*.py ]] && FORK_SELECTION+=("$target")
    done
    mapfile -t FORK_SELECTION < <(printf '%s\n' "${FORK_SELECTION[@]}" | sort)
    echo "== this change's own tests in $CHECKOUT (${#FORK_SELECTION[@]} files, one process)"
    run_selection "$CHECKOUT" "$OUT_DIR/added" 1 "${FORK_SELECTION[@]}" \
        ${PYTEST_ARGS[@]+"${PYTEST_ARGS[@]}"}
    grep -qx 0 "$OUT_DIR/added/exit_code" || status=1
fi
exit "$status"
