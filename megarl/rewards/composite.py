"""CompositeReward: a weighted sum of reward terms, robust to failing terms, with a cache."""
from __future__ import annotations

import json
import logging
import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from megarl.rewards.cache import RewardCache
from megarl.rewards.registry import REWARDS, get_reward
from megarl.rewards.terms import RewardModelTerm, RewardSample, RewardTerm

log = logging.getLogger(__name__)
NAN = float("nan")


@dataclass
class RewardOutput:
    total: Tensor
    """(B,) sum over terms of weight * shaped value."""
    terms: dict[str, Tensor]
    """label -> (B,) shaped values (before the weight)."""
    metrics: dict[str, float]
    """'<label>/mean', '<label>/failures' per term, 'total/mean'; with a cache 'cache/hits', 'cache/misses'
    (this call) and 'cache/fallbacks' (so far: switches from Redis to the on-disk store)."""


def _as_finite(value: Any) -> float:
    """float(value) if it is a finite real number (or a 1-element tensor), else NaN."""
    if isinstance(value, Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, numbers.Real) and math.isfinite(float(value)):
        return float(value)
    return NAN


def _cache_label(term: RewardTerm) -> str:
    """The term's label and kwargs: a store kept across runs must not serve values of other kwargs."""
    return term.key + (json.dumps(term.kwargs, sort_keys=True, default=repr) if term.kwargs else "")


def cacheable(term: RewardTerm) -> bool:
    """term.cache, defaulting to: a registered reward yes, a user's 'module:function' no (it may
    read state the key does not cover, or change between runs sharing an on-disk cache)."""
    return term.cache if term.cache is not None else term.name in REWARDS.names()


