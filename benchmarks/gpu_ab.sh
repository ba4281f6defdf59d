#!/usr/bin/env bash
# One device call, several trees: the same commands in this working tree ("new") and in a base commit
# ("base"), and in any more commits given as VARIANTS, one after the other per command, logs under $OUT.
# GPU machines differ (DEVELOPERS.md): a change and its base are compared inside one call, never across calls.
#
#   git archive <base commit> -o base.tar      # here, before the call: base.tar is untracked and travels
#   git archive <branch> -o ab_v1.tar          # optional: more trees, named by their file (VARIANTS="ab_v1.tar")
#   bash benchmarks/gpu_ab.sh "python3 benchmarks/bench_decode_options.py --parts step-attention,sampling --out \$OUT/options_{tree}.json" \
#                             "python3 benchmarks/bench_rollout.py --device cuda --hf-batches 0 --out \$OUT/rollout_{tree}.json"
#
# Each argument runs with {tree} replaced by new / base / a variant's name, in that tree's root, megarl
# imported from it. T (seconds, default 240) bounds each run. Needs .whl/ (megatron-core) carried, as gpu_suite.sh.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TOKENIZERS_PARALLELISM=false
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
[ -f base.tar ] || { echo "gpu_ab.sh: no base.tar in $PWD; make it with 'git archive <commit> -o base.tar'"; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
trees=(new); roots=("$PWD")
for tar in base.tar ${VARIANTS:-}; do  # each archive unpacked into its own root, named by its file
  name=$(basename "$tar" .tar); root=/tmp/ab_$name
  rm -rf "$root"; mkdir -p "$root" && tar -xf "$tar" -C "$root" || exit 1
  trees+=("$name"); roots+=("$root")
done
nvidia-smi -L | tee "$OUT/gpu.txt"
n=0
for cmd in "$@"; do
  n=$((n + 1))
  for i in "${!trees[@]}"; do
    tree=${trees[$i]}; root=${roots[$i]}
    log="$OUT/${n}_$tree.log"
    echo "== $n $tree: ${cmd//\{tree\}/$tree}"
    (cd "$root" && PYTHONPATH=/tmp/site:$root:$root/kernels timeout "${T:-240}" bash -c "${cmd//\{tree\}/$tree}") > "$log" 2>&1
    echo "== $n $tree exit $?"; tail -n "${TAILN:-12}" "$log"
  done
done
