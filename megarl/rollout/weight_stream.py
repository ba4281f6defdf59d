"""The actor's weights as a stream of Hugging Face tensors, in buckets (for an external rollout engine).

Spec: the tensors, names, shapes, dtypes and values are exactly those
:func:`megarl.models.export_hf` writes to safetensors for the same model
(``tests/test_rollout_sglang.py`` checks it bitwise at TP1 and TP2): every
parameter is all-gathered over TP, un-fused (QKV, gate/up) and un-padded
(vocab) by the exporter's own :func:`~megarl.models.exporter.merge_shards`; a mixture of
experts' routed experts are all-gathered over EP (and expert-TP), so every rank's stream holds
every expert under its HF name (``model.layers.L.mlp.experts.E.gate_proj.weight``, Mixtral's
``block_sparse_moe.experts.E.w1.weight``), the per-expert names SGLang's MoE loaders map
onto their fused expert weights.
Unlike the export, tensors stay on the parameters' device (so a colocated
engine can map them through CUDA IPC) and are produced one parameter at a
time, so at most one bucket of gathered tensors exists at once.

Buckets: consecutive tensors, in model order, whose bytes sum to at most
``bucket_bytes``; a tensor bigger than that travels alone in its bucket.
They are lists of ``(name, tensor)`` pairs, the form SGLang's
``update_weights_from_tensor`` takes. (kernels/bucket.py's flat one-dtype
packing would match SGLang's ``flattened_bucket`` load format, whose payload
type is SGLang's own; the list form needs nothing from SGLang here.)

Collective over the TP group (and, with experts, the EP and expert-TP groups): every rank must iterate to the end (or every
rank stop at the same bucket). TP rank 0 receives the buckets, the other ranks
iterate over nothing (their part is the all-gathers); with ``every_rank`` each
TP rank receives the same buckets as tensors on its own device (an engine
whose TP worker ``i`` shares TP rank ``i``'s GPU then reads them locally). One pipeline stage's weights only (callers need PP = 1 for
a whole model).
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from megarl.distributed.groups import ParallelGroups
from megarl.models.exporter import expert_hf_tensors, merge_shards
from megarl.models.hf_config import ModelInfo
from megarl.models.weight_map import EXPERT_KINDS, REPLICATED, model_rules

NamedTensors = list[tuple[str, torch.Tensor]]


def _tp_shards(param: torch.Tensor, groups: ParallelGroups) -> list[torch.Tensor]:
    """All TP ranks' shards of one parameter, in TP rank order."""
    if groups.tp_size == 1:
        return [param]
    shards = [torch.empty_like(param) for _ in range(groups.tp_size)]
    dist.all_gather(shards, param.contiguous(), group=groups.tp)
    return shards


def iter_hf_tensors(module: nn.Module, groups: ParallelGroups, info: ModelInfo,
                    dtype: Optional[torch.dtype] = None,
                    every_rank: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """``(HF name, tensor)`` in model order on TP rank 0 (on every TP rank with ``every_rank``;
    nothing elsewhere); collective over TP.

    ``dtype``: cast to it (default: the parameters' own). Replicated tensors
    that need no cast are the live parameters (detached), not copies.
    """
    params = module.state_dict(keep_vars=True)
    for name, rule in model_rules(module, info).items():
        if not rule.export:
            continue
        param = params[name].detach()
        if rule.kind in EXPERT_KINDS:  # every EP rank's experts (collective over EP and expert-TP)
            tensors = expert_hf_tensors(rule, param, groups)
        else:
            shards = [param] if rule.kind == REPLICATED else _tp_shards(param, groups)
            tensors = merge_shards(rule, shards, info) if groups.tp_rank == 0 or every_rank else {}
        if groups.tp_rank != 0 and not every_rank:
            continue
        for hf_name, t in tensors.items():
            yield hf_name, t.to(dtype or t.dtype).contiguous()


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def iter_hf_buckets(module: nn.Module, groups: ParallelGroups, info: ModelInfo, bucket_bytes: int,
                    dtype: Optional[torch.dtype] = None, every_rank: bool = False) -> Iterator[NamedTensors]:
    """:func:`iter_hf_tensors` grouped into buckets of at most ``bucket_bytes`` (a bigger tensor alone)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: NamedTensors = []
    used = 0
    for name, t in iter_hf_tensors(module, groups, info, dtype, every_rank):
        size = tensor_bytes(t)
        if bucket and used + size > bucket_bytes:
            yield bucket
            bucket, used = [], 0
        bucket.append((name, t))
        used += size
    if bucket:
        yield bucket
