"""MoE decode: the native engine on the full Qwen3-30B-A3B shape, beside ``transformers.generate`` and the HBM floor.

    python benchmarks/bench_moe_decode.py --hf-experts grouped_mm,eager --out benchmarks/results/moe_decode.json
    python benchmarks/bench_moe_decode.py --layers 12 --batches 128                    # fewer layers, one batch
    python benchmarks/bench_moe_decode.py --tiny --out /tmp/moe_decode_tiny.json       # CPU smoke run

One process, no checkpoint: the model (``make_checkpoint.SHAPES["qwen3-30b-a3b"]``: 48 layers, hidden
2048, 128 experts of FFN 768, top-8, 32 query / 4 KV heads of 128, vocab 151936; ~61 GB in bf16) is
megarl's GPTModel built in bf16 on the GPU with megatron-core's random init (std 0.02: router
logits of std ~1, so tokens spread over the experts). ``Qwen3MoeForCausalLM`` is then built on the
meta device and every parameter set to a tensor of that model (:func:`hf_twin`): the experts, router,
norms, o_proj, embedding and head are views of the same storage; only q/k/v are copies (megatron
fuses them per KV group, ~1 GB in all). Its logits are compared with megarl's on a short batch
(``hf_logits_max_diff``), so ``generate`` runs the same model.

Rows, one per batch size B (``--batches``): B random prompts of ``--prompt-len`` tokens, each
decoding exactly ``--new-tokens`` (no stop token), temperature 1, CUDA graphs.
``ms_per_step`` = wall / new tokens (prefill included); ``decode_ms_per_step`` leaves the prefill
out. ``generate_ms_per_step``: ``generate`` on the same prompts (sampling), timed at 1 and at
1 + ``--hf-steps`` new tokens (the fastest of 3 runs each), the difference over ``--hf-steps``
(decode steps only, no prefill), with transformers' default experts implementation (``grouped_mm``);
``--hf-experts`` adds others (``eager``: a Python loop over the experts hit), each in ``generate_by_experts``.

The floor of a decode step is the bytes it must read once over the HBM bandwidth
(`bench_kernels.HBM_BYTES_PER_S`): every dense weight but the input embedding (attention, norms,
routers, head), the experts the step selects (``distinct_experts``: the mean over MoE layers and
decode steps of distinct experts chosen by the B rows, measured from a recorded eager rerun of
``--route-steps`` steps of the same requests; ``uniform_experts`` is E(1 - (1 - k/E)^B) beside it),
and the live K/V (B x (prompt + new/2) tokens). ``pct_of_floor`` = floor / ms_per_step;
``speedup_vs_generate`` = generate_ms_per_step / decode_ms_per_step (both without prefill).
``peak_memory`` (GiB, max allocated per phase).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import HBM_BYTES_PER_S  # noqa: E402
from bench_rollout import prompts_of, start_distributed, sync, timed  # noqa: E402
from make_checkpoint import SHAPES  # noqa: E402

GIB = 2 ** 30


def hf_config(shape: str, layers: int | None):
    """The ``transformers.Qwen3MoeConfig`` of ``shape`` (``layers``: fewer layers)."""
    import transformers

    kwargs = {k: v for k, v in SHAPES[shape].items() if k != "arch"}
    if layers:
        kwargs["num_hidden_layers"] = layers
    config = transformers.Qwen3MoeConfig(**kwargs, pad_token_id=0, eos_token_id=None, bos_token_id=None)
    config.architectures = ["Qwen3MoeForCausalLM"]
    return config


def build_megarl(config, args):
    """(module, info, groups): the GPTModel of ``config``, random init, TP1 / EP1, in ``args.dtype``."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.distributed import build_parallel_groups, init_distributed
    from megarl.models import ModelOptions, build_gpt_model, read_hf_config

    init_distributed()
    groups = build_parallel_groups(1, 1)
    model_parallel_cuda_manual_seed(0)
    info = read_hf_config(config.to_dict())
    opts = ModelOptions(params_dtype={"bfloat16": "bf16", "float32": "fp32"}[args.dtype],
                        seq_length=args.prompt_len + args.new_tokens, moe_experts=args.moe_experts)
    with torch.no_grad():
        module = build_gpt_model(info, groups, opts).eval()
    for p in module.parameters():
        p.requires_grad_(False)
    return module, info, groups


