"""megarl.roles.apex_free: apex's fused weight-gradient accumulation, grad norm and scale in plain torch.

On the CPU the fused weight gradient runs its reference branch (the GEMM, then
the add into ``main_grad``: the same kernels DDP's hook runs unfused), so an
actor update with the fused path on has the *same* gradients, bitwise, as with
it off, at TP2; the tiny model's tied embedding (megatron's ``zero_out_wgrad``:
the embedding's own gradient must not be lost) gets its two parts summed in
another order, so it is equal to fp32 rounding. Calls are
counted, so a fused path that is silently not taken fails. The cuBLAS branch
(bf16 inputs, fp32 accumulate) is checked against fp32 math by a GPU test.
"""
import pytest
import torch

from dist_helpers import spawn

LENGTHS = [12, 9, 12, 7, 5, 11, 6, 3]
MICRO = 4  # 2 micro-batches
TIED = "embedding.word_embeddings.weight"  # also the output layer's weight (tie_word_embeddings)


def _batch(vocab: int):
    from megarl.roles.batch import SampleBatch

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(5, vocab, (len(LENGTHS), max(LENGTHS)), generator=gen)
    mask = torch.zeros(ids.shape)
    for i, n in enumerate(LENGTHS):
        mask[i, 2:n] = 1.0
    return SampleBatch(ids, mask, torch.tensor(LENGTHS), old_logprobs=-torch.rand(ids.shape, generator=gen),
                       advantages=torch.randn(ids.shape, generator=gen))


def _update(cfg, groups, fused: bool) -> dict:
    from megatron.core.tensor_parallel import layers

    from megarl.roles import apex_free
    from megarl.roles.build import build_actor

    actor = build_actor(cfg, groups, 4)
    linears = [m for m in actor.module.modules() if hasattr(m, "gradient_accumulation_fusion")]
    switched = sum(m.gradient_accumulation_fusion for m in linears)
    for m in linears:
        m.gradient_accumulation_fusion = fused
    calls = []
    layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32 = lambda *a: (calls.append(1),
                                                                               apex_free.wgrad_gemm_accum_fp32(*a))
    try:
        (m,) = actor.update(_batch(actor.info.vocab_size), cfg.actor, 1.0, [torch.arange(len(LENGTHS))], norm_len=8)
    finally:
        layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32 = apex_free.wgrad_gemm_accum_fp32
    grads = {name: p.main_grad.detach().numpy().copy() for name, p in actor.module.named_parameters()}
    return {"loss": m["actor/pg_loss"], "grad_norm": m["grad_norm"], "grads": grads,
            "calls": len(calls), "switched": switched, "layers": len(actor.module.decoder.layers)}


def _job(rank):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.config import Config
    from megarl.distributed import build_parallel_groups, init_distributed

    init_distributed()
    groups = build_parallel_groups(2, 1)
    model_parallel_cuda_manual_seed(0)
    cfg = Config()
    cfg.actor.optim.lr, cfg.actor.optim.clip_grad = 0.0, 0.0
    cfg.actor.micro_batch_size = MICRO
    return {fused: _update(cfg, groups, fused) for fused in (False, True)}


def test_fused_wgrad_equals_unfused_tp2():
    for out in spawn(_job, 2):
        plain, fused = out[False], out[True]
        linears = 4 * fused["layers"] + 1  # qkv, proj, fc1, fc2 per layer; the (tied) output layer
        assert fused["switched"] == linears  # build_trainable turned every trainable linear on
        assert plain["calls"] == 0 and fused["calls"] == linears * len(LENGTHS) // MICRO
        assert fused["loss"] == plain["loss"]
        assert fused["grads"].keys() == plain["grads"].keys()
        for name, want in plain["grads"].items():
            got, want = torch.from_numpy(fused["grads"][name]), torch.from_numpy(want)
            assert want.abs().max() > 0 or name == TIED, name  # rank 1's vocab rows: all padding (57 < 128)
            if name == TIED:  # output-layer and embedding gradients summed in another order
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)
            else:
                assert torch.equal(got, want), (name, (got - want).abs().max())
        assert fused["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-6)


def _tensors(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=gen).to(dtype) for shape in ((3, 5), (7,), (2, 2, 4))]


def test_l2norm_is_the_norm_of_all_tensors():
    """As megatron's fallback (which builds its result on "cuda", so it is not called here): norm of norms."""
    from megarl.roles.apex_free import multi_tensor_l2norm

    tensors = _tensors()
    got, per_tensor = multi_tensor_l2norm(0, None, [tensors], False)
    assert got.shape == (1,) and got.dtype == torch.float32 and per_tensor is None
    torch.testing.assert_close(got[0], torch.cat([t.reshape(-1) for t in tensors]).norm(), rtol=1e-6, atol=0)
    torch.testing.assert_close(got[0], torch.tensor([t.norm() for t in tensors]).norm(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_scale_equals_megatron_fallback(scale):
    from megatron.core.utils import local_multi_tensor_scale

    from megarl.roles.apex_free import multi_tensor_scale

    src = _tensors()
    for dst_dtype in (torch.float32, torch.bfloat16):  # bf16: main params copied to model params
        want, got = _tensors(dst_dtype), _tensors(dst_dtype)
        local_multi_tensor_scale(0, None, [src, want], scale)
        multi_tensor_scale(0, None, [src, got], scale)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    want, got = _tensors(), _tensors()  # in place: clip_grads scales [grads, grads]
    local_multi_tensor_scale(0, None, [want, want], scale)
    multi_tensor_scale(0, None, [got, got], scale)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_install_replaces_only_the_fallbacks():
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.tensor_parallel import layers

    from megarl.roles import apex_free

    apex_free.install()
    apex_free.install()  # idempotent
    assert clip_grads.l2_norm_impl is apex_free.multi_tensor_l2norm
    assert clip_grads.multi_tensor_scale_impl is optimizer.multi_tensor_scale_impl is apex_free.multi_tensor_scale
    assert layers._grad_accum_fusion_available
    assert layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32 is apex_free.wgrad_gemm_accum_fp32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_wgrad_accum_cublas_matches_fp32():
    """bf16 inputs, fp32 main_grad: accumulated in place (twice) without a bf16 rounding of the product."""
    from megarl.roles.apex_free import wgrad_gemm_accum_fp32

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(300, 64, device="cuda", generator=gen).bfloat16()  # [t, in]
    dy = torch.randn(300, 96, device="cuda", generator=gen).bfloat16()  # [t, out]
    main_grad = torch.randn(96, 64, device="cuda", generator=gen)
    want = main_grad + 2 * (dy.float().t() @ x.float())
    ptr = main_grad.data_ptr()
    wgrad_gemm_accum_fp32(x, dy, main_grad)
    wgrad_gemm_accum_fp32(x, dy, main_grad)
    assert main_grad.data_ptr() == ptr and main_grad.dtype == torch.float32
    torch.testing.assert_close(main_grad, want, rtol=1e-5, atol=1e-4)
