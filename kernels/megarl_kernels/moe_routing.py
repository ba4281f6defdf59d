"""Mixture-of-experts routing: router logits -> the top-k experts of each token and their weights.

Every supported family computes it the way its Hugging Face router does (transformers 5,
``*TopKRouter.forward``): probabilities = softmax of the logits in fp32 over all E experts, the k
largest by ``torch.topk`` (sorted, largest first), and then

    family       renormalize the k probabilities to sum to 1
    qwen3_moe    when ``norm_topk_prob`` (default True, as the released Qwen3-MoE checkpoints set it)
    qwen2_moe    when ``norm_topk_prob`` (default False, as the Qwen1.5/2-MoE checkpoints leave it)
    mixtral      always (Mixtral's top-k of the logits then a softmax over those k is the same
                 weights; selecting on the fp32 probabilities, as HF does, is what is matched)

HF's config classes default ``norm_topk_prob`` to False for both Qwen families: a model passes its
config's field rather than relying on either default.

Ties. Experts are chosen by ``torch.topk`` on the fp32 probabilities, in every backend, so ties
(equal probabilities, including logits that differ by less than softmax's fp32 rounding) resolve
exactly as ``torch.topk`` resolves them on that device; torch does not document that order, which
is why no second implementation of the selection exists to disagree with it.

Replay (`moe_route_replay`, for rollout routing replay): given recorded ids instead of choosing,
the weights are the same softmax over all experts of the *current* logits, taken at the recorded
ids and renormalized as the family does; differentiable, so the router keeps its gradient. With
the ids `moe_route` would choose, it returns `moe_route`'s weights bit for bit.

The weights stay fp32 (HF rounds them to the logits' dtype before the expert sum; the fused MoE
kernel multiplies in fp32). No kernel: the softmax, topk and renormalization are three small
launches on (T, E), next to the expert GEMMs.
"""
from __future__ import annotations

import torch

# family -> norm_topk_prob when the caller gives None; None = always renormalized, not a choice
RENORMALIZE_DEFAULT = {"qwen3_moe": True, "qwen2_moe": False, "mixtral": None}
ROUTING_KINDS = tuple(RENORMALIZE_DEFAULT)


def _renormalizes(kind: str, norm_topk_prob: bool | None) -> bool:
    if kind not in RENORMALIZE_DEFAULT:
        raise ValueError(f"moe_route: kind={kind!r}; expected one of {ROUTING_KINDS}")
    default = RENORMALIZE_DEFAULT[kind]
    if default is None:
        if norm_topk_prob is False:
            raise ValueError("moe_route: mixtral always renormalizes its top-k weights; pass norm_topk_prob=None")
        return True
    return default if norm_topk_prob is None else bool(norm_topk_prob)


def moe_route(router_logits: torch.Tensor, top_k: int, kind: str, norm_topk_prob: bool | None = None):
    """(T, E) logits -> (topk_weights (T, k) fp32, topk_ids (T, k) int32), largest weight first.

    ``kind`` is the family (module docstring); ``norm_topk_prob`` its HF config field (None: the
    family's default)."""
    renormalize = _renormalizes(kind, norm_topk_prob)
    if router_logits.dim() != 2 or not 0 < top_k <= router_logits.shape[1]:
        raise ValueError(f"moe_route: logits (T, E) with 0 < top_k <= E expected; got "
                         f"{tuple(router_logits.shape)}, top_k={top_k}")
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # (T, E)
    weights, ids = torch.topk(probs, top_k, dim=-1)  # (T, k) each, sorted
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def moe_route_replay(router_logits: torch.Tensor, topk_ids: torch.Tensor, kind: str,
                     norm_topk_prob: bool | None = None) -> torch.Tensor:
    """(T, E) logits, (T, k) recorded expert ids -> (T, k) fp32 weights of those experts under the
    current logits (module docstring); autograd flows to the logits."""
    renormalize = _renormalizes(kind, norm_topk_prob)
    if router_logits.dim() != 2 or topk_ids.dim() != 2 or topk_ids.shape[0] != router_logits.shape[0]:
        raise ValueError(f"moe_route_replay: logits (T, E) and ids (T, k) expected; got "
                         f"{tuple(router_logits.shape)}, {tuple(topk_ids.shape)}")
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # (T, E)
    weights = probs.gather(1, topk_ids.long())  # (T, k)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights


def moe_route_ref(router_logits: torch.Tensor, top_k: int, kind: str, norm_topk_prob: bool | None = None):
    """The spec, token by token: exp / sum in float64 rounded to fp32, ``torch.topk`` of each row
    (the selection is torch.topk's by definition), then the renormalization the family asks for."""
    renormalize = _renormalizes(kind, norm_topk_prob)
    weights, ids = [], []
    for row in router_logits.double():
        e = torch.exp(row - row.max())
        w, i = torch.topk((e / e.sum()).float(), top_k)
        weights.append((w.double() / w.double().sum()).float() if renormalize else w)
        ids.append(i.to(torch.int32))
    return torch.stack(weights), torch.stack(ids)