def hf_tensors(module, info) -> dict[str, torch.Tensor]:
    """HF parameter name -> the megarl tensor it is (a view where the layouts agree, else a copy)."""
    from megarl.models import layouts
    from megarl.models.weight_map import GROUPED_DOWN, GROUPED_GATE_UP, QKV, VOCAB, model_rules

    params, out = dict(module.named_parameters()), {}
    experts: dict[str, list] = {}  # SequentialMLP (CPU / fp32): per-expert tensors, stacked below
    for name, rule in model_rules(module, info).items():
        p, layer = params[name].detach(), rule.hf_names[0].split(".mlp.")[0]
        if rule.kind == QKV:
            out.update(zip(rule.hf_names, layouts.split_qkv(p, info.num_groups, info.num_heads)))
        elif rule.kind == VOCAB:
            out[rule.hf_names[0]] = p[:info.vocab_size]
        elif rule.kind == GROUPED_GATE_UP:  # weight1 (h, E*2F) is (E, h, 2F) -> (E, 2F, h)
            experts_h = p.view(info.moe.num_experts, info.hidden_size, -1)  # (E, h, 2F)
            out[f"{layer}.mlp.experts.gate_up_proj"] = experts_h.transpose(1, 2)
        elif rule.kind == GROUPED_DOWN:  # weight2 (E*F, h) is (E, F, h) -> (E, h, F)
            out[f"{layer}.mlp.experts.down_proj"] = p.view(info.moe.num_experts, -1, info.hidden_size).transpose(1, 2)
        elif rule.kind in ("expert_gate_up", "expert_down"):
            which = "gate_up_proj" if rule.kind == "expert_gate_up" else "down_proj"
            experts.setdefault(f"{layer}.mlp.experts.{which}", []).append(p)  # local expert order
        else:  # replicated / row at TP1: the tensor itself
            out[rule.hf_names[0]] = p
    out.update({k: torch.stack(v) for k, v in experts.items()})
    return out


def hf_twin(module, info, config):
    """``Qwen3MoeForCausalLM`` whose parameters are :func:`hf_tensors` (no weight of its own):
    (model, names of the parameters that are copies rather than views, their bytes)."""
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding

    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(config)
    tensors = hf_tensors(module, info)
    storages = {p.untyped_storage().data_ptr() for p in module.parameters()}
    names = [n for n, _ in model.named_parameters()]
    if set(names) != set(tensors):
        raise RuntimeError(f"HF / megarl names differ: {sorted(set(names) ^ set(tensors))[:6]}")
    copied, copied_bytes = [], 0
    for name in names:
        owner, attr = model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
        t = tensors[name]
        if tuple(t.shape) != tuple(getattr(owner, attr).shape):
            raise RuntimeError(f"{name}: megarl {tuple(t.shape)} vs HF {tuple(getattr(owner, attr).shape)}")
        setattr(owner, attr, torch.nn.Parameter(t, requires_grad=False))
        if t.untyped_storage().data_ptr() not in storages:
            copied.append(name)
            copied_bytes += t.numel() * t.element_size()
    device = next(module.parameters()).device
    model.model.rotary_emb = Qwen3MoeRotaryEmbedding(config).to(device)  # its buffers, off the meta device
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"tensors left on the meta device: {left[:6]}")
    return model.eval(), copied, copied_bytes


def logits_diff(module, model, groups, info) -> float:
    """(max |megarl - HF|, max |megarl|) logits on 2 x 16 random tokens (fp32: rounding only; bf16: reported)."""
    from megarl.models import forward_logits

    device = next(module.parameters()).device
    ids = torch.tensor(prompts_of(2, 16, info.vocab_size, seed=5), device=device)
    pos = torch.arange(16, device=device).expand(2, 16)
    ours = forward_logits(module, groups, ids, pos, vocab_size=info.vocab_size).float()
    with torch.no_grad():
        theirs = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()
    return float((ours - theirs).abs().max()), float(ours.abs().max())


def make_engine(module, info, groups, args, max_batch: int, record: bool = False):
    from megarl.rollout.native import EngineOptions, NativeEngine

    options = EngineOptions(max_batch=max_batch, cuda_graphs=not (args.eager or record), record_experts=record,
                            max_model_len=args.prompt_len + args.new_tokens)
    return NativeEngine(module, groups, info.vocab_size, [], 0, options)


def engine_row(engine, info, b: int, args) -> dict:
    """One timed generate of B x --new-tokens after an untimed short one (captures B's graphs)."""
    from megarl.rollout.engine import SamplingParams, sample_requests

    prompts, params = prompts_of(b, args.prompt_len, info.vocab_size), SamplingParams(temperature=1.0)
    engine.generate(sample_requests(prompts, 1, 0, 4), params)
    requests = sample_requests(prompts, 1, 1, args.new_tokens)
    seconds = timed(lambda: engine.generate(requests, params))
    decode_s = seconds - engine.stats.get("timing/rollout_prefill", 0.0)
    return {"B": b, "seconds": seconds, "ms_per_step": seconds / args.new_tokens * 1e3,
            "decode_ms_per_step": decode_s / max(args.new_tokens - 1, 1) * 1e3,
            "tokens_per_s": b * args.new_tokens / seconds, "engine_stats": dict(engine.stats)}


