"""Next-token choice from full-vocabulary logits: greedy, temperature, top-k, top-p.

Every rank of a TP group holds identical gathered logits and an identically
seeded generator, so every rank picks the same tokens without talking.
"""
from __future__ import annotations

import torch

from megarl.rollout.engine import SamplingParams


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Sets logits outside the top-k / nucleus to -inf. logits: (B, V) fp32."""
    if top_k > 0 and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # (B, V)
        drop_sorted = mass_before >= top_p  # keeps at least the top token
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator):
    """Picks one token per row. logits: (B, V) fp32 over the real vocabulary.

    Returns tokens (B,) and their log-probs (B,) under ``logits / temperature``
    (temperature 1 when greedy) — the quantity training recomputes.
    """
    temperature = params.temperature if not params.greedy else 1.0
    logprobs = torch.log_softmax(logits / temperature, dim=-1)  # (B, V)
    if params.greedy:
        tokens = torch.argmax(logits, dim=-1)
    else:
        filtered = filter_top_k_top_p(logits / temperature, params.top_k, params.top_p)
        probs = torch.softmax(filtered, dim=-1)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # (B,)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
