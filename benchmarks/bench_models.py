"""GPU checks of the model path: bf16 parity with transformers, and training throughput.

    torchrun --nproc_per_node 1 benchmarks/bench_models.py --out results.json
    torchrun --nproc_per_node 2 benchmarks/bench_models.py --parity-only --tp 2 --out tp2.json

parity: a random Qwen2-shaped checkpoint (GQA, QKV bias) is loaded into the
Megatron model at the given TP; its bf16 logits are compared with the
``transformers`` model's bf16 logits, both against the fp32 ``transformers``
logits (the rounding floor), plus greedy-token agreement.
throughput: forward + backward of a Llama-2-7B-shaped GPTModel (bf16, random
init) on 4 x 1024 tokens with megatron-core's vocab-parallel cross entropy,
SDPA core attention against the local spec's unfused attention; CUDA events
after warm-up, median of the timed iterations.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from megarl.distributed import build_parallel_groups, init_distributed
from megarl.models.builder import ModelOptions, build_gpt_model
from megarl.models.hf_config import read_hf_config
from megarl.models.loader import load_hf_checkpoint
from megarl.models.pipeline import forward_logits

LLAMA2_7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000,
             "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 4096,
             "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}


def make_parity_checkpoint(path: str) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                      num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048,
                      tie_word_embeddings=False, initializer_range=0.02)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)


def hf_logits(path: str, ids: torch.Tensor, dtype) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()
    with torch.no_grad():
        return model(ids).logits.float()


def parity(groups, path: str) -> dict:
    info = read_hf_config(path)
    model = build_gpt_model(info, groups, ModelOptions(params_dtype="bf16", seq_length=512))
    load_hf_checkpoint(model, path, info, groups)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, info.vocab_size, (4, 512), generator=gen).cuda()
    pos = torch.arange(512, device="cuda").expand(4, -1)
    ours = forward_logits(model.eval(), groups, ids, pos, vocab_size=info.vocab_size).float()
    ref32, ref16 = hf_logits(path, ids, torch.float32), hf_logits(path, ids, torch.bfloat16)
    err = lambda x: (x - ref32).abs()
    return {
        "megarl_bf16_vs_hf_fp32_max": float(err(ours).max()), "megarl_bf16_vs_hf_fp32_mean": float(err(ours).mean()),
        "hf_bf16_vs_hf_fp32_max": float(err(ref16).max()), "hf_bf16_vs_hf_fp32_mean": float(err(ref16).mean()),
        "megarl_vs_hf_bf16_max": float((ours - ref16).abs().max()),
        "greedy_agreement_vs_hf_fp32": float((ours.argmax(-1) == ref32.argmax(-1)).float().mean()),
    }


def time_fwd_bwd(model, ids, iters: int = 10, warmup: int = 3) -> float:
    """Median seconds of forward + backward with megatron's vocab-parallel cross entropy."""
    pos = torch.arange(ids.size(1), device="cuda").expand_as(ids)
    times = []
    for i in range(warmup + iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = model(ids, pos, None, labels=ids).float().mean()  # (b, s) per-token losses
        loss.backward()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end) / 1e3)
        model.zero_grad(set_to_none=True)
    return statistics.median(times)


def throughput(groups, backend: str, batch: int = 4, seq: int = 1024) -> dict:
    info = read_hf_config(LLAMA2_7B)
    torch.cuda.reset_peak_memory_stats()
    model = build_gpt_model(info, groups, ModelOptions(params_dtype="bf16", attention_backend=backend,
                                                       layer_spec="local", seq_length=seq))
    ids = torch.randint(0, info.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0)).cuda()
    seconds = time_fwd_bwd(model, ids)
    params = sum(p.numel() for p in model.parameters())
    tokens = batch * seq
    # 6 N per token for the matmuls plus causal attention (QK^T and PV, fwd + bwd: 6 * s * h per layer / 2).
    flops = 6 * params * tokens + 6 * info.num_layers * seq * info.hidden_size * tokens
    del model
    return {"backend": backend, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "tflops": flops / seconds / 1e12, "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_models.json")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--parity-only", action="store_true")
    args = ap.parse_args()
    init_distributed()
    groups = build_parallel_groups(tp=args.tp)
    model_parallel_cuda_manual_seed(0)
    result = {"gpu": torch.cuda.get_device_name(), "tp": args.tp}
    path = "/tmp/megarl_parity_ckpt"  # one path for every rank of this host
    if dist.get_rank() == 0:
        make_parity_checkpoint(path)
    dist.barrier()
    result["parity_bf16"] = parity(groups, path)
    if not args.parity_only:
        result["throughput"] = [throughput(groups, b) for b in ("local", "sdpa")]
    if dist.get_rank() == 0:
        print(json.dumps(result, indent=1))
        print(f"\n{'attention':>10} {'tokens/s':>10} {'TFLOP/s':>8} {'peak GB':>8}")
        for r in result.get("throughput", []):
            print(f"{r['backend']:>10} {r['tokens_per_s']:>10.0f} {r['tflops']:>8.1f} {r['peak_memory_gb']:>8.1f}")
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