def distinct_experts(engine, info, b: int, args) -> float:
    """Mean over MoE layers and decode steps of the distinct experts B rows select (the requests of the
    timed run, its first --route-steps tokens, recorded by an eager engine)."""
    from megarl.rollout.engine import SamplingParams, sample_requests

    prompts = prompts_of(b, args.prompt_len, info.vocab_size)
    results = engine.generate(sample_requests(prompts, 1, 1, args.route_steps + 1), SamplingParams(temperature=1.0))
    ids = torch.from_numpy(__import__("numpy").stack([r.expert_ids for r in results])).long()  # (B, R, L, k)
    ids = ids[:, 1:]  # token 0 comes from the prefill
    seen = torch.zeros(ids.shape[1], ids.shape[2], info.moe.num_experts, dtype=torch.bool)  # (R-1, L, E)
    steps, layers = torch.meshgrid(torch.arange(ids.shape[1]), torch.arange(ids.shape[2]), indexing="ij")
    for row in ids:  # (R-1, L, k)
        seen[steps[..., None], layers[..., None], row] = True
    return float(seen.sum(-1).float().mean())


def floor_ms(module, info, b: int, experts: float, args) -> float:
    """Bytes one decode step must read (dense weights, ``experts`` experts a layer, mean live K/V) / HBM."""
    dense, expert_bytes = 0, 0
    for name, p in module.named_parameters():
        nbytes = p.numel() * p.element_size()
        if ".mlp.experts." in name:
            expert_bytes += nbytes
        elif not (name.startswith("embedding.") and not info.tied_embeddings):
            dense += nbytes
    per_expert = expert_bytes / (info.num_layers * info.moe.num_experts)
    item = next(module.parameters()).element_size()
    kv = b * (args.prompt_len + args.new_tokens / 2) * 2 * info.num_layers * info.num_groups * info.head_dim * item
    return (dense + experts * per_expert * info.num_layers + kv) / HBM_BYTES_PER_S * 1e3


def generate_ms(model, info, b: int, args) -> float:
    """ms per decode step of ``generate``: (time(1 + n new tokens) - time(1)) / n, after a warm-up, each
    time the fastest of 3 runs."""
    device = next(model.parameters()).device
    ids = torch.tensor(prompts_of(b, args.prompt_len, info.vocab_size), device=device)

    def run(n: int) -> float:
        with torch.no_grad():
            return timed(lambda: model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=None, top_p=1.0,
                max_new_tokens=n, min_new_tokens=n, pad_token_id=0))

    run(2)
    best = lambda n: min(run(n) for _ in range(3))  # noqa: E731  (the fastest of 3: a busy host only adds)
    return (best(1 + args.hf_steps) - best(1)) / args.hf_steps * 1e3


class Peaks:
    """Max allocated device memory per phase (GiB; None on CPU)."""

    def __init__(self):
        self.by_phase: dict[str, float | None] = {}

    def mark(self, phase: str) -> None:
        cuda = torch.cuda.is_available()
        self.by_phase[phase] = torch.cuda.max_memory_allocated() / GIB if cuda else None
        if cuda:
            torch.cuda.reset_peak_memory_stats()


def engine_rows(module, info, groups, args, peaks: Peaks) -> list[dict]:
    engine = make_engine(module, info, groups, args, max(args.batches))
    rows = [engine_row(engine, info, b, args) for b in args.batches]
    engine.release_memory()
    del engine
    gc.collect()  # the graphs' memory pools go with the engine
    peaks.mark("engine_decode")
    recorder = make_engine(module, info, groups, args, max(args.batches), record=True)
    for row in rows:
        b, e, k = row["B"], info.moe.num_experts, info.moe.topk
        row["distinct_experts"] = distinct_experts(recorder, info, b, args)
        row["uniform_experts"] = e * (1 - (1 - k / e) ** b)
        row["floor_ms"] = floor_ms(module, info, b, row["distinct_experts"], args)
        row["pct_of_floor"] = row["floor_ms"] / row["ms_per_step"]
        row["decode_pct_of_floor"] = row["floor_ms"] / row["decode_ms_per_step"]
    recorder.release_memory()
    del recorder
    gc.collect()
    peaks.mark("expert_count")
    return rows


