"""megarl_kernels MoE: routing per family, the expert-sorted layout, and the fused expert MLPs.

Routing is checked against each family's plain formula and against transformers' own routers
(same ids, same fp32 weights); replayed routing against the routing it replays (weights and
gradients); routing + experts against transformers' whole sparse MoE blocks. The layout against its loop spec and its invariants (every local
slot exactly once, each block one expert, padding only at run ends). `fused_moe` (both backends)
against the per-token spec on odd shapes (T 1 / 7 / 33, H 32 / 48, F 24 / 40, E 4 / 8, k 1 / 2),
experts with no tokens, every token on one expert, each dtype; the EP shares of two disjoint expert
ranges sum to the full layer. Tolerances: fp32 to 1e-5; fp16 to 4 fp16 steps; bf16 to 4 bf16
steps, because under TRITON_INTERPRET the kernel's fp32 -> bf16 roundings truncate (the GPU rounds
to nearest, and is held to 2 steps). Not covered on CPU: the GPU tiles' timing (bench_moe_kernels.py)
and CUDA graph capture (the `gpu` tests).
"""
import itertools

import torch

from kernel_backends import BACKENDS, DEVICE, needs_triton  # noqa: E402  (sets TRITON_INTERPRET first)

import pytest  # noqa: E402

from megarl_kernels import interpret_mode  # noqa: E402
from megarl_kernels.fused_moe import (  # noqa: E402
    block_rows, fused_moe, fused_moe_local, fused_moe_ref, fused_moe_torch, fused_moe_triton,
)
from megarl_kernels.moe_align import max_padded_rows, moe_align, moe_align_ref  # noqa: E402
from megarl_kernels.moe_routing import moe_route, moe_route_ref, moe_route_replay  # noqa: E402

BF16_STEP = 2 ** -7
TOL = {torch.float32: 1e-5, torch.float16: 4 * 2 ** -10,
       torch.bfloat16: (4 if interpret_mode() else 2) * BF16_STEP}


def _layer(t, h, f, e, k, dtype=torch.float32, seed=0):
    """Inputs of one MoE layer: hidden (T, H), w13 (E, 2F, H), w2 (E, H, F), Qwen3 routing of random logits."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * f, h, generator=g) * h ** -0.5
    w2 = torch.randn(e, h, f, generator=g) * f ** -0.5
    weights, ids = moe_route(torch.randn(t, e, generator=g), k, "qwen3_moe")
    return [v.to(dtype).to(DEVICE) for v in (x, w13, w2)] + [weights.to(DEVICE), ids.to(DEVICE)]


def _run(backend, *layer, **kw):
    return fused_moe(*layer, backend=backend) if not kw else fused_moe_triton(*layer, **kw)


def _close(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype
    tol = TOL[want.dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


# ---- routing ----

def _softmax_topk(logits, k):
    p = logits.double().exp() / logits.double().exp().sum(-1, keepdim=True)
    return torch.topk(p, k)


@pytest.mark.parametrize("kind,norm", [("qwen3_moe", None), ("qwen3_moe", False), ("qwen2_moe", None),
                                       ("qwen2_moe", True), ("mixtral", None)])
def test_routing_is_each_familys_formula(kind, norm):
    logits = torch.randn(37, 8, generator=torch.Generator().manual_seed(1)) * 3
    weights, ids = moe_route(logits, 3, kind, norm)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (37, 3)
    assert (weights[:, :-1] >= weights[:, 1:]).all()  # largest first
    renormalized = {"qwen3_moe": norm is not False, "qwen2_moe": bool(norm), "mixtral": True}[kind]
    if kind == "mixtral":  # the original formula: top-k of the logits, then a softmax over those k
        top, want_ids = torch.topk(logits, 3)
        want = torch.softmax(top.double(), -1)
    else:
        p, want_ids = _softmax_topk(logits, 3)
        want = p / p.sum(-1, keepdim=True) if renormalized else p
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights.double(), want, rtol=1e-6, atol=1e-7)
    sums = weights.sum(-1)
    assert torch.allclose(sums, torch.ones(37), atol=1e-6) == renormalized
    ref_weights, ref_ids = moe_route_ref(logits, 3, kind, norm)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind,norm", [("qwen3_moe", False), ("qwen3_moe", True), ("qwen2_moe", False),
                                       ("qwen2_moe", True), ("mixtral", True)])
def test_routing_equals_transformers_routers(kind, norm):
    """The ids and fp32 weights of transformers' own router module on the same logits, bitwise."""
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    size = dict(hidden_size=16, num_experts_per_tok=2)
    router = {"qwen3_moe": lambda: Qwen3MoeTopKRouter(transformers.Qwen3MoeConfig(**size, num_experts=8,
                                                                                   norm_topk_prob=norm)),
              "qwen2_moe": lambda: Qwen2MoeTopKRouter(transformers.Qwen2MoeConfig(**size, num_experts=8,
                                                                                   norm_topk_prob=norm)),
              "mixtral": lambda: MixtralTopKRouter(transformers.MixtralConfig(**size, num_local_experts=8))}[kind]()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 16, generator=g))
        logits, hf_weights, hf_ids = router(torch.randn(29, 16, generator=g))
    weights, ids = moe_route(logits, 2, kind, None if kind == "mixtral" else norm)
    assert torch.equal(ids.long(), hf_ids) and torch.equal(weights, hf_weights)


