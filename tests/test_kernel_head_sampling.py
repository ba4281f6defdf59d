"""megarl.kernels.head_sampling: the output layer fused with the sampler's first pass, against its spec.

On CPU the kernel runs in the interpreter on small integer-valued h and w, so every logit is exact in
bf16 and the spec's tokens must come out exactly (log-probs to 1e-5); plain, greedy (ties: the lowest
id) and filtered rows (top-k / top-p, finished by bisection over the kernel's logits) in one batch, a
vocab with padding rows and a last partial slice. On the GPU (marked gpu) the Qwen2.5-1.5B head: the
kernel's logits within one bf16 rounding of F.linear's, and its tokens exactly `sample_tokens` of them.
"""
import torch

from kernel_backends import DEVICE, needs_triton  # noqa: E402  (sets TRITON_INTERPRET first)

import pytest  # noqa: E402

from megarl.kernels.head_sampling import BLOCK_V, head_partials, sample_head, sample_head_ref  # noqa: E402
from megarl.kernels.sampling import finish, row_settings, sample_tokens  # noqa: E402


def _settings(m, mode, n, g):
    temp = torch.rand(m, generator=g) * 1.5 + 0.25
    top_k = torch.full((m,), -1, dtype=torch.int32)
    top_p = torch.ones(m)
    if mode == "greedy":
        temp.zero_()
    if mode == "mixed":  # plain, greedy, top-k, top-p, both, k = 1
        kind = torch.arange(m) % 6
        temp[kind == 1] = 0.0
        top_k[kind == 2], top_k[kind == 4], top_k[kind == 5] = 5, n // 3, 1
        top_p[kind == 3], top_p[kind == 4] = 0.7, 0.9
    seeds = torch.randint(-2**62, 2**62, (m,), generator=g)
    offsets = torch.randint(0, 4096, (m,), generator=g)
    return temp, top_k, top_p, seeds, offsets


def _case(m, v, k, mode, seed=0):
    """Integer h in [-2, 2] and w in [-1, 1] with k = 64: |logit| <= 128, exact in bf16."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randint(-2, 3, (m, k), generator=g).to(torch.bfloat16)
    w = torch.randint(-1, 2, (v, k), generator=g).to(torch.bfloat16)
    return [t.to(DEVICE) for t in (h, w, *_settings(m, mode, v - 3, g))]


@needs_triton
@pytest.mark.parametrize("mode", ["plain", "greedy", "mixed"])
@pytest.mark.parametrize("m", [1, 7, 33, 65])
def test_matches_spec(mode, m):
    h, w, *rows = _case(m, 2 * BLOCK_V + 45, 64, mode, seed=m)
    n = w.shape[0] - 3  # padding rows past n: never sampled, in no softmax
    got = sample_head(h, w, *rows, vocab_size=n, backend="triton")
    want = sample_head_ref(*(t.cpu() for t in (h, w, *rows)), vocab_size=n)
    assert got[0].dtype == torch.int64 and torch.equal(got[0].cpu(), want[0])
    torch.testing.assert_close(got[1].cpu(), want[1], rtol=1e-5, atol=1e-5)
    assert (got[0] < n).all()
    if mode == "greedy":  # integer logits tie often: the lowest id wins
        logits = torch.nn.functional.linear(h.float(), w.float())[:, :n].cpu()
        assert torch.equal(want[0], logits.argmax(-1))


@needs_triton
def test_logits_partials_and_out():
    """The kernel's logits are F.linear's (exact here); `finish` over its partials gives the same tokens
    as `sample_tokens` over those logits; out= lands in a wider buffer's rows; a row alone gets the bits
    it gets in the batch (the slices do not depend on the batch)."""
    h, w, *rows = _case(9, 3 * BLOCK_V, 64, "plain", seed=3)
    n = w.shape[0]
    logits, pf, pi = head_partials(h, w, row_settings(*rows), n)
    assert torch.equal(logits.float().cpu(), torch.nn.functional.linear(h.float(), w.float()).cpu())
    assert pf.shape == (3, 9, 3) and pi.shape == (3, 9, 3)
    tokens = torch.empty(9, dtype=torch.int64, device=DEVICE)
    logprobs = torch.empty(9, device=DEVICE)
    finish(logits, n, row_settings(*rows), pf, pi, tokens, logprobs)
    want = sample_tokens(logits, *rows, backend="torch")
    assert torch.equal(tokens.cpu(), want[0].cpu())
    wide = torch.full((2, 12), -5.0, device=DEVICE)
    got = sample_head(h, w, *rows, backend="triton", out=wide[:, :9])
    assert got[0].data_ptr() == wide[0].data_ptr() and torch.equal(wide[0, :9].long().cpu(), tokens.cpu())
    assert torch.equal(wide[1, :9].cpu(), logprobs.cpu()) and (wide[:, 9:] == -5.0).all()
    alone = sample_head(h[4:5], w, *(t[4:5] for t in rows), backend="triton")
    assert alone[0].item() == tokens[4].item() and alone[1].item() == logprobs[4].item()


@needs_triton
def test_chunks_agree():
    """65 rows: the epilogue's row chunks (16, or 32 with a partial last one) give the same bits."""
    h, w, *rows = _case(65, 2 * BLOCK_V, 64, "mixed", seed=4)
    settings = row_settings(*rows)
    a = head_partials(h, w, settings, w.shape[0], tiles=(3, 4, 16))
    b = head_partials(h, w, settings, w.shape[0], tiles=(3, 4, 32))
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_falls_back_and_checks():
    """Shapes the kernel does not take (fp32, more than 128 rows) run the spec; bad shapes are refused."""
    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(3, 32, generator=g), torch.randn(50, 32, generator=g)
    rows = _settings(3, "mixed", 50, g)
    got = sample_head(h, w, *rows)
    want = sample_head_ref(h, w, *rows)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="h \\(M, K\\)"):
        sample_head(h, w[:, :16], *rows)
    with pytest.raises(ValueError, match="vocab_size"):
        sample_head(h, w, *rows, vocab_size=51)
    with pytest.raises(ValueError, match="\\(3,\\)"):
        sample_head(h, w, rows[0][:2], *rows[1:])


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 96, 128])
def test_cuda_qwen_head(m):
    """The Qwen2.5-1.5B head (151,936 x 1,536, bf16): logits within one bf16 rounding of cuBLAS's, and the
    fused sampler's tokens exactly those of `sample_tokens` over the kernel's own logits."""
    g = torch.Generator(device="cuda").manual_seed(m)
    h = torch.randn(m, 1536, device="cuda", generator=g).bfloat16()
    w = (torch.randn(151936, 1536, device="cuda", generator=g) * 0.05).bfloat16()
    rows = [t.cuda() for t in _settings(m, "mixed", 151936, torch.Generator().manual_seed(m))]
    logits, pf, pi = head_partials(h, w, row_settings(*rows), 151936)
    if m >= 64:  # other stages, warps and chunks: the same logits (the same K order) and partials
        other = head_partials(h, w, row_settings(*rows), 151936, tiles=(4, 4, 32))
        assert all(torch.equal(a, b) for a, b in zip(other, (logits, pf, pi)))
    ref = torch.nn.functional.linear(h, w)
    assert ((logits.float() - ref.float()).abs() <= ref.float().abs() * 2**-7 + 1e-6).all()
    got = sample_head(h, w, *rows)
    want = sample_tokens(logits, *rows)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
