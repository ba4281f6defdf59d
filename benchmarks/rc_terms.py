"""The rollout-correction terms of one update, timed alone on the device (bench_e2e's ``megarl_rc`` side).

The A/B of two whole runs (``rollout_correction_cost_pct``) carries the step-to-step spread of the update
(a few percent); the terms themselves are a handful of element-wise kernels per micro-batch. This times
exactly what the correction adds to each micro-batch of the update, on tensors of the run's shape
(micro-batch x response length), with CUDA events after a warm-up:

    plain      agg_loss(loss, mask) forward + backward                    (what runs without correction)
    corrected  correct(old, rollout, mask, rc) + agg_loss(loss, keep, weights, count_mask) forward + backward

``terms_ms_per_step`` = (corrected - plain) x micro-batches of a step; ``terms_pct_of_update`` = that over
the run's median ``timing/actor_update``.
"""
from __future__ import annotations

import statistics

import torch


def _loop_ms(fn, iters: int, repeats: int = 5) -> float:
    """Median over ``repeats`` of the mean ms of ``iters`` calls (CUDA events; wall clock on CPU)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def correction_terms(micro: int, response_len: int, micro_batches: int, update_s: float | None,
                     preset: str = "async", iters: int = 200) -> dict:
    """Times the terms on CUDA (an empty dict elsewhere); see the module docstring."""
    if not torch.cuda.is_available():
        return {}
    from dataclasses import replace

    from megarl.algos.aggregation import Aggregation
    from megarl.algos.rollout_correction import PRESETS, correct

    rc, dev = PRESETS[preset], torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    roll = -torch.rand(micro, response_len, device=dev, generator=gen) * 3  # (b, T) log-probs
    old = roll + 0.05 * torch.randn(micro, response_len, device=dev, generator=gen)  # ratios near 1, a few outside
    mask = torch.ones(micro, response_len, device=dev)
    loss = torch.randn(micro, response_len, device=dev, generator=gen, requires_grad=True)
    agg = Aggregation()

    def plain():
        agg(loss, mask).backward()

    def corrected():
        c = correct(old, roll, mask, rc)
        replace(agg, weights=c.weights, count_mask=mask)(loss, c.keep.to(mask.dtype)).backward()

    plain_ms, corrected_ms = _loop_ms(plain, iters), _loop_ms(corrected, iters)
    terms_ms = max(corrected_ms - plain_ms, 0.0) * micro_batches
    out = {"preset": preset, "shape": [micro, response_len], "micro_batches": micro_batches,
           "plain_ms": plain_ms, "corrected_ms": corrected_ms, "terms_ms_per_step": terms_ms}
    if update_s:
        out["terms_pct_of_update"] = 100.0 * terms_ms / (update_s * 1e3)
    return out
