#!/usr/bin/env bash
# The wheels the GPU machine lacks (shared FACTS.md: opacus, datasets, dill, multiprocess, dp-accounting; and
# bitsandbytes), downloaded here into .whl/ (git-ignored) for Python 3.12 on Linux x86-64, at the versions this
# checkout is tested with. What travels to the GPU machine (the working tree and .whl/) must stay under 64 MiB:
# the script prints the sizes and fails if the tree and the required wheels do not fit; bitsandbytes' CUDA wheel is
# kept only if it fits too (otherwise scripts/gpu_proof.py skips its QLoRA step and says why).
#
#   bash scripts/gpu_wheels.sh            # then: the one GPU command, bash scripts/gpu_proof.sh (carry .whl)
set -euo pipefail
cd "$(dirname "$0")/.."
LIMIT_MIB=64
# A margin for what the run writes back and for files added before the launch (a safety, not a measurement).
MARGIN_MIB=2
PIP="${PIP:-python3 -m pip}"
REQUIRED=(opacus==1.6.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 dp-accounting==0.6.0)
OPTIONAL=(bitsandbytes==0.50.2)

rm -rf .whl && mkdir -p .whl
get() {  # pip download one pinned wheel for the GPU machine's Python into $1
    $PIP download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_28_x86_64 \
        --platform any -d "$1" "$2"
}
for spec in "${REQUIRED[@]}"; do get .whl "$spec"; done

kib() { du -sk "$@" 2>/dev/null | awk '{s += $1} END {print s + 0}'; }
# the tree as it travels: tracked files and untracked ones git does not ignore
tree_kib=$(git ls-files -z --cached --others --exclude-standard | xargs -0 -r du -sk 2>/dev/null | awk '{s += $1} END {print s + 0}')
wheels_kib=$(kib .whl)
total_kib=$((tree_kib + wheels_kib))
mib() { awk -v k="$1" 'BEGIN {printf "%.1f", k / 1024}'; }
echo "tree $(mib "$tree_kib") MiB + required wheels $(mib "$wheels_kib") MiB = $(mib "$total_kib") MiB (limit ${LIMIT_MIB} MiB, margin ${MARGIN_MIB})"
ls -l .whl | awk 'NR > 1 {printf "  %8.1f KiB  %s\n", $5 / 1024, $9}'
if (( total_kib > (LIMIT_MIB - MARGIN_MIB) * 1024 )); then
    echo "refused: the tree and the wheels exceed $((LIMIT_MIB - MARGIN_MIB)) MiB; drop a wheel or shrink the tree" >&2
    rm -rf .whl
    exit 1
fi

tmp=$(mktemp -d)
for spec in "${OPTIONAL[@]}"; do
    if get "$tmp" "$spec"; then
        extra_kib=$(kib "$tmp")
        if (( total_kib + extra_kib <= (LIMIT_MIB - MARGIN_MIB) * 1024 )); then
            mv "$tmp"/*.whl .whl/ && total_kib=$((total_kib + extra_kib))
            echo "kept $spec: $(mib "$extra_kib") MiB"
        else
            echo "left out $spec: $(mib "$extra_kib") MiB would make $(mib $((total_kib + extra_kib))) MiB"
        fi
        rm -f "$tmp"/*.whl
    else
        echo "left out $spec: no wheel for Python 3.12 on Linux x86-64"
    fi
done
rm -rf "$tmp"
echo "total to carry: $(mib "$total_kib") MiB in .whl/ and the tree"
