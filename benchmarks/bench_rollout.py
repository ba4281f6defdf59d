"""Rollout throughput: the native engine beside ``transformers.generate`` and the HBM floor.

    python benchmarks/bench_rollout.py --device cpu --out /tmp/rollout_cpu.json     # tiny model, B=32
    python benchmarks/bench_rollout.py --device cuda --shape qwen2.5-1.5b --batches 32,128,512 \
        --prompt-len 128 --new-tokens 512 --hf-batches 128 --ragged 128 --ragged-waves 8 --out rollout.json

One process (no torchrun needed). Every request is ``--prompt-len`` random
tokens and decodes exactly ``--new-tokens`` tokens (no stop token), sampled at
temperature 1. Rows: the engine (CUDA graphs on CUDA, eager on CPU) and
``generate`` (sampling, ``min_new_tokens`` = ``max_new_tokens``) on the same
checkpoint; ms per token step = wall time / new tokens (prefill included; the JSON's
``decode_ms_per_step`` and ``decode_floor_fraction``, the table's "decode %", leave the prefill steps out);
``replay ms`` is the last step's CUDA graph replayed back to back (the step without the host);
tokens/s = B * new tokens / wall time. The floor of a decode step is the bytes
it must read once — every weight but the input embedding (tied heads count
once) plus the live K/V of the batch, averaged over the steps — over the
GPU's HBM bandwidth (`bench_kernels.hbm_bytes_per_s`). ``--ragged B``
adds two runs of W x B requests (``--ragged-waves`` W, default 4) on an engine of B
slots (continuous batching refills them): lengths fixed at ``--new-tokens``,
then per-request length limits drawn uniformly from 16..1024 (what sampled EOS
does to a batch); useful tokens/s of the ragged run as a fraction of the fixed
one (``of_fixed``), beside the most that in-order admission allows for those
lengths (``fifo_slot_bound``); each is timed on its second run. Every CUDA-graph
bucket is captured before the timed runs. The checkpoint is the shipped tiny
model (``--shape tiny``) or a random-weight one made by benchmarks/make_checkpoint.py.
"""
from __future__ import annotations

import argparse
import heapq
import json
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import HBM_BYTES_PER_S  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn) -> float:
    """Wall seconds of fn(), the device drained before and after."""
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def prompts_of(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (batch, length), generator=g).tolist()


def replay_ms(engine, batch: int) -> float:
    """Device ms of one decode step: its bucket's CUDA graph replayed back to back on the static
    inputs of the last step (CUDA events, median of 5 x 20 replays)."""
    graph = engine.graphs.graphs[min(b for b in engine.graphs.graphs if b >= batch)]
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 20)
    return sorted(times)[2]


def checkpoint(shape: str, work: str, prompt_len: int) -> str:
    if shape == "tiny":
        from megarl.assets import TINY_DIR

        return str(TINY_DIR / "sft")
    out = os.path.join(work, shape)
    if not os.path.isfile(os.path.join(out, "config.json")):
        subprocess.run([sys.executable, "benchmarks/make_checkpoint.py", "--shape", shape, "--out", out,
                        "--prompt-len", str(prompt_len), "--prompts", "16"], cwd=ROOT, check=True)
    return out


def start_distributed() -> None:
    from megarl.distributed.ranks import free_port

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))


def build_model(path: str, args):
    """This process's GPTModel of the checkpoint (TP1, PP1): (module, info, groups)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.config import Config
    from megarl.distributed import build_parallel_groups, init_distributed
    from megarl.roles.build import build_module

    init_distributed()
    groups = build_parallel_groups(1, 1)
    model_parallel_cuda_manual_seed(0)
    cfg = Config()
    cfg.model.path, cfg.model.dtype = path, args.dtype
    cfg.data.max_prompt_len, cfg.rollout.max_new_tokens = args.prompt_len, 1024
    module, info = build_module(path, cfg, groups)
    return module, info, groups


def make_engine(module, info, groups, args, max_len: int, max_batch: int):
    from megarl.rollout.native import EngineOptions, NativeEngine

    options = EngineOptions(max_batch=max_batch, cuda_graphs=not args.eager, max_model_len=max_len)
    return NativeEngine(module, groups, info.vocab_size, [], 0, options)


def floor_ms(module, info, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Bytes one decode step must read (weights + mean live K/V) over the HBM bandwidth, in ms."""
    params = dict(module.named_parameters())
    weights = sum(p.numel() * p.element_size() for n, p in params.items()
                  if not (n.startswith("embedding.") and not info.tied_embeddings))
    item = next(iter(params.values())).element_size()
    kv_per_token = 2 * info.num_layers * info.num_groups * info.head_dim * item
    kv = batch * (prompt_len + new_tokens / 2) * kv_per_token
    return (weights + kv) / HBM_BYTES_PER_S * 1e3


