#!/usr/bin/env bash
# Runs the unit tests against the working tree, the same way CI does.
#
#   scripts/run_tests.sh                      # every test under tests/unit_tests
#   scripts/run_tests.sh -k overlay -x        # options are added to the default selection
#   scripts/run_tests.sh tests/unit_tests/test_optimizer_fork_packaging.py
#                                             # a path as first argument replaces the selection
#   MEGATRON_OPTIMIZER_FORK=0 scripts/run_tests.sh ...   # the same tests against upstream
#
# It prepares the virtual environment (scripts/setup_venv.sh), reinstalls the checkout so the
# installed overlay serves the working tree's modules, and runs pytest from the checkout's root.
set -euo pipefail

# shellcheck source=scripts/setup_venv.sh
source "$(dirname "${BASH_SOURCE[0]}")/setup_venv.sh"
fork_install_worktree
cd "$FORK_REPO_ROOT"

if [[ $# -gt 0 && "$1" != -* ]]; then
    exec python -m pytest -q "$@"
fi
exec python -m pytest -q tests/unit_tests "$@"
