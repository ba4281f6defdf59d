"""megarl_kernels.logprob: values and gradients against the spec, TP2 == TP1.

Forward and backward (random weights on both outputs) of the Triton and
chunked torch paths against log_softmax + gather + entropy in fp32, on odd
vocab sizes with several ragged vocab chunks, bf16 logits, temperature, 3-D
and row-strided inputs. TP2 runs two gloo processes on CPU, each holding half
the vocab (ranks own [r*V/2, (r+1)*V/2)), and checks the TP2 outputs equal
TP1 on the full logits and each rank's gradient equals its slice of the TP1
gradient. Not covered: NCCL, TP > 2, sequence-parallel hidden states.
"""

import torch

from kernel_backends import BACKENDS, DEVICE, HAS_TRITON  # noqa: E402  (sets TRITON_INTERPRET first)

import importlib  # noqa: E402

import pytest  # noqa: E402
import torch.distributed as dist  # noqa: E402
from dist_helpers import spawn  # noqa: E402

from megarl_kernels import logprob_entropy, logprob_entropy_ref  # noqa: E402

logprob_mod = importlib.import_module("megarl_kernels.logprob")
# bf16 grads: the interpreter rounds fp32 -> bf16 toward zero (GPU: nearest), so allow 2 bf16 ulps.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-5, rtol=1.6e-2)}


def _inputs(N, V, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(N, V, generator=g) * 4).to(dtype)
    return (logits.to(DEVICE), torch.randint(0, V, (N,), generator=g).to(DEVICE),
            torch.randn(N, generator=g).to(DEVICE), torch.randn(N, generator=g).to(DEVICE))


def _run(fn, logits, *args, g_lp=None, g_ent=None, **kw):
    """(logprob, entropy, grad_logits) of fn; loss = sum(g_lp * lp + g_ent * ent)."""
    x = logits.detach().clone().requires_grad_(True)
    lp, ent = fn(x, *args, **kw)
    loss = 0
    if g_lp is not None:
        loss = loss + (lp * g_lp).sum()
    if g_ent is not None:
        loss = loss + (ent * g_ent).sum()
    loss.backward()
    return lp.detach(), ent.detach(), x.grad


def _check(got, want, dtype):
    for g, w, tol in zip(got, want, [TOL[torch.float32]] * 2 + [TOL[dtype]]):
        torch.testing.assert_close(g.float(), w.float(), **tol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("N,V,dtype,temp", [(3, 1, torch.float32, 1.0), (5, 37, torch.float32, 1.0),
                                            (7, 293, torch.float32, 0.7), (4, 1031, torch.bfloat16, 1.3)])
def test_matches_ref(monkeypatch, backend, N, V, dtype, temp):
    monkeypatch.setattr(logprob_mod, "BLOCK_V", 128)  # V=293 / 1031: 3 / 9 chunks, ragged last
    monkeypatch.setattr(logprob_mod, "TORCH_CHUNK_ELEMS", 600)  # torch path: several row chunks
    logits, tgt, g_lp, g_ent = _inputs(N, V, dtype)
    want = _run(logprob_entropy_ref, logits, tgt, None, temp, g_lp=g_lp, g_ent=g_ent)
    got = _run(logprob_entropy, logits, tgt, None, temp, backend=backend, g_lp=g_lp, g_ent=g_ent)
    assert got[0].dtype == got[1].dtype == torch.float32 and got[2].dtype == dtype
    _check(got, want, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("which", ["lp", "ent"])
def test_one_output_in_loss(backend, which):
    logits, tgt, g_lp, g_ent = _inputs(6, 50, torch.float32, seed=1)
    kw = {"g_lp": g_lp} if which == "lp" else {"g_ent": g_ent}
    _check(_run(logprob_entropy, logits, tgt, backend=backend, **kw),
           _run(logprob_entropy_ref, logits, tgt, **kw), torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_3d_and_row_strided(backend):
    """(B, T, V) input, and a (N, V) view whose rows are strided (a slice of wider logits)."""
    logits, tgt, g_lp, g_ent = _inputs(6, 40, torch.float32, seed=2)
    want = _run(logprob_entropy_ref, logits, tgt, g_lp=g_lp, g_ent=g_ent)
    got = _run(logprob_entropy, logits.view(2, 3, 40), tgt.view(2, 3), backend=backend,
               g_lp=g_lp.view(2, 3), g_ent=g_ent.view(2, 3))
    _check([t.reshape(w.shape) for t, w in zip(got, want)], want, torch.float32)
    wide = torch.cat([logits, torch.randn(6, 9, device=DEVICE)], 1)[:, :40]  # stride(0) = 49
    lp, ent = logprob_entropy(wide, tgt, backend=backend)
    torch.testing.assert_close(lp, want[0], **TOL[torch.float32])
    torch.testing.assert_close(ent, want[1], **TOL[torch.float32])


def _tp2_worker(rank: int, backends):
    """One TP rank: shard of the vocab, compare with TP1 computed locally on the full tensors."""
    dist.init_process_group("gloo")  # rank, world size, address from dist_helpers' environment
    group = dist.group.WORLD
    N, V = 5, 74  # V/2 = 37 per rank
    logits, tgt, g_lp, g_ent = _inputs(N, V, torch.float32, seed=4)
    logits, tgt, g_lp, g_ent = logits.cpu(), tgt.cpu(), g_lp.cpu(), g_ent.cpu()
    shard = slice(rank * V // 2, (rank + 1) * V // 2)
    tp1 = _run(logprob_entropy_ref, logits, tgt, None, 0.8, g_lp=g_lp, g_ent=g_ent)
    tp1 = (tp1[0], tp1[1], tp1[2][:, shard])
    for backend in backends + ["ref"]:
        tp2 = _run(logprob_entropy, logits[:, shard], tgt, group, 0.8, backend=backend, g_lp=g_lp, g_ent=g_ent)
        _check(tp2, tp1, torch.float32)


def test_tp2_equals_tp1_gloo():
    """TP2 values and gradients == TP1 (torch, triton when usable, and the ref's gather path)."""
    backends = ["torch"] + (["triton"] if HAS_TRITON and DEVICE == "cpu" else [])
    spawn(_tp2_worker, 2, backends)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_large_vocab():
    """bf16, V=152064 (37 chunks of 4096, ragged), against the chunked torch path."""
    logits, tgt, g_lp, g_ent = _inputs(64, 152064, torch.bfloat16, seed=6)
    _check(_run(logprob_entropy, logits, tgt, backend="triton", g_lp=g_lp, g_ent=g_ent),
           _run(logprob_entropy, logits, tgt, backend="torch", g_lp=g_lp, g_ent=g_ent), torch.bfloat16)
