#!/usr/bin/env bash
# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
#
# Wheels for a GPU machine without network access (an air-gapped cluster node, say), in two
# halves: prepared here, installed there.
#
#   scripts/offline_wheels.sh prepare [TE_WHEELS]   here: .whl/ (the fork, megatron-core 0.19.2)
#                                                   and, given the folder of Transformer Engine's
#                                                   extension wheels, .te/ (TE's core wheel cut
#                                                   in parts of $OFFLINE_PART_SIZE, default 47M,
#                                                   for transfers with a size limit; .te/extra/
#                                                   those wheels)
#   source scripts/offline_wheels.sh install [te]   there: install .whl/ (and, with "te", TE
#                                                   joined from ~/te/te.part.*) into ~/site
#
# Both folders are git-ignored. Move the parts to ~/te on the target before installing. A
# PYTHONPATH entry is no site folder, so a .pth in the target's own site-packages makes ~/site
# one, and the fork's overlay hook (a .pth) runs at start-up.

_offline_wheels_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

_offline_wheels_prepare() {
    local python="${PYTHON:-$_offline_wheels_root/.venv/bin/python}"
    cd "$_offline_wheels_root" || return 1
    rm -rf .whl && mkdir -p .whl
    "$python" -m pip wheel -q --no-deps . -w .whl || return 1
    "$python" -m pip download -q --no-deps megatron-core==0.19.2 -d .whl || return 1
    if [[ -n "${1:-}" ]]; then
        rm -rf .te && mkdir -p .te/extra .te/download
        cp "$1"/*.whl .te/extra/ || return 1
        "$python" -m pip download -q --no-deps transformer-engine-cu13==2.20.2 -d .te/download \
            || return 1
        split -b "${OFFLINE_PART_SIZE:-47M}" .te/download/transformer_engine_cu13-*.whl .te/te.part. && rm -rf .te/download
    fi
    ls -l .whl .te 2>/dev/null
}

_offline_wheels_install() {
    local wheels=("$_offline_wheels_root"/.whl/*.whl) joined
    if [[ "${1:-}" == te ]]; then
        joined=/tmp/transformer_engine_cu13-2.20.2-py3-none-manylinux_2_28_x86_64.whl
        cat ~/te/te.part.* >"$joined" || return 1
        wheels+=("$joined" "$_offline_wheels_root"/.te/extra/*.whl)
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target ~/site "${wheels[@]}" || return 1
    export PYTHONPATH=~/site
    local purelib
    purelib="$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    echo "import site; site.addsitedir('$HOME/site')" >"$purelib/zz_home_site.pth"
    python3 -c 'from megatron.core.optimizer.cpu_offloading import hybrid_optimizer as h
print("fork overlay:", getattr(h, "FORK_IMPLEMENTATION", False))'
}

case "${1:-}" in
    prepare) _offline_wheels_prepare "${2:-}" ;;
    install) _offline_wheels_install "${2:-}" ;;
    *)
        sed -n '4,18p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
        [[ "${1:-}" == -h || "${1:-}" == --help ]]
        ;;
esac
