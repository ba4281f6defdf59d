"""Fused kernels for megarl: each op is `<op>_ref` (spec), Triton kernels, host function.

Call the public functions; `backend="auto"` runs Triton on CUDA and vectorized
PyTorch on CPU (see `dispatch.py`; "triton" on CPU needs TRITON_INTERPRET=1
set before this package is imported).

This package lives at kernels/megarl_kernels/ and is imported as ``megarl_kernels``
(setup.py says why the name differs from the folder above it).
"""
from megarl_kernels.dispatch import BACKENDS, HAS_TRITON, choose, interpret_mode, triton_usable
from megarl_kernels.fc1_swiglu import fc1_silu_mul, fc1_silu_mul_ref
from megarl_kernels.feed_tokens import feed_tokens, feed_tokens_ref
from megarl_kernels.gae import gae, gae_ref, gae_torch
from megarl_kernels.fused_moe import fused_moe, fused_moe_local, fused_moe_ref, fused_moe_torch
from megarl_kernels.host_copy import copy_words, copy_words_ref
from megarl_kernels.group_advantage import group_advantage, group_advantage_ref, group_advantage_torch
from megarl_kernels.logprob import logprob_entropy, logprob_entropy_ref
from megarl_kernels.moe_align import MoeAlignment, moe_align, moe_align_ref
from megarl_kernels.moe_routing import ROUTING_KINDS, moe_route, moe_route_ref, moe_route_replay
from megarl_kernels.paged_attention import (
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_prefill_attention,
    paged_prefill_attention_ref,
)
from megarl_kernels.rms_norm import add_rms_norm, add_rms_norm_ref
from megarl_kernels.rope_cache import rope_cache, rope_cache_ref
from megarl_kernels.sampling import sample_tokens, sample_tokens_ref
from megarl_kernels.sampling_noise import uniform_noise
from megarl_kernels.swiglu import silu_mul, silu_mul_ref
from megarl_kernels.reshard import (
    fc1_merge,
    fc1_merge_ref,
    fc1_split,
    fc1_split_ref,
    merge_interleaved,
    merge_interleaved_ref,
    pad_vocab,
    padded_vocab_size,
    qkv_merge,
    qkv_merge_ref,
    qkv_split,
    qkv_split_ref,
    split_interleaved,
    split_interleaved_ref,
    tp_concat,
    tp_split,
    unpad_vocab,
)

__all__ = [
    "BACKENDS", "HAS_TRITON", "choose", "interpret_mode", "triton_usable",
    "gae", "gae_ref", "gae_torch",
    "group_advantage", "group_advantage_ref", "group_advantage_torch",
    "logprob_entropy", "logprob_entropy_ref",
    "paged_decode_attention", "paged_decode_attention_ref", "paged_prefill_attention", "paged_prefill_attention_ref",
    "add_rms_norm", "add_rms_norm_ref", "rope_cache", "rope_cache_ref", "silu_mul", "silu_mul_ref",
    "fc1_silu_mul", "fc1_silu_mul_ref",
    "sample_tokens", "sample_tokens_ref", "uniform_noise", "feed_tokens", "feed_tokens_ref",
    "copy_words", "copy_words_ref",
    "qkv_split", "qkv_merge", "qkv_split_ref", "qkv_merge_ref",
    "fc1_split", "fc1_merge", "fc1_split_ref", "fc1_merge_ref",
    "split_interleaved", "merge_interleaved", "split_interleaved_ref", "merge_interleaved_ref",
    "padded_vocab_size", "pad_vocab", "unpad_vocab", "tp_split", "tp_concat",
    "fused_moe", "fused_moe_local", "fused_moe_ref", "fused_moe_torch",
    "MoeAlignment", "moe_align", "moe_align_ref", "ROUTING_KINDS", "moe_route", "moe_route_ref", "moe_route_replay",
]
