"""Core attention on ``torch.nn.functional.scaled_dot_product_attention``.

A drop-in for megatron-core's unfused ``DotProductAttention`` in the local
layer spec (the ``core_attention`` submodule of ``SelfAttention``): same
constructor and forward contract, same numbers, but SDPA picks a fused kernel
(flash / cuDNN / memory-efficient on GPU) instead of materialising
``[b, np, sq, sk]`` scores in a global buffer.

Layouts (megatron's): query ``[sq, b, np, hn]``, key/value ``[sk, b, ng, hn]``
with ``np`` query heads and ``ng`` key/value groups on this TP rank; output
``[sq, b, np * hn]``. Packed sequences (``packed_seq_params.qkv_format ==
"thd"``) arrive without the batch dim, ``[t, np, hn]``, and leave as
``[t, np * hn]``; each sequence between consecutive ``cu_seqlens`` attends only
to itself: one ``varlen_attn`` call on CUDA in fp16/bf16, else its own causal
SDPA (:mod:`megarl.models.packed_attention`).

Masks follow megatron: ``attention_mask`` True means "do not attend"; with no
mask the attention is causal (the layer spec builds it with
``AttnMaskType.causal``).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide

from megarl.models.context_parallel import heads_to_seq, seq_to_heads
from megarl.models.packed_attention import packed_attention

_CAUSAL = (AttnMaskType.causal, AttnMaskType.padding_causal)


class SDPAAttention(MegatronModule):
    """Causal / masked / packed attention through SDPA, with GQA via ``enable_gqa``."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(config=config)
        if config.apply_query_key_layer_scaling or config.softmax_type != "vanilla":
            raise ValueError("attention_backend 'sdpa' supports only vanilla softmax attention")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        tp = pg_collection.tp.size()
        self.cp_size = config.context_parallel_size
        self.cp_group = pg_collection.cp if self.cp_size > 1 else None
        self.attn_mask_type = attn_mask_type
        self.num_heads = divide(config.num_attention_heads, tp)
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(self.head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("attention_backend 'sdpa' does not take an attention bias")
        causal = (attn_mask_type or self.attn_mask_type) in _CAUSAL
        dropout = self.dropout_p if self.training else 0.0
        if dropout and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return self._attend(query, key, value, attention_mask, causal, dropout, packed_seq_params)
        return self._attend(query, key, value, attention_mask, causal, dropout, packed_seq_params)

    def _attend(self, query, key, value, attention_mask, causal, dropout, packed_seq_params):
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return self._packed(query, key, value, causal, dropout, packed_seq_params)
        # [s, b, n, hn] -> [b, n, s, hn]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = self._sdpa(q, k, v, attention_mask, causal, dropout)  # [b, np, sq, hn]
        sq, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.num_heads * self.head_dim)

    def _packed(self, query, key, value, causal, dropout, params: PackedSeqParams):
        """query [t, np, hn], key/value [t, ng, hn] -> [t, np * hn]: varlen on CUDA in half
        precision, else one SDPA per sequence (:mod:`megarl.models.packed_attention`)."""
        if self.cp_size > 1:  # Ulysses (megarl/models/context_parallel.py): whole sequences, heads / cp
            index, group, cp = params.cp_index, self.cp_group, self.cp_size
            if key.shape[1] < cp:  # fewer kv heads than CP ranks: each rank gets a copy of its group's
                key, value = (t.repeat_interleave(cp // t.shape[1], dim=1) for t in (key, value))
            query, key, value = (seq_to_heads(t, params.cp_order, group, cp) for t in (query, key, value))
        # with padded cu_seqlens, each sequence's real tokens lead its padded slot
        cu_q = _first(params.cu_seqlens_q_padded, params.cu_seqlens_q)
        cu_kv = _first(params.cu_seqlens_kv_padded, params.cu_seqlens_kv)
        out = packed_attention(query, key, value, cu_q, cu_kv, params.max_seqlen_q, params.max_seqlen_kv,
                               causal, self.softmax_scale, dropout)  # [t, np, hn] ([T, np / cp, hn] under CP)
        if self.cp_size > 1:
            out = heads_to_seq(out, index, group, cp)
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)

    def _sdpa(self, q, k, v, attention_mask, causal, dropout):
        """q [b, np, sq, hn], k/v [b, ng, sk, hn] -> [b, np, sq, hn]."""
        sq, sk = q.shape[2], k.shape[2]
        mask, is_causal = None, False
        if attention_mask is not None:
            mask = ~attention_mask  # megatron: True = masked; SDPA: True = attend
        elif causal and sq == sk:
            is_causal = sq > 1
        elif causal and sq > 1:  # queries are the last sq of sk positions (bottom-right aligned)
            mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal,
            scale=self.softmax_scale, enable_gqa=k.shape[1] != q.shape[1],
        )


def _first(*tensors):
    return next(t for t in tensors if t is not None)
