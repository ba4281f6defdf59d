"""RoPE on packed (THD) rows without a host sync, and fused on CUDA: drop-ins for megatron-core's baseline.

megatron-core 0.16's unfused THD path (``rope_utils._apply_rotary_pos_emb_thd``,
taken whenever RoPE fusion is off, i.e. without transformer-engine) reads the
sequence lengths to the host (``.tolist()``, ``.item()``) and splits the row per
sequence, for queries and keys of every layer: two device syncs and 2 x n small
kernels per layer: the packed reference forward of the end-to-end benchmark
took 1.2x the padded one (docs/performance.md).

`packed_rope` computes each token's position in its sequence on the device
(``repeat_interleave`` with a known output size; once per micro-batch, shared by every layer's
queries and keys), gathers its frequencies and
applies megatron's own ``_apply_rotary_pos_emb_bshd`` once: the same element
ops, so the same bits (tests/test_rope_thd.py). On CUDA (full, non-interleaved
rotary, mscale 1) the rotation is ``megarl_kernels.rope`` instead, forward and
backward in one launch each, on cos / sin tables of megatron's angles rounded
as megatron rounds them: the same numbers up to one rounding (see
``kernels/megarl_kernels/rope.py``; the unfused ops were ~6% of a 1.5B actor
update). The tables are made once per forward: megatron hands
every layer the same (cached) ``freqs`` tensor. Context parallel ranks (cp > 1)
keep megatron's function. Padded rows (``actor.packing=false``: megatron's
``_apply_rotary_pos_emb_bshd``) take the same kernel through `padded_rope`, so
packed and padded layouts compare on the same kernels.
"""
from __future__ import annotations

import torch
from megatron.core.models.common.embeddings import rope_utils

from megarl_kernels.memo import remembered
from megarl_kernels.rope import rope, rope_tables

_MEGATRON_THD = rope_utils._apply_rotary_pos_emb_thd
_MEGATRON_BSHD = rope_utils._apply_rotary_pos_emb_bshd


def packed_rope(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor, rotary_interleaved: bool = False,
                multi_latent_attention: bool = False, mscale: float = 1.0, cp_group=None) -> torch.Tensor:
    """t (T, h, d), cu_seqlens (n + 1,) int32, freqs (S, 1, 1, d) -> (T, h, d) rotated per sequence."""
    if cp_group is None or cp_group.size() != 1:
        return _MEGATRON_THD(t, cu_seqlens, freqs, rotary_interleaved, multi_latent_attention, mscale, cp_group)
    total = t.shape[0]
    positions = _packed_positions(cu_seqlens, total, freqs.shape[0] == total, t.device)
    if _fusable(t, freqs, rotary_interleaved, multi_latent_attention, mscale):
        return rope(t, positions, *_tables(freqs, t.dtype))
    freqs = freqs[positions]
    return _MEGATRON_BSHD(t.unsqueeze(1), freqs, rotary_interleaved=rotary_interleaved,
                                                 multi_latent_attention=multi_latent_attention,
                                                 mscale=mscale).squeeze(1)


def padded_rope(t: torch.Tensor, freqs: torch.Tensor, rotary_interleaved: bool = False,
                multi_latent_attention: bool = False, mscale: float = 1.0) -> torch.Tensor:
    """t [s, b, h, d], freqs [s, 1, 1, d] -> megatron's RoPE of padded rows (fused where `_fusable`)."""
    fits = t.dim() == 4 and freqs.dim() == 4 and freqs.shape[0] == t.shape[0] and freqs.shape[1:3] == (1, 1)
    if not (fits and _fusable(t, freqs, rotary_interleaved, multi_latent_attention, mscale)):
        return _MEGATRON_BSHD(t, freqs, rotary_interleaved, multi_latent_attention, mscale)
    s, b, h, d = t.shape
    positions = _padded_positions(s, b, t.device)
    return rope(t.reshape(s * b, h, d), positions, *_tables(freqs, t.dtype)).view(s, b, h, d)


# Every layer's queries and keys of a micro-batch share their positions, so they are made once
# (`remembered`). Made per call, a 28-layer 1.5B actor update of 8 packed micro-batches built them
# 448 times (~2,000 small launches of a host-bound update). Keyed on
# inference mode too: the RoPE kernel saves positions for backward, which an inference tensor cannot be.
def _positions(layout: str, anchors: tuple, key: tuple, make) -> torch.Tensor:
    return remembered(("rope positions", layout), anchors, (*key, torch.is_inference_mode_enabled()), make)


def _packed_positions(cu_seqlens: torch.Tensor, total: int, per_token: bool, dev: torch.device) -> torch.Tensor:
    """(total,) long: each packed token's index in the row if ``per_token`` (freqs already hold
    every token's angle), else its index within its sequence (cu_seqlens (n + 1,))."""
    def make():
        positions = torch.arange(total, device=dev)
        if per_token:
            return positions
        cu = cu_seqlens.to(dev)  # freqs per position 0..S-1: every sequence starts at 0
        lengths = (cu[1:] - cu[:-1]).long()
        return positions - torch.repeat_interleave(cu[:-1].long(), lengths, output_size=total)

    return _positions("packed", (cu_seqlens,), (total, per_token, dev), make)


def _padded_positions(s: int, b: int, dev: torch.device) -> torch.Tensor:
    """(s * b,) long: the position of each token of padded [s, b] rows, row-major."""
    return _positions("padded", (), (s, b, dev), lambda: torch.arange(s, device=dev).repeat_interleave(b))


def _tables(freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (S, D) in ``dtype`` of megatron's (S, 1, 1, D) angles, made once per freqs tensor
    (megatron hands every layer the same cached one)."""
    return remembered(("rope tables", dtype), (freqs,), (),
                      lambda: rope_tables(freqs.view(freqs.shape[0], -1), dtype))


def _fusable(t, freqs, rotary_interleaved: bool, multi_latent_attention: bool, mscale: float) -> bool:
    d = t.shape[-1]
    return (t.is_cuda and freqs.is_cuda and not rotary_interleaved and not multi_latent_attention and mscale == 1.0
            and freqs.shape[-1] == d and freqs.dtype == torch.float32 and d >= 2 and not d & (d - 1))


def install() -> None:
    """Route megatron's unfused THD and BSHD RoPE through `packed_rope` and `padded_rope` (idempotent)."""
    rope_utils._apply_rotary_pos_emb_thd = packed_rope
    rope_utils._apply_rotary_pos_emb_bshd = padded_rope