def test_routing_ties_follow_torch_topk():
    """Equal logits (and logits closer than softmax's rounding): the experts torch.topk picks on the
    fp32 probabilities, weights split evenly."""
    logits = torch.zeros(3, 6)
    logits[1, 2:] = 1.0
    logits[2] = torch.tensor([0.0, 1e-9, 0.0, 1e-9, 0.0, 0.0])
    for kind in ("qwen3_moe", "mixtral", "qwen2_moe"):
        weights, ids = moe_route(logits, 2, kind)
        assert torch.equal(ids.long(), torch.topk(torch.softmax(logits, -1), 2).indices)
    weights, _ = moe_route(logits, 2, "qwen3_moe")
    assert torch.equal(weights, torch.full((3, 2), 0.5))


@pytest.mark.parametrize("kind,norm", [("qwen3_moe", True), ("qwen2_moe", False), ("mixtral", None)])
def test_replayed_routing(kind, norm):
    """Replaying the ids `moe_route` chose gives its weights and its logits' gradient bit for bit;
    replaying other ids gives the current softmax at those ids (renormalized as the family does)."""
    logits = torch.randn(11, 8, generator=torch.Generator().manual_seed(15), requires_grad=True)
    weights, ids = moe_route(logits, 2, kind, norm)
    (grad,) = torch.autograd.grad((weights * torch.arange(1.0, 3.0)).sum(), logits)
    replayed = moe_route_replay(logits, ids, kind, norm)
    (replay_grad,) = torch.autograd.grad((replayed * torch.arange(1.0, 3.0)).sum(), logits)
    assert torch.equal(replayed, weights) and torch.equal(replay_grad, grad)
    other = (ids + 3) % 8
    p = torch.softmax(logits.detach().double(), -1).gather(1, other.long())
    want = p / p.sum(-1, keepdim=True) if kind != "qwen2_moe" else p
    torch.testing.assert_close(moe_route_replay(logits, other, kind, norm).detach().double(), want,
                               rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="moe_route_replay: logits"):
        moe_route_replay(logits, ids[:3], kind, norm)


def test_routing_bf16_logits_and_bad_input():
    logits = torch.randn(5, 8).bfloat16()
    weights, ids = moe_route(logits, 2, "qwen3_moe")
    want_w, want_ids = moe_route(logits.float(), 2, "qwen3_moe")
    assert weights.dtype == torch.float32 and torch.equal(ids, want_ids) and torch.equal(weights, want_w)
    with pytest.raises(ValueError, match="moe_route: kind='deepseek'"):
        moe_route(logits, 2, "deepseek")
    with pytest.raises(ValueError, match="mixtral always renormalizes"):
        moe_route(logits, 2, "mixtral", False)
    with pytest.raises(ValueError, match="0 < top_k <= E"):
        moe_route(logits, 9, "qwen3_moe")


# ---- the expert-sorted layout ----