def engine_rows(engine, module, info, args) -> list[dict]:
    from megarl.rollout.engine import SamplingParams, sample_requests

    rows = []
    for b in args.batches:
        prompts = prompts_of(b, args.prompt_len, info.vocab_size)
        engine.generate(sample_requests(prompts, 1, 0, 4), SamplingParams(temperature=1.0))  # captures bucket b
        params, requests = SamplingParams(temperature=1.0), sample_requests(prompts, 1, 1, args.new_tokens)
        seconds = timed(lambda: engine.generate(requests, params))
        row = {"provider": "megarl", "batch": b, "seconds": seconds, "ms_per_step": seconds / args.new_tokens * 1e3,
               "tokens_per_s": b * args.new_tokens / seconds, **engine.stats}
        if engine.device.type == "cuda":
            row["replay_ms"] = replay_ms(engine, b) if engine.graphs is not None else None  # at the last step
            row["floor_ms"] = floor_ms(module, info, b, args.prompt_len, args.new_tokens)
            row["floor_fraction"] = row["floor_ms"] / row["ms_per_step"]
            # the same without the prefill steps (the target's ms_per_step keeps them): the decode loop alone
            decode_s = seconds - row.get("timing/rollout_prefill", 0.0)
            row["decode_ms_per_step"] = decode_s / max(args.new_tokens - 1, 1) * 1e3
            row["decode_floor_fraction"] = row["floor_ms"] / row["decode_ms_per_step"]
        rows.append(row)
    return rows


def capture_buckets(engine, prompts) -> None:
    """One short generate per CUDA-graph batch size, so no capture lands in a timed run."""
    from megarl.rollout.engine import SamplingParams, sample_requests
    from megarl.rollout.graphs import buckets_up_to

    for b in buckets_up_to(engine.options.max_batch) if engine.graphs is not None else [len(prompts)]:
        engine.generate(sample_requests(prompts[:b], 1, 0, 3), SamplingParams(temperature=1.0))


def ragged_rows(module, info, groups, args) -> list[dict]:
    """W x B requests on B slots (W = --ragged-waves): lengths fixed at --new-tokens, then drawn from 16..1024."""
    b, n = args.ragged, args.ragged_waves * args.ragged
    engine = make_engine(module, info, groups, args, args.prompt_len + 1024, max_batch=b)
    prompts = prompts_of(n, args.prompt_len, info.vocab_size, seed=3)
    capture_buckets(engine, prompts)
    g = torch.Generator().manual_seed(7)
    cases = {"megarl-fixed-refill": [args.new_tokens] * n,
             "megarl-ragged": torch.randint(16, 1025, (n,), generator=g).tolist()}
    rows = []
    for name, limits in cases.items():
        rows.append(_ragged_run(engine, prompts, name, limits, b))
    rows[-1]["of_fixed"] = rows[-1]["tokens_per_s"] / rows[0]["tokens_per_s"]
    rows[-1]["fifo_slot_bound"] = fifo_slot_bound(cases["megarl-ragged"], b)
    engine.release_memory()
    return rows


def fifo_slot_bound(limits: list[int], slots: int) -> float:
    """Useful share of slot-steps when each request, in order, takes the first free slot: sum(limits) over
    slots x the last finish (decode steps; no prefill cost, no step cheaper at a small batch). ``of_fixed``
    cannot pass this without knowing lengths up front, which a sampler that stops at EOS does not."""
    free_at = [0] * slots  # heap: the step each slot frees up
    for n in limits:
        heapq.heappush(free_at, heapq.heappop(free_at) + n)
    return sum(limits) / (slots * max(free_at))


