"""Fused kernels for megarl: each op is `<op>_ref` (spec), Triton kernels, host function.

Call the public functions; `backend="auto"` runs Triton on CUDA and vectorized
PyTorch on CPU (see `dispatch.py`; "triton" on CPU needs TRITON_INTERPRET=1
set before this package is imported).

This folder is `megarl.kernels` (setup.py's package_dir). Where the checkout's root is on sys.path
(`python -m` or `-c` run there, or PYTHONPATH), ``import kernels`` finds it too, and that name
belongs to the `kernels` distribution (Hugging Face hub kernels) that transformers >= 5.2x
imports: imported under that name, this package hands the name over to the installed one.
"""
import sys as _sys


def _hand_over_the_name() -> None:
    """sys.modules["kernels"] becomes the installed `kernels` distribution (looked up on sys.path
    without the checkout's root); with none installed, the name stays this package's."""
    import importlib.machinery
    import importlib.util
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = [p for p in _sys.path if os.path.abspath(p or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec("kernels", path)
    if spec is None:
        return
    module = importlib.util.module_from_spec(spec)
    _sys.modules["kernels"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del _sys.modules["kernels"]
        raise


if __name__ == "kernels":
    _hand_over_the_name()

from megarl.kernels.bucket import BucketLayout, bucket_layout, pack, pack_ref, unpack, unpack_into, unpack_into_ref
from megarl.kernels.dispatch import BACKENDS, HAS_TRITON, choose, interpret_mode, triton_usable
from megarl.kernels.fc1_swiglu import fc1_silu_mul, fc1_silu_mul_ref
from megarl.kernels.feed_tokens import feed_tokens, feed_tokens_ref
from megarl.kernels.gae import gae, gae_ref, gae_torch
from megarl.kernels.host_copy import copy_words, copy_words_ref
from megarl.kernels.group_advantage import group_advantage, group_advantage_ref, group_advantage_torch
from megarl.kernels.linear_logprob import linear_logprob, linear_logprob_ref
from megarl.kernels.logprob import logprob_entropy, logprob_entropy_ref
from megarl.kernels.paged_attention import (
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_prefill_attention,
    paged_prefill_attention_ref,
)
from megarl.kernels.rms_norm import add_rms_norm, add_rms_norm_ref
from megarl.kernels.rope_cache import rope_cache, rope_cache_ref
from megarl.kernels.sampling import sample_tokens, sample_tokens_ref
from megarl.kernels.sampling_noise import uniform_noise
from megarl.kernels.swiglu import silu_mul, silu_mul_ref
from megarl.kernels.reshard import (
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
    "logprob_entropy", "logprob_entropy_ref", "linear_logprob", "linear_logprob_ref",
    "paged_decode_attention", "paged_decode_attention_ref", "paged_prefill_attention", "paged_prefill_attention_ref",
    "add_rms_norm", "add_rms_norm_ref", "rope_cache", "rope_cache_ref", "silu_mul", "silu_mul_ref",
    "fc1_silu_mul", "fc1_silu_mul_ref",
    "sample_tokens", "sample_tokens_ref", "uniform_noise", "feed_tokens", "feed_tokens_ref",
    "copy_words", "copy_words_ref",
    "qkv_split", "qkv_merge", "qkv_split_ref", "qkv_merge_ref",
    "fc1_split", "fc1_merge", "fc1_split_ref", "fc1_merge_ref",
    "split_interleaved", "merge_interleaved", "split_interleaved_ref", "merge_interleaved_ref",
    "padded_vocab_size", "pad_vocab", "unpad_vocab", "tp_split", "tp_concat",
    "BucketLayout", "bucket_layout", "pack", "pack_ref", "unpack", "unpack_into", "unpack_into_ref",
]
