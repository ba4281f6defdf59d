"""Tokens of no sequence in a mixture-of-experts layer: routed to no expert, outside the router losses.

A micro-batch holds tokens that belong to no sequence: the right padding of padded rows, the packed
row's pad segment (sequence parallelism) and, under context parallelism, each sequence's padding to
a multiple of 2·cp (megarl/models/context_parallel.py). Their outputs are never read, yet a router
would route them, the load-balancing loss and the z-loss would count them, and the per-layer expert
load (``ExpertLoad``) too: at CP2 the numbers would differ from CP1's by those tokens. So the roles
hand ``ModelInputs.padding`` to an MoE model as GPTModel's ``padding_mask`` (True = padding), which
megatron-core carries to every router, and :func:`exclude_padding` completes what megatron-core does
with it:

- megatron-core leaves padding out of the load-balancing loss: tokens per expert and the token count
  are summed over the tp x cp group, each rank's share of the loss is its own tokens' probabilities
  against those global counts, and the ranks' shares add up (gradients are summed over dp x cp) to
  the loss of the whole micro-batch on its real tokens, at any CP size;
- its z-loss on each tp x cp rank is the mean over the rank's own real tokens divided by the group
  size, which is the micro-batch's mean only when every rank holds as many real tokens; CP padding
  sits at each sequence's end (chunk 2·cp-1, CP rank 0), so :func:`z_loss_over_group` takes each
  rank's sum over the group's token count instead (one scalar all-reduce per layer; the z-loss runs
  only in grad-enabled training forwards, as megatron-core's);
- a forward hook, ahead of every other hook on the router, clears the padding rows of the router's
  ``(probs, routing_map)``: padding is dispatched to no expert (no alltoall, no expert GEMM; the
  layer's output there is the shared expert's alone) and the expert load counts real tokens only.
"""
from __future__ import annotations

from types import MethodType
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from torch import nn


def routers(model: nn.Module) -> list:
    """Every megatron-core router of a model stage (MoE layers have a router and a token dispatcher)."""
    return [m.router for m in model.modules() if hasattr(m, "router") and hasattr(m, "token_dispatcher")]


def exclude_padding(model: nn.Module) -> None:
    """Padding is routed nowhere in ``model``'s MoE layers; the z-loss is a mean over the group's real tokens."""
    for router in routers(model):
        router.register_forward_hook(_unroute_padding, prepend=True)
        if router.tp_cp_group.size() > 1:
            router.apply_z_loss = MethodType(z_loss_over_group, router)


def _unroute_padding(_router, inputs: tuple, output: tuple) -> Optional[tuple]:
    """(probs, routing_map) [tokens, experts] with the rows of padding tokens cleared.
    inputs: (hidden [s, b, h], padding_mask [s, b] bool, True = padding, or None)."""
    padding = inputs[1] if len(inputs) > 1 else None
    if padding is None:
        return None
    probs, routing_map = output
    pad = padding.reshape(-1, 1).to(routing_map.device)  # [s * b, 1], the router's token order
    return probs.masked_fill(pad, 0.0), routing_map & ~pad


def z_loss_over_group(router, logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """megatron-core's ``TopKRouter.apply_z_loss`` with the mean taken over the real tokens of the whole
    tp x cp group: this rank's sum of logsumexp(logits)^2 over its real tokens / the group's count.
    logits: [tokens, experts]; padding_mask: [tokens] bool, True = padding."""
    coeff = router.config.moe_z_loss_coeff
    if coeff is None or not (router.training and torch.is_grad_enabled()):
        return logits
    z = torch.logsumexp(logits, dim=-1).square()  # [tokens]
    real = torch.ones_like(z, dtype=torch.bool) if padding_mask is None else ~padding_mask
    count = real.sum(dtype=torch.float32)
    dist.all_reduce(count, group=router.tp_cp_group)  # the micro-batch's real tokens, every rank's
    z_loss = torch.where(real, z, 0.0).sum() / count.clamp(min=1.0) * coeff
    return MoEAuxLossAutoScaler.apply(logits, z_loss)


def stage_padding(padding: Optional[torch.Tensor], model: nn.Module, groups) -> Optional[torch.Tensor]:
    """(b, s) padding mask (True = padding) as this pipeline stage's GPTModel takes it: megatron-core
    cuts it to the TP rank's sequence-parallel slice of s on the first stage (beside the embedding's
    output) but hands a later stage's layers the mask as given, while their hidden states arrive cut:
    there the slice is taken here."""
    if padding is None or groups.is_first_stage or groups.tp_size == 1 or not model.config.sequence_parallel:
        return padding
    n = padding.size(1) // groups.tp_size
    return padding[:, groups.tp_rank * n:(groups.tp_rank + 1) * n]
