"""megarl_kernels.reshard: layout conversions are bitwise exact.

Triton == ref bitwise, round trips are the identity bitwise, and the refs
match the layouts written out by hand (Megatron QKV interleave, [gate; up]
per TP shard). Odd sizes everywhere (head_dim 3, hidden 5, tensors whose
byte size is not a multiple of 16, misaligned views). On CPU the Triton
path runs in the interpreter.
"""

import torch

from kernel_backends import BACKENDS, DEVICE, needs_triton  # noqa: E402  (sets TRITON_INTERPRET first)


import pytest  # noqa: E402

from megarl_kernels import (  # noqa: E402
    fc1_merge,
    fc1_split,
    fc1_split_ref,
    pad_vocab,
    padded_vocab_size,
    qkv_merge,
    qkv_merge_ref,
    qkv_split,
    qkv_split_ref,
    tp_concat,
    tp_split,
    unpad_vocab,
)

DTYPES = [torch.float32, torch.bfloat16]


def _rand(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype).to(DEVICE)


def _same(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def _qkv_by_hand(q, k, v, H, G, d):
    """Megatron order: for each group g, its h query heads, then its k head, then its v head."""
    h = H // G
    rows = []
    for g in range(G):
        rows += [q[g * h * d:(g + 1) * h * d], k[g * d:(g + 1) * d], v[g * d:(g + 1) * d]]
    return torch.cat(rows)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,G,d,hidden", [(6, 2, 3, 5), (4, 4, 3, 7), (5, 1, 2, 3), (6, 3, 3, None)])
def test_qkv(backend, dtype, H, G, d, hidden):
    """GQA, MHA (G=H), MQA (G=1), and 1-D bias (hidden=None)."""
    rest = () if hidden is None else (hidden,)
    q, k, v = _rand(H * d, *rest, dtype=dtype), _rand(G * d, *rest, dtype=dtype), _rand(G * d, *rest, dtype=dtype)
    fused = _qkv_by_hand(q, k, v, H, G, d)
    assert _same(qkv_merge_ref(q, k, v, G), fused)
    for got, want in zip(qkv_split_ref(fused, H, G), (q, k, v)):
        assert _same(got, want)
    assert _same(qkv_merge(q, k, v, G, backend=backend), fused)
    for got, want in zip(qkv_split(fused, H, G, backend=backend), (q, k, v)):
        assert _same(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tp", [1, 2, 3])
def test_fc1(backend, tp):
    """TP-concatenated fc1 is [gate_0; up_0; gate_1; up_1; ...]; ffn=21 (7 rows per shard at tp=3)."""
    ffn, hidden = 21 if tp != 2 else 22, 5
    gate, up = _rand(ffn, hidden, dtype=torch.bfloat16), _rand(ffn, hidden, dtype=torch.bfloat16)
    by_hand = torch.cat([torch.cat([g, u]) for g, u in zip(gate.chunk(tp), up.chunk(tp))])
    assert _same(fc1_merge(gate, up, tp, backend=backend), by_hand)
    for got, want in zip(fc1_split(by_hand, tp, backend=backend), (gate, up)):
        assert _same(got, want)
    for got, want in zip(fc1_split_ref(by_hand, tp), (gate, up)):
        assert _same(got, want)


def test_interleave_errors():
    with pytest.raises(ValueError, match="heads"):
        qkv_split(_rand(20, 3), 5, 2)


def test_vocab_padding_and_tp():
    assert padded_vocab_size(32000, 128, 1) == 32000 and padded_vocab_size(151655, 128, 2) == 151808
    w = _rand(37, 5, dtype=torch.bfloat16)
    p = pad_vocab(w, 64)
    assert p.shape == (64, 5) and (p[37:] == 0).all() and _same(unpad_vocab(p, 37), w)
    for dim in (0, 1):
        x = _rand(6, 9)
        shards = tp_split(x, 3, dim)
        assert all(s.data_ptr() >= x.data_ptr() for s in shards)  # views
        assert _same(tp_concat(shards, dim), x)
    with pytest.raises(ValueError):
        tp_split(_rand(5, 4), 2, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_qkv_split_large():
    qkv = _rand(3 * 4096, 4096, dtype=torch.bfloat16)
    for a, b in zip(qkv_split(qkv, 32, 8, backend="triton"), qkv_split_ref(qkv, 32, 8)):
        assert _same(a, b)