def _ragged_run(engine, prompts, name: str, limits: list[int], b: int) -> dict:
    from megarl.rollout.engine import SamplingParams, sample_requests

    params, requests = SamplingParams(temperature=1.0), sample_requests(prompts, 1, 2, limits)
    engine.generate(requests, params)  # untimed: captures the prefill graphs its refills use
    seconds = timed(lambda: engine.generate(requests, params))
    return {"provider": name, "batch": b, "requests": len(prompts), "seconds": seconds, "useful_tokens": sum(limits),
            "tokens_per_s": sum(limits) / seconds, "lengths": [min(limits), max(limits)], **engine.stats}


def hf_rows(path: str, info, args) -> list[dict]:
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    device = "cuda" if args.device == "cuda" else "cpu"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    rows = []
    for b in args.hf_batches:
        ids = torch.tensor(prompts_of(b, args.prompt_len, info.vocab_size), device=device)

        def run(n):
            with torch.no_grad():
                model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                               top_k=None, top_p=1.0, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)

        run(4)
        seconds = timed(lambda: run(args.new_tokens))
        rows.append({"provider": "transformers.generate", "batch": b, "seconds": seconds,
                     "ms_per_step": seconds / args.new_tokens * 1e3, "tokens_per_s": b * args.new_tokens / seconds})
    del model
    return rows


def table(rows: list[dict]) -> str:
    def cell(r, key, fmt, width):
        return f"{r[key]:{width}{fmt}}" if r.get(key) is not None else " " * width

    def pct(r, key):
        return f"{100 * r[key]:7.1f}%" if r.get(key) is not None else " " * 8

    lines = [f"{'provider':>22} {'B':>5} {'ms/step':>9} {'replay ms':>10} {'tokens/s':>10} {'floor ms':>9} {'% floor':>8}"
             f" {'decode %':>8} {'% fixed':>8} {'FIFO max':>8}"]
    for r in rows:
        lines.append(f"{r['provider']:>22} {r['batch']:>5} {cell(r, 'ms_per_step', '.2f', 9)} "
                     f"{cell(r, 'replay_ms', '.2f', 10)} {cell(r, 'tokens_per_s', '.0f', 10)} "
                     f"{cell(r, 'floor_ms', '.3f', 9)} {pct(r, 'floor_fraction')} {pct(r, 'decode_floor_fraction')} "
                     f"{pct(r, 'of_fixed')} "
                     f"{pct(r, 'fifo_slot_bound')}".rstrip())
    return "\n".join(lines)


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default=None, help="tiny (default on CPU) | qwen2.5-1.5b | llama2-7b")
    ap.add_argument("--batches", default=None, help="comma-separated engine batch sizes")
    ap.add_argument("--hf-batches", default=None, help="comma-separated transformers.generate batch sizes (0: none)")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--ragged", type=int, default=0, help="batch size of the ragged-length run (0: none)")
    ap.add_argument("--ragged-waves", type=int, default=4,
                    help="requests of the ragged runs per slot: the drain tail's share shrinks as it grows")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--work", default="/tmp/megarl_bench")
    ap.add_argument("--out", default="bench_rollout.json")
    args = ap.parse_args()
    cpu = args.device == "cpu"
    args.shape = args.shape or ("tiny" if cpu else "qwen2.5-1.5b")
    args.batches = [int(x) for x in (args.batches or ("32" if cpu else "32,128,512")).split(",")]
    args.hf_batches = [int(x) for x in (args.hf_batches or ("32" if cpu else "128")).split(",") if x and int(x) > 0]
    args.prompt_len = args.prompt_len or (20 if cpu else 128)
    args.new_tokens = args.new_tokens or (32 if cpu else 512)
    args.dtype = "float32" if cpu else "bfloat16"
    return args


def main() -> None:
    args = parse()
    start_distributed()
    path = checkpoint(args.shape, args.work, args.prompt_len)
    module, info, groups = build_model(path, args)
    engine = make_engine(module, info, groups, args, args.prompt_len + args.new_tokens, max(args.batches))
    rows = engine_rows(engine, module, info, args)
    engine.release_memory()
    if args.ragged:
        rows += ragged_rows(module, info, groups, args)
    rows += hf_rows(path, info, args)
    result = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "shape": args.shape, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "torch_threads": torch.get_num_threads(), "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(table(rows))


if __name__ == "__main__":
    main()
