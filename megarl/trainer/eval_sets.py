"""Named evaluation sets: n samples per prompt, pass@k and mean@n of any metric.

    metrics = evaluate_set(engine, dataset, tokenizer, groups, spec, max_new_tokens, seed)
    # {"eval/gsm8k/pass@1": 0.41, "eval/gsm8k/pass@4": 0.63, "eval/gsm8k/mean@4": 0.40, ...}

Each prompt gets ``spec.n`` samples at ``spec.temperature``; each sample is
scored by ``spec.metric`` (a registered reward or ``module:function`` with the
reward signature ``fn(prompt, response, ground_truth, extra, **kwargs) ->
float``). A metric that raises or returns a non-finite value scores 0 and is
counted in ``eval/<name>/failed``. A sample is solved when its score is >=
``spec.pass_threshold``. With c of n samples solved, a prompt's pass@k is the
unbiased estimate ``1 - C(n-c, k) / C(n, k)`` (Chen et al. 2021): the chance
that k samples drawn without replacement from the n hold a solved one.
mean@n is the mean score over the n samples. Both are averaged over prompts
(all DP ranks). Sample j of prompt i has seed ``mix_seed(mix_seed(seed, i), j)``
with i the prompt's index in the set, so results do not depend on the DP size.
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from megarl.monitor.progress import note
from megarl.rollout.engine import Request, SamplingParams, mix_seed
from megarl.trainer.evaluate import eval_indices


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``c`` of ``n`` samples solved: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 0 <= c={c} <= n={n} and 1 <= k={k} <= n")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def ks_of(spec) -> list[int]:
    """The k values logged: ``spec.k``, or 1 and n."""
    return sorted(set(spec.k)) if spec.k else sorted({1, spec.n})


def score_samples(metric: Callable[..., float], kwargs: dict, item, texts: list[str]) -> tuple[list[float], int]:
    """Scores of one prompt's responses; (scores, failures): a failure scores 0."""
    scores, failed = [], 0
    for text in texts:
        try:
            value = float(metric(item.prompt_text, text, item.answer, item.extra, **kwargs))
        except Exception:  # noqa: BLE001 - a user metric that raises is a failed sample, counted
            value = math.nan
        if not math.isfinite(value):
            value, failed = 0.0, failed + 1
        scores.append(value)
    return scores, failed


def prompt_sums(scores: list[float], threshold: float, ks: list[int]) -> list[float]:
    """[pass@k for k in ks..., mean score] of one prompt."""
    solved = sum(s >= threshold for s in scores)
    return [pass_at_k(len(scores), solved, k) for k in ks] + [sum(scores) / len(scores)]


def evaluate_set(engine, dataset, tokenizer, groups, spec, max_new_tokens: int, seed: int,
                 stop_token_ids: tuple[int, ...] = ()) -> dict[str, float]:
    """eval/<name>/pass@k, mean@n, prompts, failed over the first ``spec.limit`` prompts (0: all)."""
    from megarl.rewards.registry import get_reward

    metric, ks = get_reward(spec.metric), ks_of(spec)
    index = eval_indices(len(dataset), spec.limit, groups.dp_rank, groups.dp_size)
    items = [dataset[i] for i in index]
    sums = torch.zeros(len(ks) + 3, dtype=torch.float64)  # pass@k..., mean, prompts, failed
    if items:
        limit = spec.max_new_tokens or max_new_tokens
        requests = [Request(i * spec.n + j, list(it.prompt_ids), mix_seed(mix_seed(seed, gi), j), limit)
                    for i, (gi, it) in enumerate(zip(index, items)) for j in range(spec.n)]
        params = SamplingParams(temperature=spec.temperature, top_p=spec.top_p, stop_token_ids=stop_token_ids)
        results = sorted(engine.generate(requests, params), key=lambda r: r.key)
        answers = [r.extra.get("final_turn_ids", r.response_ids) for r in results]  # multi-turn: the last turn
        texts = tokenizer.batch_decode(answers, skip_special_tokens=True)
        for i, it in enumerate(items):
            scores, failed = score_samples(metric, spec.metric_kwargs, it, texts[i * spec.n:(i + 1) * spec.n])
            sums += torch.tensor(prompt_sums(scores, spec.pass_threshold, ks) + [1.0, float(failed)],
                                 dtype=torch.float64)
    if groups.dp_size > 1:
        dist.all_reduce(sums, group=groups.dp)
    prompts = max(float(sums[-2]), 1.0)
    out = {f"eval/{spec.name}/pass@{k}": float(sums[j]) / prompts for j, k in enumerate(ks)}
    out[f"eval/{spec.name}/mean@{spec.n}"] = float(sums[len(ks)]) / prompts
    out[f"eval/{spec.name}/prompts"] = float(sums[-2])
    out[f"eval/{spec.name}/failed"] = float(sums[-1])
    return out


def describe(spec, metrics: dict[str, Any]) -> str:
    """One console line: 'gsm8k (200 prompts x 4): pass@1 0.412  pass@4 0.630  mean@4 0.405'."""
    values = "  ".join(f"{key.rsplit('/', 1)[-1]} {v:.3f}" for key, v in metrics.items()
                       if "@" in key.rsplit("/", 1)[-1])
    failed = int(metrics.get(f"eval/{spec.name}/failed", 0))
    return (f"{spec.name} ({int(metrics[f'eval/{spec.name}/prompts'])} prompts x {spec.n}): {values}"
            + (f"  ({failed} samples failed to score)" if failed else ""))


def evaluate_named_sets(cfg, engine, sets: dict, tokenizer, groups, say: bool) -> dict[str, float]:
    """Every ``cfg.data.eval_sets`` entry on its dataset in ``sets`` (by name), with the run's
    rollout limits and seed; one console line per set on rank 0 (``say``)."""
    out: dict[str, float] = {}
    for spec in cfg.data.eval_sets:
        start = time.perf_counter()
        metrics = evaluate_set(engine, sets[spec.name], tokenizer, groups, spec, cfg.rollout.max_new_tokens,
                               cfg.rollout.seed, tuple(cfg.rollout.stop_token_ids))
        note(f"eval {describe(spec, metrics)} ({time.perf_counter() - start:.1f} s)", say)
        out.update(metrics)
    return out
