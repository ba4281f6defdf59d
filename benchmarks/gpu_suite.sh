#!/usr/bin/env bash
# One device call, one whole job: the GPU checks and benchmarks, logs and JSON under $OUT.
#   bash benchmarks/gpu_suite.sh models     # GPU tests, kernel benchmark, bf16 parity, 7B throughput
#   bash benchmarks/gpu_suite.sh ppo        # PPO steps on random-weight checkpoints
#   bash benchmarks/gpu_suite.sh rollout    # engine GPU tests, decode throughput vs generate and the floor
#   bash benchmarks/gpu_suite.sh ragged     # engine GPU tests, ragged lengths (4 and 8 waves) under admission fractions, prefill alone
#   bash benchmarks/gpu_suite.sh rollout-kernels  # paged attention + sampling: GPU tests and benchmarks
#   bash benchmarks/gpu_suite.sh e2e        # GRPO step, megarl vs TRL (needs TRL wheels in .whl/)
#   bash benchmarks/gpu_suite.sh issue8     # rollout, then e2e: every issue-8 number in one call
#   bash benchmarks/gpu_suite.sh long       # 2 GPUs: a 32k-token sequence at CP1 (out of memory) and CP2, equal grads on 4k
#   bash benchmarks/gpu_suite.sh train      # fused-kernel, offload and resume GPU tests; actor update: packing, MFU, memory (~9 min)
# Needs .whl/ (megatron-core wheel: ../shared/gpu/fetch_wheels.sh) carried to the machine.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD:$PWD/kernels
NGPU=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
run() { local name=$1; shift; echo "== $name: $*"; timeout "${T:-300}" "$@" > "$OUT/$name.log" 2>&1; echo "== $name exit $?"; tail -n "${TAILN:-25}" "$OUT/$name.log"; }
case "${1:-models}" in
  models|parity)
    [ "$1" = parity ] || {
    T=120 run gpu_tests python3 -m pytest -q -m gpu tests/test_kernel_gae.py tests/test_kernel_logprob.py tests/test_kernel_group_advantage.py tests/test_kernel_reshard.py
    T=240 run kernels python3 benchmarks/bench_kernels.py --out "$OUT/kernels.json"; }
    T=200 run models_tp1 python3 -m torch.distributed.run --nproc_per_node 1 benchmarks/bench_models.py --out "$OUT/models_tp1.json"
    if [ "$NGPU" -ge 2 ]; then
      T=120 run models_tp2 python3 -m torch.distributed.run --nproc_per_node 2 benchmarks/bench_models.py --parity-only --tp 2 --out "$OUT/models_tp2.json"
    fi ;;
  ppo|ppo7b)
    [ "$1" = ppo7b ] || T=330 run ppo_1p5b python3 benchmarks/bench_ppo.py --config yaml/qwen2.5-1.5b.yaml --shape qwen2.5-1.5b --nproc 1 --steps 4 --out "$OUT/ppo_1p5b.json" "${@:2}"
    if [ "$NGPU" -ge 2 ] && [ "$1" = ppo7b ]; then
      T=400 run ppo_7b_tp2 python3 benchmarks/bench_ppo.py --config yaml/llama7b.yaml --shape llama2-7b --layers 8 --rm --nproc 2 --steps 3 --out "$OUT/ppo_7b_tp2.json" data.batch_size=64 actor.mini_batch_size=64 actor.micro_batch_size=16 critic.micro_batch_size=16 reward.model.micro_batch_size=16
    fi ;;
  rollout)
    T=120 run gpu_tests python3 -m pytest -q -x -m gpu tests/test_rollout_gpu.py
    T=90 run decode_ops python3 -m pytest -q -x tests/test_kernel_decode_ops.py
    T=330 run rollout python3 benchmarks/bench_rollout.py --device cuda --shape qwen2.5-1.5b --batches 32,128,512 --prompt-len 128 --new-tokens 512 --hf-batches 128 --ragged 128 --admit-fractions 0.0625,0.25 --profile 128 --out "$OUT/rollout.json" ;;
  ragged)
    T=150 run gpu_tests python3 -m pytest -q -x -s -m gpu tests/test_rollout_gpu.py
    T=300 run ragged python3 benchmarks/bench_rollout.py --device cuda --shape qwen2.5-1.5b --batches 128 --prompt-len 128 --new-tokens 512 --hf-batches 0 --ragged 128 --admit-fractions 0.015625,0.0625 --prefill 1x64,4x128,16x64,16x128,2x1024 --out "$OUT/ragged.json"
    T=150 run ragged_w8 python3 benchmarks/bench_rollout.py --device cuda --shape qwen2.5-1.5b --batches 32 --prompt-len 128 --new-tokens 512 --hf-batches 0 --ragged 128 --ragged-waves 8 --out "$OUT/ragged_w8.json" ;;
  rollout-kernels)
    T=300 run kernel_tests python3 -m pytest -q -m gpu tests/test_kernel_paged_attention.py tests/test_kernel_sampling.py
    T=120 run attention python3 benchmarks/bench_attention.py --out "$OUT/attention.json"
    T=120 run sampling python3 benchmarks/bench_sampling.py --out "$OUT/sampling.json" ;;
  issue8)
    bash "$0" rollout && bash "$0" e2e ;;
  train)
    T=420 run gpu_tests python3 -m pytest -q -s tests/test_models_fused_gpu.py tests/test_kernel_rope.py tests/test_cpu_offload.py tests/test_checkpoint_dtypes.py tests/test_trainer_resume_gpu.py
    T=450 run train python3 benchmarks/bench_train.py --case all --out-dir "$OUT" "${@:2}" ;;
  long)
    T=560 run long python3 benchmarks/bench_long_context.py --out "$OUT/long_context.json" ;;
  e2e)
    T=560 run e2e python3 benchmarks/bench_e2e.py --out "$OUT/e2e_grpo_1p5b.json" "${@:2}" ;;
esac