def generate_rows(module, info, config, groups, rows: list[dict], args, peaks: Peaks) -> dict:
    """Fills each row's generate numbers; returns what the JSON says about the HF model."""
    model, copied, copied_bytes = hf_twin(module, info, config)
    suffixes = sorted({n.split(".")[-2] if n.endswith(".weight") else n.split(".")[-1] for n in copied})
    diff, size = logits_diff(module, model, groups, info)
    twin = {"copied_gb": copied_bytes / GIB, "copied_bytes": copied_bytes, "copied_kinds": suffixes,
            "logits_max_diff": diff, "logits_max_abs": size,
            "experts_implementations": args.hf_experts}
    for impl in args.hf_experts:
        model.set_experts_implementation(impl)
        for row in rows:
            row.setdefault("generate_by_experts", {})[impl] = generate_ms(model, info, row["B"], args)
    for row in rows:
        row["generate_ms_per_step"] = row["generate_by_experts"][args.hf_experts[0]]
        row["speedup_vs_generate"] = row["generate_ms_per_step"] / row["decode_ms_per_step"]
    peaks.mark("generate")
    return twin


def table(rows: list[dict]) -> str:
    lines = [f"{'B':>5} {'ms/step':>9} {'decode ms':>10} {'floor ms':>9} {'% floor':>8} {'experts':>8} "
             f"{'generate ms':>12} {'speedup':>8}"]
    for r in rows:
        lines.append(f"{r['B']:>5} {r['ms_per_step']:9.2f} {r['decode_ms_per_step']:10.2f} {r['floor_ms']:9.3f} "
                     f"{100 * r['pct_of_floor']:7.1f}% {r['distinct_experts']:8.1f} "
                     f"{r['generate_ms_per_step']:12.2f} {r['speedup_vs_generate']:7.1f}x")
    return "\n".join(lines)


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: qwen3-moe-tiny, fp32, eager, few tokens")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default 32,128,256)")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 128")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 512")
    ap.add_argument("--hf-steps", type=int, default=None, help="decode steps of generate timed at each B (default 16)")
    ap.add_argument("--hf-experts", default="grouped_mm", help="comma list of transformers experts implementations "
                    "(grouped_mm, eager, batched_mm); the first is the one speedup_vs_generate uses")
    ap.add_argument("--route-steps", type=int, default=8, help="decode steps whose expert choices are counted")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None, help="default: bf16 (--tiny: fp32)")
    ap.add_argument("--moe-experts", choices=("auto", "grouped", "sequential"), default="auto",
                    help="megatron experts module (auto: GroupedMLP on CUDA in bf16)")
    ap.add_argument("--out", default="benchmarks/results/moe_decode.json")
    args = ap.parse_args()
    tiny = {"batches": "2,5", "prompt_len": 12, "new_tokens": 6, "hf_steps": 3}
    full = {"batches": "32,128,256", "prompt_len": 128, "new_tokens": 512, "hf_steps": 16}
    for key, value in (tiny if args.tiny else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.shape = "qwen3-moe-tiny" if args.tiny else "qwen3-30b-a3b"
    args.batches = [int(x) for x in args.batches.split(",")]
    args.hf_experts = args.hf_experts.split(",")
    args.dtype = args.dtype or ("float32" if args.tiny else "bfloat16")
    if not args.tiny and not torch.cuda.is_available():
        ap.error("the full shape needs a GPU; use --tiny on CPU")
    return args


def main() -> None:
    args = parse()
    start_distributed()
    config = hf_config(args.shape, args.layers)
    peaks, start = Peaks(), time.perf_counter()
    module, info, groups = build_megarl(config, args)
    sync()
    build_s = time.perf_counter() - start
    peaks.mark("weights")
    shape = {k: v for k, v in config.to_dict().items() if k in (
        "num_hidden_layers", "hidden_size", "num_experts", "num_local_experts", "moe_intermediate_size",
        "num_experts_per_tok", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size")}
    result = {"shape": dict(shape, name=args.shape, dtype=args.dtype,
                            weights_gb=sum(p.numel() * p.element_size() for p in module.parameters()) / GIB),
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "hf_steps": args.hf_steps,
              "route_steps": args.route_steps, "hbm_bytes_per_s": HBM_BYTES_PER_S, "build_s": build_s,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "peak_memory": peaks.by_phase}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    result["rows"] = engine_rows(module, info, groups, args, peaks)
    write_json(args.out, result)  # the engine's rows stay if generate fails or runs out of time
    result["hf_twin"] = generate_rows(module, info, config, groups, result["rows"], args, peaks)
    write_json(args.out, result)
    print(f"wrote {args.out}; HF twin: {result['hf_twin']}; peak GiB {peaks.by_phase}\n" + table(result["rows"]))


def write_json(path: str, result: dict) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
