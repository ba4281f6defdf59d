"""Attention over the rollout engine's paged KV cache: decode and prefill / extend.

Cache layout (fixed by the engine), per layer: k_cache, v_cache (num_pages, page_size, Hkv, D),
contiguous, q's dtype (fp32, bf16 or fp16), page_size a power of two (engine default 16).
Key j of a sequence with page-table row `pages` lives at k_cache[pages[j // page_size],
j % page_size]; table entries past a sequence's pages are arbitrary valid page ids. Query head h
reads kv head h // (Hq / Hkv) (SDPA enable_gqa / HF repeat_kv). Softmax in fp32, out in q's dtype.

    paged_decode_attention   one query per sequence, flash decoding over a work plan that evens out
                             ragged rows (`decode_plan.py`), CUDA-graph capturable (`paged_decode.py`);
                             `rope_paged_decode`: the same with the decode step's RoPE and K/V cache
                             write in its launch
    paged_prefill_attention  packed causal query chunks, flash attention over pages
                             (`paged_prefill.py`)

Each comes as `<op>_ref` (the spec), `<op>_torch`, `<op>_triton` and the public `<op>(...,
backend="auto")` (see `dispatch.py`). The Triton kernels take any D (padded to a power of two
>= 16 in registers; D <= 256 keeps them in registers) and any power-of-two page size.
"""
from megarl_kernels.decode_plan import decode_plan
from megarl_kernels.paged_decode import (
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_decode_attention_torch,
    paged_decode_attention_triton,
    rope_paged_decode,
    rope_paged_decode_ref,
)
from megarl_kernels.paged_prefill import (
    paged_prefill_attention,
    paged_prefill_attention_ref,
    paged_prefill_attention_torch,
    paged_prefill_attention_triton,
)

__all__ = [
    "decode_plan",
    "paged_decode_attention", "paged_decode_attention_ref", "paged_decode_attention_torch",
    "paged_decode_attention_triton", "rope_paged_decode", "rope_paged_decode_ref",
    "paged_prefill_attention", "paged_prefill_attention_ref", "paged_prefill_attention_torch",
    "paged_prefill_attention_triton",
]