ALIGN_CASES = [(7, 2, 4, 4, 0), (33, 2, 8, 16, 0), (1, 1, 4, 16, 0), (9, 3, 3, 4, 2), (20, 2, 4, 16, 1),
               (64, 1, 2, 16, 0), (0, 2, 4, 16, 0), (300, 8, 128, 16, 0), (40, 2, 5, 32, 3)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("t,k,e,block_m,first", ALIGN_CASES)
def test_alignment_equals_its_spec_and_keeps_its_invariants(backend, t, k, e, block_m, first):
    """(T, k, E local, BLOCK_M, first expert); ids are drawn from [0, E + 2 * first), so with first > 0
    some slots belong to other ranks. (300, 8, 128): the kernel takes its slots in several chunks."""
    g = torch.Generator().manual_seed(t * 100 + e)
    ids = torch.argsort(torch.rand(t, e + 2 * first, generator=g), dim=1)[:, :k].int()  # k distinct a row
    got, want = moe_align(ids.to(DEVICE), e, block_m, first, backend=backend), moe_align_ref(ids, e, block_m, first)
    for name in ("sorted_slots", "block_experts", "num_padded"):
        assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), name
    slots, blocks, used = want.sorted_slots, want.block_experts, int(want.num_padded)
    s = t * k
    assert len(slots) == max_padded_rows(s, e, block_m) and len(blocks) == len(slots) // block_m
    assert used % block_m == 0 and (slots[used:] == s).all() and (blocks[used // block_m:] == -1).all()
    local = ids.reshape(-1).long() - first
    mine = ((local >= 0) & (local < e)).nonzero().squeeze(1)
    real = slots[slots < s].long()
    assert torch.equal(real.sort().values, mine)  # every local slot exactly once
    row_expert = blocks.repeat_interleave(block_m)[:used]  # (used,)
    on_slot = slots[:used] < s
    assert torch.equal(local[slots[:used][on_slot].long()], row_expert[on_slot].long())  # a block = one expert
    assert (row_expert[:-1] <= row_expert[1:]).all()  # experts ascending
    counts = torch.bincount(local[mine], minlength=e)[:e]
    assert torch.equal(torch.bincount(blocks[blocks >= 0].long(), minlength=e), (counts + block_m - 1) // block_m)


def test_block_rows_by_slots_per_expert():
    assert [block_rows(s, 128) for s in (256, 2048, 4096, 16384)] == [16, 32, 32, 64]


# ---- fused_moe ----

SHAPES = list(itertools.product([1, 7, 33], [32, 48], [24, 40], [4, 8], [1, 2]))  # T, H, F, E, k


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("t,h,f,e,k", SHAPES)
def test_fused_moe_equals_the_spec(backend, t, h, f, e, k):
    layer = _layer(t, h, f, e, k, seed=t)
    _close(_run(backend, *layer), fused_moe_ref(*layer))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("t", [3, 12])
def test_qwen3_30b_routing_shape(backend, t):
    """128 experts, top-8 (the Qwen3-30B-A3B router) on small H and F: 128-expert one-hot chunks in
    the layout kernel; many experts empty, and at T = 12 some with two or more slots."""
    layer = _layer(t, 32, 24, 128, 8, seed=17)
    counts = torch.bincount(layer[4].flatten().long().cpu(), minlength=128)
    assert (counts == 0).sum() > 32 and (t == 3 or counts.max() >= 2)
    _close(_run(backend, *layer), fused_moe_ref(*layer))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", [7, 33])
def test_fused_moe_half_dtypes(backend, dtype, t):
    layer = _layer(t, 48, 40, 8, 2, dtype, seed=3)
    _close(_run(backend, *layer), fused_moe_ref(*layer))


def _hf_moe_block(kind):
    """transformers' sparse MoE block (router + stacked experts) of a tiny config, random fp32 weights."""
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    size = dict(hidden_size=32, num_experts_per_tok=2, hidden_act="silu")
    if kind == "mixtral":
        block = MixtralSparseMoeBlock(transformers.MixtralConfig(**size, intermediate_size=24, num_local_experts=8))
    else:
        config = transformers.Qwen3MoeConfig(**size, moe_intermediate_size=24, num_experts=8, norm_topk_prob=True)
        block = Qwen3MoeSparseMoeBlock(config)
    g = torch.Generator().manual_seed(13)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return block.eval()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_route_and_experts_equal_transformers_moe_block(backend, kind):
    """`moe_route` + `fused_moe` on the block's own router and expert tensors (gate_up_proj is w13,
    down_proj is w2, no copy or reordering) give transformers' block output in fp32."""
    block = _hf_moe_block(kind)
    x = torch.randn(13, 32, generator=torch.Generator().manual_seed(14))
    with torch.no_grad():
        want = block(x[None])[0]
        weights, ids = moe_route(torch.nn.functional.linear(x, block.gate.weight), 2, kind,
                                 None if kind == "mixtral" else True)
        experts = block.experts
        dev = [t.to(DEVICE) for t in (x, experts.gate_up_proj, experts.down_proj, weights, ids)]
        got = fused_moe(*dev, backend=backend)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_tiles_ragged_steps(dtype):
    """16-wide tiles: several K steps with a ragged last one in both GEMMs (H 48, F 40), three column
    tiles of F and H, and BLOCK_M 16 with most blocks partly padding."""
    layer = _layer(33, 48, 40, 4, 2, dtype, seed=4)
    small = (16, 16, 4, 1)
    _close(_run("triton", *layer, block_m=16, gate_up_tiles=small, down_tiles=small), fused_moe_ref(*layer))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("k", [1, 2])
def test_one_expert_takes_every_token(backend, k):
    """Every token on expert 3 (and, k = 2, on expert 6 too): one expert's run spans three blocks; the
    others have no tokens."""
    x, w13, w2, weights, ids = _layer(33, 32, 24, 8, k, seed=6)
    ids = torch.tensor([3, 6][:k], dtype=torch.int32, device=DEVICE).expand(33, k).contiguous()
    _close(_run(backend, x, w13, w2, weights, ids), fused_moe_ref(x, w13, w2, weights, ids))
    if backend == "triton":
        _close(_run(backend, x, w13, w2, weights, ids, block_m=16), fused_moe_ref(x, w13, w2, weights, ids))


@pytest.mark.parametrize("backend", BACKENDS)
def test_experts_without_tokens_and_an_empty_batch(backend):
    x, w13, w2, weights, ids = _layer(7, 32, 24, 8, 2, seed=7)
    ids = torch.where(ids % 2 == 0, ids, ids - 1)  # only even experts; two ids may now coincide
    _close(_run(backend, x, w13, w2, weights, ids), fused_moe_ref(x, w13, w2, weights, ids))
    empty = _run(backend, x[:0], w13, w2, weights[:0], ids[:0])
    assert empty.shape == (0, 32) and empty.dtype == x.dtype


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("split", [4, 3])
def test_ep_shares_sum_to_the_layer(backend, split):
    """Ranks holding experts [0, split) and [split, 8) each compute their share; the shares sum to
    `fused_moe` (k = 2: a token's two choices may land on one rank or both) and each equals the spec
    restricted to its range."""
    x, w13, w2, weights, ids = _layer(33, 48, 40, 8, 2, seed=8)
    shares = []
    for lo, hi in ((0, split), (split, 8)):
        share = fused_moe_local(x, w13[lo:hi], w2[lo:hi], weights, ids, lo, backend=backend)
        _close(share, fused_moe_ref(x, w13[lo:hi], w2[lo:hi], weights, ids, first_expert=lo))
        shares.append(share)
    _close(shares[0] + shares[1], fused_moe(x, w13, w2, weights, ids, backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_weight_views(backend):
    """w13 as megatron's GroupedMLP keeps fc1 ((H, E * 2F), seen as (E, 2F, H): rows of stride 1) and
    w2 transposed per expert: the same result as the contiguous weights, no copy made."""
    x, w13, w2, weights, ids = _layer(7, 48, 40, 4, 2, seed=12)
    w13_view = w13.permute(2, 0, 1).contiguous().view(48, 4 * 80).view(48, 4, 80).permute(1, 2, 0)
    w2_view = w2.transpose(1, 2).contiguous().transpose(1, 2)
    assert w13_view.stride(1) == 1 and w2_view.stride(1) == 1 and torch.equal(w13_view, w13)
    _close(_run(backend, x, w13_view, w2_view, weights, ids), fused_moe_ref(x, w13, w2, weights, ids))


def test_torch_path_gradients_equal_the_specs():
    """Autograd through `fused_moe_torch` (and the routing before it) gives the per-token spec's
    gradients of hidden, w13, w2 and the router logits."""
    g = torch.Generator().manual_seed(16)
    leaves = [torch.randn(9, 16, generator=g), torch.randn(4, 24, 16, generator=g) * 0.25,
              torch.randn(4, 16, 12, generator=g) * 0.3, torch.randn(9, 4, generator=g)]
    grads = []
    for moe in (fused_moe_torch, fused_moe_ref):
        x, w13, w2, logits = (t.clone().requires_grad_() for t in leaves)
        weights, ids = moe_route(logits, 2, "qwen3_moe")
        out = moe(x, w13, w2, weights, ids)
        grads.append(torch.autograd.grad((out * torch.arange(16.0)).sum(), [x, w13, w2, logits]))
    for got, want in zip(*grads):
        assert want.abs().max() > 0
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_cpu_default_is_the_torch_path_and_bad_shapes_are_one_line_errors():
    layer = [v.cpu() for v in _layer(7, 32, 24, 4, 2)]
    assert torch.equal(fused_moe(*layer), fused_moe_torch(*layer))
    x, w13, w2, weights, ids = layer
    with pytest.raises(ValueError, match="fused_moe: hidden .T, H., w13 .E, 2F, H."):
        fused_moe(x, w13[:, :, 1:], w2, weights, ids)
    with pytest.raises(ValueError, match="fused_moe_local: hidden"):
        fused_moe_local(x, w13, w2[:, :, 1:], weights, ids, 0)
    with pytest.raises(ValueError, match="dense rows"):
        fused_moe(torch.cat([x, x], 1)[:, ::2], w13, w2, weights, ids)


def test_kernels_compile_for_hopper_without_a_gpu():
    """The interpreter does not compile: tests/kernel_aot.py lowers every MoE launch to an sm_90 cubin
    (in a process without TRITON_INTERPRET). Each must fit a program's shared memory, and the GEMMs'
    loads must be software-pipelined (cp.async), as the model's sizes make them on the GPU."""
    import importlib.util
    import json
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    here = os.path.dirname(os.path.abspath(__file__))
    run = subprocess.run([sys.executable, os.path.join(here, "kernel_aot.py")], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    kernels = [json.loads(line) for line in run.stdout.splitlines()]
    assert len(kernels) == 6
    for k in kernels:
        assert 0 <= k["shared"] <= 232448, k
        assert k["cp_async"] == ("BLOCK_M" in k["name"]), k


# ---- GPU ----

@pytest.mark.gpu
@pytest.mark.parametrize("t", [32, 256, 2048])
def test_gpu_qwen3_30b_expert_shape(t):
    """The Qwen3-30B-A3B expert shape in bf16 against the torch path (bmm, rounding to nearest)."""
    layer = _layer(t, 2048, 768, 128, 8, torch.bfloat16, seed=9)
    _close(fused_moe(*layer, backend="triton"), fused_moe_torch(*layer))


@pytest.mark.gpu
def test_gpu_decode_replays_in_a_cuda_graph():
    """Fixed grids and no host sync: a captured call replays with new routing and gives fresh results."""
    x, w13, w2, weights, ids = _layer(32, 256, 128, 16, 2, torch.bfloat16, seed=10)
    fused_moe(x, w13, w2, weights, ids, backend="triton")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, weights, ids, backend="triton")
    _, _, _, new_weights, new_ids = _layer(32, 256, 128, 16, 2, torch.bfloat16, seed=11)
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    _close(out, fused_moe_ref(x, w13, w2, weights, ids))


@pytest.mark.gpu
@pytest.mark.parametrize("t,k,e,block_m", [(256, 8, 128, 16), (33, 2, 8, 16), (100, 8, 256, 32)])
def test_gpu_alignment_kernel_equals_its_spec(t, k, e, block_m):
    """On the GPU the one-program kernel's fill and placement are ordered by its barrier; the interpreter
    runs them in order anyway, so the ordering is only tested here."""
    from megarl_kernels.moe_align import moe_align_triton

    ids = torch.argsort(torch.rand(t, e), dim=1)[:, :k].int()
    got, want = moe_align_triton(ids.cuda(), e, block_m), moe_align_ref(ids, e, block_m)
    for name in ("sorted_slots", "block_experts", "num_padded"):
        assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), name
