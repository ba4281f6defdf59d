#!/usr/bin/env bash
# The GPU tests and benchmarks of one area in one command, logs and JSON under $OUT (default /tmp/out).
# Run from the repository root on a GPU node where megarl is installed (pip install -e ".[bench]"),
# or with PYTHONPATH=$PWD:$PWD/kernels and megatron-core installed.
#   bash benchmarks/gpu_suite.sh rollout   # engine GPU tests; decode throughput vs generate and the HBM floor
#   bash benchmarks/gpu_suite.sh e2e       # GRPO step, megarl vs TRL's GRPOTrainer
#   bash benchmarks/gpu_suite.sh train     # training GPU tests; actor update: packing, MFU, memory
#   bash benchmarks/gpu_suite.sh kernels   # kernel GPU tests; training-side kernels, paged attention, sampling
#   bash benchmarks/gpu_suite.sh models    # bf16 parity with transformers (TP1, and TP2 on 2 GPUs), 7B fwd + bwd
#   bash benchmarks/gpu_suite.sh ppo       # PPO steps on a random-weight 1.5B checkpoint, time per phase
#   bash benchmarks/gpu_suite.sh long      # 2 GPUs: a 32k-token sequence at CP1 and CP2
#   bash benchmarks/gpu_suite.sh moe       # MoE decode, Qwen3-30B-A3B (48 layers, built on the GPU) vs generate and the floor
#   bash benchmarks/gpu_suite.sh moe_e2e   # GRPO step on Qwen3-30B-A3B cut to 8 layers, megarl vs TRL
#   bash benchmarks/gpu_suite.sh moe_r3    # the same shape, megarl with router_replay=r3: agreement and mismatch
#   bash benchmarks/gpu_suite.sh partial   # GRPO with and without partial rollouts, long-tailed lengths
#   bash benchmarks/gpu_suite.sh server    # 128 chat sessions through the OpenAI endpoint vs the engine (needs openai)
#   bash benchmarks/gpu_suite.sh rc        # the rollout-correction cost: GRPO with and without it, and the terms alone
# T=seconds bounds each command (default 300); extra arguments after the mode go to the benchmark.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
NGPU=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
run() { local name=$1; shift; echo "== $name: $*"; timeout "${T:-300}" "$@" > "$OUT/$name.log" 2>&1; echo "== $name exit $?"; tail -n "${TAILN:-25}" "$OUT/$name.log"; }
mode=${1:-rollout}; shift || true
case "$mode" in
  rollout)
    T=200 run gpu_tests python3 -m pytest -q -m gpu tests/test_rollout_gpu.py tests/test_rollout_graph_experts.py tests/test_kernel_decode_ops.py tests/test_kernel_fc1_swiglu.py
    T=400 run rollout python3 benchmarks/bench_rollout.py --device cuda --shape qwen2.5-1.5b --batches 32,128,512 --prompt-len 128 --new-tokens 512 --hf-batches 128 --ragged 128 --ragged-waves 8 --out "$OUT/rollout.json" "$@" ;;
  e2e)
    T=560 run e2e python3 benchmarks/bench_e2e.py --out "$OUT/e2e_grpo.json" "$@" ;;
  train)
    T=420 run gpu_tests python3 -m pytest -q tests/test_models_fused_gpu.py tests/test_kernel_rope.py tests/test_cpu_offload.py tests/test_checkpoint_dtypes.py tests/test_trainer_resume_gpu.py
    T=450 run train python3 benchmarks/bench_train.py --case all --out-dir "$OUT" "$@" ;;
  kernels)
    T=300 run gpu_tests python3 -m pytest -q -m gpu tests/test_kernel_gae.py tests/test_kernel_logprob.py tests/test_kernel_group_advantage.py tests/test_kernel_reshard.py tests/test_kernel_paged_attention.py tests/test_kernel_sampling.py
    T=240 run kernels python3 benchmarks/bench_kernels.py --out "$OUT/kernels.json"
    T=180 run attention python3 benchmarks/bench_attention.py --out "$OUT/attention.json"
    T=120 run sampling python3 benchmarks/bench_sampling.py --out "$OUT/sampling.json" ;;
  models)
    T=200 run models_tp1 python3 -m torch.distributed.run --nproc_per_node 1 benchmarks/bench_models.py --out "$OUT/models_tp1.json"
    if [ "$NGPU" -ge 2 ]; then
      T=120 run models_tp2 python3 -m torch.distributed.run --nproc_per_node 2 benchmarks/bench_models.py --parity-only --tp 2 --out "$OUT/models_tp2.json"
    fi ;;
  ppo)
    T=330 run ppo_1p5b python3 benchmarks/bench_ppo.py --config yaml/qwen2.5-1.5b.yaml --shape qwen2.5-1.5b --nproc 1 --steps 4 --out "$OUT/ppo_1p5b.json" "$@" ;;
  partial)
    T=590 run partial python3 benchmarks/bench_partial.py --partial-batches 3 --out "$OUT/partial_rollout.json" "$@" ;;
  server)
    T=300 run server python3 benchmarks/bench_server.py --stream --agent-processes 8 --out "$OUT/server.json" "$@" ;;
  rc)
    T=400 run e2e_rc python3 benchmarks/bench_e2e.py --sides megarl,megarl_rc --steps 6 --out "$OUT/e2e_rc.json" "$@" ;;
  long)
    T=560 run long python3 benchmarks/bench_long_context.py --out "$OUT/long_context.json" "$@" ;;
  moe)
    T=560 run moe_decode python3 benchmarks/bench_moe_decode.py --hf-experts grouped_mm,eager --out "$OUT/moe_decode.json" "$@" ;;
  moe_e2e)
    T=580 run moe_e2e python3 benchmarks/bench_moe_e2e.py --out "$OUT/moe_e2e.json" --work /tmp/megarl_moe_e2e "$@" ;;
  moe_r3)  # under 100 GB of GPU memory the 8 layers fit with Adam on the host
    offload=(); [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -lt 100000 ] &&
      offload=(actor.optim.cpu_offload=true parallel.distributed_optimizer=true)
    T=560 run moe_r3 python3 benchmarks/bench_moe_e2e.py --sides '' --router-replay --work /tmp/megarl_moe_e2e \
      --out "$OUT/moe_e2e_r3run.json" --r3-out "$OUT/moe_r3.json" ${offload[@]+"${offload[@]}"} "$@" ;;
  *)
    echo "unknown mode '$mode': rollout | e2e | train | kernels | models | ppo | long | moe | moe_e2e | moe_r3 | partial | server | rc" >&2; exit 2 ;;
esac
