#!/usr/bin/env bash
# Runs tools/resume_check.py against the working tree: prepares the virtual environment
# (scripts/setup_venv.sh), reinstalls the checkout, then hands every argument to the tool.
set -euo pipefail

# shellcheck source=scripts/setup_venv.sh
source "$(dirname "${BASH_SOURCE[0]}")/setup_venv.sh"
fork_install_worktree
exec python "$FORK_REPO_ROOT/tools/resume_check.py" "$@"
