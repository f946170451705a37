#!/usr/bin/env bash
# Creates or reuses the project's Python 3.12 virtual environment and puts it first on PATH.
#
# Source it (`source scripts/setup_venv.sh`) from another script, or run it directly to only
# prepare the environment. Every step is skipped when already done, so repeated runs are fast:
#   1. create the environment with pyenv's Python 3.12 (`PYENV_VERSION=3.12.1 python3.12`),
#      or with `python3.12` from PATH where pyenv is absent;
#   2. install torch (the build from PyPI; it runs on the CPU too) unless the pinned release
#      is already there;
#   3. install the project with its `test` and `dev` extras, again only when pyproject.toml
#      changed since the last time.
# After sourcing, `fork_install_worktree` reinstalls the checkout (no dependencies), so that the
# working tree's code is what the installed overlay serves.
#
# Settings, all optional:
#   FORK_VENV            the environment's folder (default: <checkout>/.venv)
#   FORK_PYTHON_VERSION  pyenv version to create it with (default: 3.12.1)
#   FORK_TORCH_VERSION   torch release to install (default: 2.11.0; empty: any installed torch)

FORK_REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
FORK_VENV="${FORK_VENV:-$FORK_REPO_ROOT/.venv}"
FORK_PYTHON_VERSION="${FORK_PYTHON_VERSION:-3.12.1}"
FORK_TORCH_VERSION="${FORK_TORCH_VERSION-2.11.0}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

fork_pip() {
    python -m pip --quiet "$@"
}

# Installs from the package index, trying again without pip's cache where a download failed: a
# dropped connection or a truncated wheel (pip reports it as a hash mismatch) must not fail CI.
fork_pip_install() {
    fork_pip install "$@" && return 0
    local attempt
    for attempt in 2 3; do
        echo "setup_venv: pip install failed; attempt $attempt of 3, without the cache" >&2
        sleep $((attempt * 10))
        fork_pip install --no-cache-dir "$@" && return 0
    done
    return 1
}

_fork_python_is_312() {
    "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null
}

_fork_create_venv() {
    if [[ -x "$FORK_VENV/bin/python" ]]; then
        if ! _fork_python_is_312 "$FORK_VENV/bin/python"; then
            echo "setup_venv: $FORK_VENV is not a Python 3.12 environment; remove it first" >&2
            return 1
        fi
        return 0
    fi
    echo "setup_venv: creating $FORK_VENV" >&2
    # pyenv's shim refuses a bare python3.12 unless a 3.12 version is selected.
    if PYENV_VERSION="$FORK_PYTHON_VERSION" python3.12 -m venv "$FORK_VENV" 2>/dev/null; then
        return 0
    fi
    rm -rf "$FORK_VENV" || return 1
    if ! python3.12 -m venv "$FORK_VENV"; then
        echo "setup_venv: no Python 3.12 found (tried pyenv $FORK_PYTHON_VERSION and" \
            "python3.12 on PATH)" >&2
        return 1
    fi
}

_fork_installed_version() {
    python - "$1" <<'PYEOF'
import importlib.metadata
import sys

try:
    sys.stdout.write(importlib.metadata.version(sys.argv[1]))
except importlib.metadata.PackageNotFoundError:
    pass
PYEOF
}

_fork_install_torch() {
    local installed
    installed="$(_fork_installed_version torch)" || return 1
    if [[ -z "$FORK_TORCH_VERSION" && -n "$installed" ]]; then
        return 0
    fi
    if [[ -n "$FORK_TORCH_VERSION" && "${installed%%+*}" == "$FORK_TORCH_VERSION" ]]; then
        return 0
    fi
    echo "setup_venv: installing torch${FORK_TORCH_VERSION:+==$FORK_TORCH_VERSION}" \
        "(several GB, a few minutes)" >&2
    fork_pip_install "torch${FORK_TORCH_VERSION:+==$FORK_TORCH_VERSION}" || return 1
}

_fork_install_dependencies() {
    local stamp="$FORK_VENV/.megatron-fork-deps" digest
    digest="$(sha256sum "$FORK_REPO_ROOT/pyproject.toml" | cut -d' ' -f1)" || return 1
    if [[ -f "$stamp" && "$(cat "$stamp")" == "$digest" ]]; then
        return 0
    fi
    echo "setup_venv: installing the project with its test and dev extras" >&2
    fork_pip_install "$FORK_REPO_ROOT[test,dev]" || return 1
    echo "$digest" >"$stamp"
}

# Reinstalls the checkout without touching dependencies, so the working tree's code is served.
fork_install_worktree() {
    fork_pip install --no-deps --force-reinstall "$FORK_REPO_ROOT"
}

# Each step checks its own errors: callers may source this file with or without `set -e`.
fork_setup_venv() {
    _fork_create_venv || return 1
    export VIRTUAL_ENV="$FORK_VENV"
    export PATH="$FORK_VENV/bin:$PATH"
    hash -r
    _fork_install_torch || return 1
    _fork_install_dependencies || return 1
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    set -euo pipefail
    fork_setup_venv
else
    fork_setup_venv || return 1
fi
