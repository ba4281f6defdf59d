"""The decode loop taken apart, for `bench_rollout.py` (``--profile``, ``--busy``, ``--prefill``): one step's
CUDA graph replayed at a fixed state, a whole generate under torch.profiler, prefills alone; and the timing
helpers the benchmark shares with them (``sync``, ``timed``, ``prompts_of``, ``replay_ms``).

``profile_decode``: the last step of a generate that decodes N tokens, replayed back to back (device time
alone) and under torch.profiler (kernels per step, the decode attention's mean, the rows it holds).
``prefill_rows``: prefill-only calls, their top kernels and (``host_gaps``) the GPU's idle gaps with the
host work beside them. ``busy_row``: how much of a generate's
span the GPU was busy, its idle gaps by size, and per decode step (``decode_steps_of``) spans and each
kernel's mean time.
"""
from __future__ import annotations

import json
import os
import time

import torch


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn) -> float:
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


def prefill_rows(engine, module, info, args) -> list[dict]:
    """Prefill-only generate calls (one new token): is a prefill host- or device-bound?"""
    from torch.profiler import ProfilerActivity, profile

    from megarl.rollout.engine import SamplingParams, sample_requests

    dense = sum(p.numel() for n, p in module.named_parameters() if not n.startswith("embedding."))
    rows = []
    for case in args.prefill:
        n, length = (int(x) for x in case.split("x"))
        requests = sample_requests(prompts_of(n, length, info.vocab_size, seed=7), 1, 0, 1)
        run = lambda: engine.generate(requests, SamplingParams(temperature=1.0))  # noqa: E731
        run()
        wall = sorted(timed(run) for _ in range(5))[2]
        device_ms = None
        if engine.device.type == "cuda":
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                run()
                sync()
            events = prof.key_averages()
            device_ms = sum(e.self_device_time_total for e in events) / 1e3
            print(f"prefill {case}: top kernels, ms per call", flush=True)
            for e in sorted(events, key=lambda e: -e.self_device_time_total)[:12]:
                print(f"  {e.self_device_time_total / 1e3:8.2f} x{e.count:<5} {e.key[:90]}", flush=True)
            gaps = host_gaps(run, args.work)
            print(f"prefill {case}: GPU idle gaps >= 100 us ({sum(g['gap_us'] for g in gaps) / 1e3:.2f} ms), "
                  "the host work beside each (us)", flush=True)
            for g in gaps:
                print(f"  at {g['at_us'] / 1e3:7.2f} ms: {g['gap_us']:7.0f}  {g['host']}", flush=True)
        rows.append({"provider": "megarl-prefill", "batch": n, "prompt_len": length, "wall_ms": wall * 1e3,
                     "device_ms": device_ms, "tflops_wall": 2 * dense * n * length / wall / 1e12})
        print(rows[-1], flush=True)
    return rows


