"""SDPAAttention against a naive softmax(q k^T / sqrt(d)) v reference (one process).

The reference repeats each key/value group over its h = np / ng query heads
(query head j reads group j // h, megatron's GQA grouping), masks with -inf
where the mask says "do not attend", and returns megatron's [sq, b, np * hn].
Cases: causal with sq == sk; a decode-style chunk (sq < sk, the queries being
the last sq positions, so query i sees keys 0 .. sk - sq + i); an explicit
megatron mask (True = masked); packed sequences given by cu_seqlens, where
each sequence is causal on its own and never sees its neighbours (forward and
input gradients). fp32, tolerance 1e-5.

Not covered here: dropout, TP > 1 and the whole model (test_models_parity.py
compares the model with the SDPA backend against megatron's local attention).
"""
import math
from types import SimpleNamespace

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from megarl.models.sdpa_attention import SDPAAttention

NP, NG, HN = 4, 2, 8


def attention():
    config = TransformerConfig(num_layers=1, hidden_size=NP * HN, num_attention_heads=NP,
                               num_query_groups=NG, kv_channels=HN, attention_dropout=0.0)
    one_rank = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1))
    return SDPAAttention(config, 1, AttnMaskType.causal, "self", pg_collection=one_rank).eval()


def reference(q, k, v, masked):
    """q [sq, b, np, hn], k/v [sk, b, ng, hn], masked [*, *, sq, sk] (True = hidden) -> [sq, b, np*hn]."""
    k, v = (t.repeat_interleave(NP // NG, dim=2) for t in (k, v))
    scores = torch.einsum("qbnd,kbnd->bnqk", q, k) / math.sqrt(HN)
    probs = scores.masked_fill(masked, float("-inf")).softmax(-1)
    out = torch.einsum("bnqk,kbnd->qbnd", probs, v)
    return out.reshape(q.shape[0], q.shape[1], NP * HN)


def qkv(sq, sk, b=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(sq, b, NP, HN, generator=gen), torch.randn(sk, b, NG, HN, generator=gen),
            torch.randn(sk, b, NG, HN, generator=gen))


@pytest.mark.parametrize("sq, sk", [(6, 6), (3, 7), (1, 5)])
def test_causal_bottom_right(sq, sk):
    """Query i (of the last sq positions) sees keys j <= sk - sq + i."""
    q, k, v = qkv(sq, sk)
    masked = torch.ones(sq, sk, dtype=torch.bool).triu(sk - sq + 1)
    got = attention()(q, k, v, None)
    torch.testing.assert_close(got, reference(q, k, v, masked), rtol=0, atol=1e-5)


def test_explicit_mask():
    q, k, v = qkv(5, 5, seed=1)
    masked = torch.rand(2, 1, 5, 5, generator=torch.Generator().manual_seed(2)) < 0.4
    masked &= ~torch.eye(5, dtype=torch.bool)  # no fully hidden row
    got = attention()(q, k, v, masked)
    torch.testing.assert_close(got, reference(q, k, v, masked), rtol=0, atol=1e-5)


def test_packed_sequences():
    """cu_seqlens [0, 3, 7, 8]: three sequences of 3, 4, 1 tokens in one [t=8] pack."""
    q, k, v = (t[:, 0].requires_grad_() for t in qkv(8, 8, b=1, seed=3))  # thd: [t, heads, hn]
    cu = torch.tensor([0, 3, 7, 8], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=4, max_seqlen_kv=4)
    got = attention()(q, k, v, None, packed_seq_params=params)
    assert got.shape == (8, NP * HN)
    seq = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2])
    masked = (seq[:, None] != seq[None, :]) | torch.ones(8, 8, dtype=torch.bool).triu(1)
    want = reference(q[:, None], k[:, None], v[:, None], masked)[:, 0]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    weights = torch.randn(got.shape, generator=torch.Generator().manual_seed(4))
    grads = torch.autograd.grad((got * weights).sum(), (q, k, v))
    want_grads = torch.autograd.grad((want * weights).sum(), (q, k, v))
    for g, w in zip(grads, want_grads):  # backward through the per-sequence pieces
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)