class CompositeReward:
    """Scores samples with rule/user terms and an optional reward-model term.

    terms: RewardTerm, or tuples (name_or_path, weight[, kwargs]).
    rm: optional RewardModelTerm holding the caller's scorer.
    cache: RewardCache shared by the cached terms; None disables caching.
    A failing sample (raise, NaN, inf, non-number) gets the term's fallback and
    counts in '<label>/failures'; the run goes on.
    """

    def __init__(
        self,
        terms: Sequence[RewardTerm | Sequence[Any]],
        rm: RewardModelTerm | None = None,
        cache: RewardCache | None = None,
    ):
        self.terms = [RewardTerm.of(t) for t in terms]
        self.fns: list[Callable[..., float]] = [get_reward(t.name) for t in self.terms]
        self.cached = {t.key for t in self.terms if cacheable(t)}  # labels of the terms the cache serves
        self.rm = rm
        self.cache = cache
        labels = [t.key for t in self.terms] + ([rm.key] if rm else [])
        if len(set(labels)) != len(labels):
            raise ValueError(f"reward term labels must be unique, got {labels}; set label= to tell them apart")
        if rm is not None and rm.scorer is None:
            raise ValueError("RewardModelTerm needs a scorer")

    def __call__(self, samples: Sequence[RewardSample], rm_batch: Any = None) -> RewardOutput:
        hits0, misses0 = (self.cache.hits, self.cache.misses) if self.cache is not None else (0, 0)
        raws = self._rule_raws(samples)
        shaping: list[Any] = list(self.terms)
        if self.rm is not None:
            raws[self.rm.key] = self._rm_raw(samples, rm_batch)
            shaping.append(self.rm)
        total = torch.zeros(len(samples), dtype=torch.float64)
        terms, metrics = {}, {}
        for term in shaping:
            raw, shaped = raws[term.key], term.shape(raws[term.key])  # (B,), (B,)
            terms[term.key] = shaped.float()
            total += term.weight * shaped
            metrics[f"{term.key}/mean"] = terms[term.key].mean().item() if len(samples) else 0.0
            metrics[f"{term.key}/failures"] = float((~torch.isfinite(raw)).sum())
        metrics["total/mean"] = total.mean().item() if len(samples) else 0.0
        if self.cache is not None:
            metrics["cache/hits"] = float(self.cache.hits - hits0)
            metrics["cache/misses"] = float(self.cache.misses - misses0)
            metrics["cache/fallbacks"] = float(self.cache.fallbacks)
        return RewardOutput(total.float(), terms, metrics)

    def _rule_raws(self, samples: Sequence[RewardSample]) -> dict[str, Tensor]:
        """label -> (B,) float64 raw values, NaN for failed samples. The cached terms' values
        are looked up in one call and the new ones stored in one call; a key repeated in
        the batch is computed once."""
        use = self.cache is not None
        keys = {t.key: [RewardCache.key(_cache_label(t), s.prompt, s.response, s.ground_truth, s.extra)
                        for s in samples]
                for t in self.terms if use and t.key in self.cached}
        flat = [k for ks in keys.values() for k in ks]
        known = {k: v for k, v in zip(flat, self.cache.get_many(flat)) if v is not None} if flat else {}
        new: dict[str, float] = {}
        raws = {}
        for term, fn in zip(self.terms, self.fns):
            out = []
            for i, s in enumerate(samples):
                key = keys[term.key][i] if term.key in keys else None
                value = known.get(key, new.get(key)) if key is not None else None
                if value is None:
                    value = self._call(term.key, fn, s, term.kwargs)
                    if key is not None and math.isfinite(value):
                        new[key] = value
                out.append(value)
            raws[term.key] = torch.tensor(out, dtype=torch.float64)
        if new:
            self.cache.put_many(new)
        return raws

    @staticmethod
    def _call(label: str, fn: Callable[..., float], s: RewardSample, kwargs: dict[str, Any]) -> float:
        try:
            value = _as_finite(fn(s.prompt, s.response, s.ground_truth, s.extra, **kwargs))
        except Exception as e:  # a bad sample must not stop the run
            log.warning("reward term %r raised on a sample: %r", label, e)
            return NAN
        if math.isnan(value):
            log.warning("reward term %r gave a non-finite or non-number value", label)
        return value

    def _rm_raw(self, samples: Sequence[RewardSample], rm_batch: Any) -> Tensor:
        """(B,) float64 RM scores, NaN where the scorer failed (everywhere if it raised)."""
        assert self.rm is not None
        if self.cache is None or not self.rm.cache or rm_batch is not None:
            return self._score_rm(rm_batch if rm_batch is not None else list(samples), len(samples))
        return self._rm_cached(samples, self.cache)

    def _rm_cached(self, samples: Sequence[RewardSample], cache: RewardCache) -> Tensor:
        """Cache lookups; the distinct missing samples are scored once, in one call."""
        label = self.rm.key  # type: ignore[union-attr]
        out = torch.full((len(samples),), NAN, dtype=torch.float64)
        pending: dict[str, list[int]] = {}  # key -> indices of samples with that key
        keys = [RewardCache.key(label, s.prompt, s.response, s.ground_truth) for s in samples]
        for i, (key, value) in enumerate(zip(keys, cache.get_many(keys))):
            if value is None:
                pending.setdefault(key, []).append(i)
            else:
                out[i] = value
        if not pending:
            return out
        scores = self._score_rm([samples[idx[0]] for idx in pending.values()], len(pending))
        new = {}
        for (key, idx), v in zip(pending.items(), scores.tolist()):
            out[idx] = v
            if math.isfinite(v):
                new[key] = v
        cache.put_many(new)
        return out

    def _score_rm(self, batch: Any, n: int) -> Tensor:
        try:
            scores = torch.as_tensor(self.rm.scorer(batch)).detach().to("cpu", torch.float64)  # type: ignore[union-attr]
        except Exception as e:
            log.warning("reward model scorer raised: %r", e)
            return torch.full((n,), NAN, dtype=torch.float64)
        if scores.shape != (n,):
            log.warning("reward model scorer returned shape %s, expected (%d,)", tuple(scores.shape), n)
            return torch.full((n,), NAN, dtype=torch.float64)
        return scores
