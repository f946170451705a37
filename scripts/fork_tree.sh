#!/usr/bin/env bash
# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
#
# Writes the fork's megatron/ folder of a commit into .ab/<name>, for the --fork-tree option of
# benchmarks/hdo_step.py and benchmarks/load_memory.py (that commit's step or load measured in
# the same run as the working tree's). .ab/ is kept out of git (.git/info/exclude).
#
#   scripts/fork_tree.sh d28ac46            # -> .ab/d28ac46
#   scripts/fork_tree.sh HEAD~3 base        # -> .ab/base
#   python benchmarks/hdo_step.py --case gpt --fork-tree .ab/d28ac46 --rounds 3
#
# Prints the folder it wrote; exit code 0, or git's when the commit is unknown.
set -euo pipefail

if [[ $# -lt 1 || "$1" == -h || "$1" == --help ]]; then
    sed -n '4,12p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
    exit 0
fi
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
commit="$1"
name="${2:-$1}"
cd "$root"
git rev-parse --verify --quiet "$commit^{commit}" >/dev/null || {
    echo "fork_tree: unknown commit $commit" >&2
    exit 128
}
exclude="$(git rev-parse --git-path info/exclude)"
grep -qx '/.ab/' "$exclude" 2>/dev/null || echo '/.ab/' >>"$exclude"
rm -rf ".ab/$name"
mkdir -p ".ab/$name"
git archive "$commit" megatron | tar -x -C ".ab/$name"
echo ".ab/$name"
