#!/usr/bin/env bash
# One device call, two trees: the same commands in this working tree ("new") and in a base commit
# ("base"), alternating new, base per command, logs under $OUT. GPU machines differ (DEVELOPERS.md):
# a change and its base are compared inside one call, never across calls.
#
#   git archive <base commit> -o base.tar      # here, before the call: base.tar is untracked and travels
#   bash benchmarks/gpu_ab.sh "python3 benchmarks/bench_decode_options.py --parts step-attention,sampling --out \$OUT/options_{tree}.json" \
#                             "python3 benchmarks/bench_rollout.py --device cuda --hf-batches 0 --out \$OUT/rollout_{tree}.json"
#
# Each argument runs with {tree} replaced by new / base, in that tree's root, megarl imported from it.
# T (seconds, default 240) bounds each run. Needs .whl/ (megatron-core) carried, as gpu_suite.sh.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TOKENIZERS_PARALLELISM=false
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
[ -f base.tar ] || { echo "gpu_ab.sh: no base.tar in $PWD; make it with 'git archive <commit> -o base.tar'"; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
BASE=/tmp/ab_base; rm -rf "$BASE"; mkdir -p "$BASE" && tar -xf base.tar -C "$BASE" || exit 1
for root in "$PWD" "$BASE"; do [ -e "$root/megarl/kernels" ] || ln -s ../kernels "$root/megarl/kernels"; done
nvidia-smi -L | tee "$OUT/gpu.txt"
i=0
for cmd in "$@"; do
  i=$((i + 1))
  for tree in new base; do
    root=$PWD; [ "$tree" = base ] && root=$BASE
    log="$OUT/${i}_$tree.log"
    echo "== $i $tree: ${cmd//\{tree\}/$tree}"
    (cd "$root" && PYTHONPATH=/tmp/site:$root timeout "${T:-240}" bash -c "${cmd//\{tree\}/$tree}") > "$log" 2>&1
    echo "== $i $tree exit $?"; tail -n "${TAILN:-12}" "$log"
  done
done