def profile_decode(engine, info, args, steps: int) -> dict:
    """One decode step at B = --profile, taken apart: the last step of a generate call that decodes
    ``steps`` tokens against back-to-back replays of its CUDA graph (device time alone, CUDA
    events, median of 5 x 20), and torch.profiler over 10 replays: kernels per step, the top ones
    by device time in <out>.profile.txt (the prefill is not in it; the last ``steps`` value's)."""
    from megarl.rollout.engine import SamplingParams, sample_requests

    # prompts + decoded tokens as long as the timed runs' mean context, so the attention reads as much
    prompts = prompts_of(args.profile, max(args.prompt_len + args.new_tokens // 2 - steps, 1), info.vocab_size, seed=5)
    params, requests = SamplingParams(temperature=1.0), sample_requests(prompts, 1, 0, steps)
    engine.generate(requests, params)  # warm-up: compile, capture
    row = {"provider": "megarl-profile", "batch": args.profile, "decode_steps": steps, "graphs": engine.graphs is not None}
    if engine.graphs is None or not torch.cuda.is_available():
        return row
    bucket = min(b for b in engine.graphs.graphs if b >= args.profile)
    graph = engine.graphs.graphs[bucket]  # its static inputs still hold the last step's batch
    row["replay_ms"] = replay_ms(engine, args.profile)
    events = profiled_replays(graph)
    with open(args.out + ".profile.txt", "w") as f:
        f.write(events.table(sort_by="self_cuda_time_total", row_limit=40))
    kernels = sum(e.count for e in events if "CUDA" in str(getattr(e, "device_type", ""))) / 10
    row |= {"kernels_per_step": kernels or None, "decode_attention_us": attention_us(events),
            **replayed_rows(engine, bucket)}
    if row["replay_rows"] < args.profile:
        print(f"--profile: the replayed step holds {row['replay_rows']} of {args.profile} rows (later prefill chunks "
              "finished later); take more --profile-decode steps for a full batch", flush=True)
    print(row, flush=True)
    return row


def profiled_replays(graph, replays: int = 10):
    """torch.profiler's per-kernel averages over ``replays`` back-to-back replays of ``graph``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        sync()
    return prof.key_averages()


def attention_us(events) -> float | None:
    """Mean device us of one decode-attention call in ``profiled_replays``' averages."""
    times = [e.self_device_time_total / e.count for e in events if e.key == "_decode_kernel" and e.count]
    return times[0] if times else None


def replayed_rows(engine, b: int) -> dict:
    """What the replayed step holds: rows with keys, and their fewest / mean / most keys."""
    from megarl.rollout.graphs import _ROW_FIELDS

    lens = engine.graphs.inputs[_ROW_FIELDS.index("seq_lens"), :b].float()
    live = lens[lens > 0]
    return {"replay_rows": int(live.numel()), "replay_keys_min_mean_max":
            [float(live.min()), round(float(live.mean()), 1), float(live.max())] if live.numel() else None}


def busy_row(engine, info, args) -> dict:
    """One generate at B = --busy (the timed runs' lengths) under torch.profiler: the GPU's busy time
    (the union of kernel, copy and memset intervals) against the span from its first to its last,
    and the idle gaps between them by size, in us."""
    from megarl.rollout.engine import SamplingParams, sample_requests

    prompts = prompts_of(args.busy, args.prompt_len, info.vocab_size, seed=6)
    params, requests = SamplingParams(temperature=1.0), sample_requests(prompts, 1, 1, args.new_tokens)
    engine.generate(requests, params)  # warm-up: compile, capture
    seconds, events = traced(lambda: timed(lambda: engine.generate(requests, params)), args.work)
    spans = device_spans(events)
    gaps = [start - end for end, start, _, _ in idle_gaps(spans)]
    span = spans[-1][1] - spans[0][0] if spans else 0.0
    busy = span - sum(gaps)
    sizes = {"<2": (0, 2), "2-10": (2, 10), "10-200": (10, 200), ">=200": (200, float("inf"))}
    return {"provider": "megarl-busy", "batch": args.busy, "seconds": seconds, "span_us": span, "busy_us": busy,
            "busy_fraction": busy / span if span else None,
            "idle_us_by_gap": {k: sum(g for g in gaps if lo <= g < hi) for k, (lo, hi) in sizes.items()},
            "gaps_by_size": {k: sum(1 for g in gaps if lo <= g < hi) for k, (lo, hi) in sizes.items()},
            **decode_steps_of(events)}


def decode_steps_of(events: list[dict], marker: str = "_plan_kernel", top: int = 12) -> dict:
    """The trace's decode steps (each starts at the attention plan's kernel, one a step; a mixed
    prefill step counts as one too): their spans (first kernel to the next step's first) at the
    5th / 25th / 50th / 75th / 95th percentiles and by eighth of the loop, in us, and the kernels'
    mean device time per step by name (the loop's view, to set beside ``--profile``'s replays), and the
    idle gaps of 2 us or more per step by the pair of kernels around them."""
    spans = device_spans(events)
    kernels = [(start, stop - start, name) for start, stop, name in device_spans(events, ("kernel",))]
    starts = [ts for ts, _, name in kernels if name.startswith(marker)]
    if len(starts) < 3:
        return {}
    steps = [b - a for a, b in zip(starts, starts[1:])]
    inside = [(dur, name) for ts, dur, name in kernels if starts[0] <= ts < starts[-1]]
    per_name: dict[str, float] = {}
    for dur, name in inside:
        per_name[name[:60]] = per_name.get(name[:60], 0.0) + dur / len(steps)
    pairs: dict[str, float] = {}  # idle of 2 us or more after a kernel, copy or memset, by (it -> the next)
    for end, start, before, after in idle_gaps(spans, 2.0):
        if starts[0] <= end < starts[-1]:
            key = f"{before[:32]} -> {after[:32]}"
            pairs[key] = pairs.get(key, 0.0) + (start - end) / len(steps)
    ordered = sorted(steps)
    eighths = [steps[j * len(steps) // 8:(j + 1) * len(steps) // 8] for j in range(8)]
    return {"decode_steps": len(steps),
            "step_span_us_quantiles": [ordered[int(q * (len(steps) - 1))] for q in (0.05, 0.25, 0.5, 0.75, 0.95)],
            "step_span_us_by_eighth": [sum(e) / len(e) for e in eighths if e],  # context grows along the loop
            "kernel_us_per_step": sum(d for d, _ in inside) / len(steps),
            "kernels_per_step": len(inside) / len(steps),
            "top_kernels_us_per_step": dict(sorted(per_name.items(), key=lambda kv: -kv[1])[:top]),
            "idle_us_per_step_by_pair": dict(sorted(pairs.items(), key=lambda kv: -kv[1])[:8])}


def host_gaps(run, work: str, min_us: float = 100.0, top: int = 6) -> list[dict]:
    """``run()`` under torch.profiler (CPU and CUDA): every GPU idle gap of at least ``min_us`` inside
    its span, with the host work that overlaps it (CPU ops and CUDA runtime calls, by overlap us):
    what keeps a prefill's GPU waiting?"""
    _, events = traced(run, work, cpu=True)
    spans = device_spans(events)
    host = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver")]
    gaps = [(end, start) for end, start, _, _ in idle_gaps(spans, min_us)]
    rows = []
    for lo, hi in gaps:
        overlap: dict[str, float] = {}
        for e in host:
            o = min(hi, e["ts"] + e["dur"]) - max(lo, e["ts"])
            if o > 0:
                overlap[e["name"]] = overlap.get(e["name"], 0.0) + o
        best = sorted(overlap.items(), key=lambda kv: -kv[1])[:top]
        rows.append({"at_us": lo - spans[0][0], "gap_us": hi - lo, "host": [(n[:60], round(o)) for n, o in best]})
    return rows


def traced(fn, work: str, cpu: bool = False):
    """``fn()`` under torch.profiler (CUDA, and the host with ``cpu``): its result and the chrome
    trace's events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if cpu else [])) as prof:
        out = fn()
        sync()
    trace = os.path.join(work, "anatomy_trace.json")
    prof.export_chrome_trace(trace)
    with open(trace) as f:
        return out, json.load(f)["traceEvents"]


def device_spans(events: list[dict], cats=("kernel", "gpu_memcpy", "gpu_memset")) -> list[tuple[float, float, str]]:
    """(start, stop, name) of every kernel, copy and memset (``cats``) in a trace, in start order, us."""
    return sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("ph") == "X" and e.get("cat") in cats)


def idle_gaps(spans, min_us: float = 0.0) -> list[tuple[float, float, str, str]]:
    """(end, next start, the event before, the event after) of each time the device was idle for more
    than 0 and at least ``min_us`` us between ``device_spans``."""
    gaps, end, last = [], None, ""
    for start, stop, name in spans:
        if end is not None and start > end and start - end >= min_us:
            gaps.append((end, start, last, name))
        if end is None or stop >= end:
            end, last = stop, name
    return gaps

