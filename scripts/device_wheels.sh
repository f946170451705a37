#!/usr/bin/env bash
# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
#
# Wheels for a GPU machine without network (the device tool's machines), in two halves.
#
#   scripts/device_wheels.sh prepare [TE_WHEELS]   here: .whl/ (the fork, megatron-core 0.19.2)
#                                                  and, given the folder of TE's extension
#                                                  wheels, .te/ (TE's core wheel cut in parts
#                                                  of 58 MiB, .te/extra/ those wheels)
#   source scripts/device_wheels.sh install [te]   there: install .whl/ (and, with "te", TE
#                                                  joined from ~/te/te.part.*) into ~/site
#
# Both folders are git-ignored; name them in the device call's carry. The calls are limited to
# 64 MiB each, so TE's five parts travel one per call (`mkdir -p ~/te && mv .te/te.part.aa
# ~/te/`; carry no more than .whl beside one), in calls close enough that the machine stays
# warm; the last call carries .te/extra and the last part and installs. PYTHONPATH entries are
# no site folders, so a .pth in the machine's own site-packages makes ~/site one, and the
# fork's overlay hook (a .pth) runs at start-up.

_device_wheels_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

_device_wheels_prepare() {
    local python="${PYTHON:-$_device_wheels_root/.venv/bin/python}"
    cd "$_device_wheels_root" || return 1
    rm -rf .whl && mkdir -p .whl
    "$python" -m pip wheel -q --no-deps . -w .whl || return 1
    "$python" -m pip download -q --no-deps megatron-core==0.19.2 -d .whl || return 1
    if [[ -n "${1:-}" ]]; then
        rm -rf .te && mkdir -p .te/extra .te/download
        cp "$1"/*.whl .te/extra/ || return 1
        "$python" -m pip download -q --no-deps transformer-engine-cu13==2.20.2 -d .te/download \
            || return 1
        split -b 58M .te/download/transformer_engine_cu13-*.whl .te/te.part. && rm -rf .te/download
    fi
    ls -l .whl .te 2>/dev/null
}

_device_wheels_install() {
    local wheels=("$_device_wheels_root"/.whl/*.whl) joined
    if [[ "${1:-}" == te ]]; then
        joined=/tmp/transformer_engine_cu13-2.20.2-py3-none-manylinux_2_28_x86_64.whl
        cat ~/te/te.part.* >"$joined" || return 1
        wheels+=("$joined" "$_device_wheels_root"/.te/extra/*.whl)
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
    prepare) _device_wheels_prepare "${2:-}" ;;
    install) _device_wheels_install "${2:-}" ;;
    *)
        sed -n '4,18p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
        [[ "${1:-}" == -h || "${1:-}" == --help ]]
        ;;
esac
