"""Packed (THD) micro-batches give the numbers of padded ones; DP balancing by LPT.

Padded rows compute every sequence under a causal mask, so a real token sees
exactly its own prefix; a packed row of the same sequences, attention cut at
every ``cu_seqlens`` boundary and RoPE restarting per sequence, computes the
same function of the same prefix. With next-token targets precomputed per
sequence, log-probs, values and last-token scores are then equal up to the
rounding of differently shaped matmuls (fp32: ~1e-7), and so are the losses
and gradients built from them. Asserted to 1e-5 at TP2, PP2 and DP2 for the
actor update in all four loss aggregations (loss and grad norm), the
reference's log-probs, the critic's values and its update, and the reward
model's scores; the DP2 run also re-deals rows by LPT (the expected loads are
derived below) and uses token-budget micro-batches for the packed side, and
its on-policy update's log-probs come back to the rows they came from.

Not covered here: sequence parallelism (test_sequence_parallel.py), CP (test_context_parallel.py),
interleaved pipelines, the CUDA varlen kernel (the ``gpu`` test below).
"""
import pytest
import torch

from dist_helpers import spawn

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
LENGTHS = [12, 11, 12, 10, 5, 4, 6, 3]  # DP2: rank 0 holds 45 tokens, rank 1 holds 18
TOL = dict(abs=1e-5, rel=1e-5)


# ---- pure functions ----------------------------------------------------------

def test_pack_rows_targets_and_pad_segment():
    from megarl.data.packing import build_packed_inputs, pack_rows

    ids = torch.tensor([[5, 6, 7, 0], [8, 0, 0, 0], [9, 10, 11, 12]])
    p = pack_rows(ids, torch.tensor([3, 1, 4]), pad_multiple=4)
    assert p.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12]]
    assert p.targets.tolist() == [[6, 7, 0, 0, 10, 11, 12, 0]]  # never the next sequence's first token
    assert p.position_ids.tolist() == [[0, 1, 2, 0, 0, 1, 2, 3]]
    assert p.cu_seqlens.tolist() == [0, 3, 4, 8] and p.max_seqlen == 4
    q = pack_rows(ids, torch.tensor([3, 1, 4]) - torch.tensor([0, 0, 1]), pad_multiple=4)  # T = 7 -> 8
    assert q.cu_seqlens.tolist() == [0, 3, 4, 7, 8] and q.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 0]]
    assert q.targets.tolist() == [[6, 7, 0, 0, 10, 11, 0, 0]] and q.position_ids[0, -1] == 0
    with pytest.raises(ValueError, match="lengths must be in"):
        pack_rows(ids, torch.tensor([3, 0, 4]))
    assert build_packed_inputs([[5, 6, 7], [8], [9, 10]]).targets.tolist() == [[6, 7, 0, 0, 10, 0]]


def test_packed_and_padded_rows_agree():
    """A per-position function of (token, target, position-in-sequence) lands on the same (b, l) entries."""
    from megarl.roles.inputs import packed_inputs, padded_inputs

    ids = torch.tensor([[5, 6, 7, 1], [8, 2, 2, 2], [9, 10, 11, 12]])
    lengths = torch.tensor([3, 1, 4])
    padded, packed = padded_inputs(ids, lengths), packed_inputs(ids, lengths, pad_multiple=3)

    def f(x):  # (b|1, l|T)
        return (x.input_ids * 100 + x.targets * 10 + x.position_ids).float()

    want = torch.tensor([[0, 560, 671, 0], [0, 0, 0, 0], [0, 1000, 1111, 1222]], dtype=torch.float)
    real = torch.arange(4) < lengths[:, None]
    assert torch.equal(packed.to_rows(f(packed)), want)
    assert torch.equal(torch.where(real, padded.to_rows(f(padded)), 0.0), want)
    assert packed.at_last_token(f(packed)).tolist() == padded.at_last_token(f(padded)).tolist() == [702, 800, 1203]
    assert packed.input_ids.shape == (1, 9) and packed.packed_seq_params.cu_seqlens_q.tolist() == [0, 3, 4, 8, 9]


def test_lpt_exact_and_bounded():
    from megarl.data.balance import balance_lpt, max_over_mean

    # longest first, each to the lighter rank (ties: rank 0): 12(#0) r0 12, 12(#2) r1 12, 11(#1) r0 23,
    # 10(#3) r1 22, 6(#6) r1 28, 5(#4) r0 28, 4(#5) r0 32 (its 4th row: full), 3(#7) r1 31
    assert balance_lpt(LENGTHS, 2, capacities=[4, 4]) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert balance_lpt(LENGTHS, 2) == [[0, 1, 4, 5], [2, 3, 6, 7]]  # free: 3(#7) goes to the lighter r1 anyway
    assert balance_lpt([9, 1, 1, 1], 2) == [[0], [1, 2, 3]]
    assert balance_lpt([9, 1, 1, 1], 2, capacities=[2, 2]) == [[0, 3], [1, 2]]  # #3: r1 full
    assert max_over_mean([32, 31]) == pytest.approx(32 / 31.5) and max_over_mean([0, 0]) == 1.0
    gen = torch.Generator().manual_seed(0)
    for ranks in (2, 3, 8):
        lengths = torch.randint(1, 500, (64,), generator=gen).tolist()
        bins = balance_lpt(lengths, ranks)
        assert sorted(i for b in bins for i in b) == list(range(64))
        loads = [sum(lengths[i] for i in b) for b in bins]
        assert max(loads) <= sum(lengths) / ranks + max(lengths)  # list scheduling bound
        assert max(loads) <= 4 / 3 * max(sum(lengths) / ranks, max(lengths)) + 1e-9  # LPT: 4/3 of a lower bound
    with pytest.raises(ValueError, match="cannot hold"):
        balance_lpt([1, 2, 3], 2, capacities=[1, 1])


def test_packing_config_errors():
    from megarl.errors import ConfigError
    from megarl.config import Config
    from megarl.config_checks import check_packing

    cfg = Config()
    cfg.model.attention_backend, cfg.model.layer_spec = "local", "local"
    with pytest.raises(ConfigError, match="actor.packing=true needs model.attention_backend=sdpa"):
        check_packing(cfg)
    cfg.actor.packing = cfg.critic.packing = False
    check_packing(cfg)  # padded rows run on megatron's unfused attention


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_matches_per_sequence_sdpa(dtype):
    """varlen_attn (flash) vs one SDPA per sequence: forward and backward, GQA, odd lengths."""
    from megarl.models.packed_attention import packed_attention_ref, packed_attention_varlen, varlen_available

    gen = torch.Generator(device="cuda").manual_seed(0)
    lens = [37, 1, 128, 255, 3]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    t, np_, ng, hn = sum(lens), 8, 2, 64
    q, k, v = (torch.randn(t, n, hn, device="cuda", dtype=dtype, generator=gen).requires_grad_()
               for n in (np_, ng, ng))
    assert varlen_available(q)
    scale = hn ** -0.5
    got = packed_attention_varlen(q, k, v, cu, cu, max(lens), max(lens), True, scale)
    want = packed_attention_ref(q, k, v, cu, cu, True, scale)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(got, want, **tol)
    w = torch.randn(got.shape, device="cuda", dtype=dtype, generator=gen)
    for a, b in zip(torch.autograd.grad((got * w).sum(), (q, k, v)), torch.autograd.grad((want * w).sum(), (q, k, v))):
        torch.testing.assert_close(a, b, **tol)


# ---- distributed: packed == padded -------------------------------------------

def fixed_batch(vocab: int):
    from megarl.roles.batch import SampleBatch

    gen = torch.Generator().manual_seed(0)
    b, width, prompt = len(LENGTHS), 12, 2
    ids = torch.randint(5, vocab, (b, width), generator=gen)
    lengths = torch.tensor(LENGTHS)
    mask = torch.zeros(b, width)
    for i, n in enumerate(LENGTHS):
        mask[i, prompt:n] = 1.0
        ids[i, n:] = 0
    return SampleBatch(ids, mask, lengths, old_logprobs=-torch.rand(b, width, generator=gen) * 4,
                       advantages=torch.randn(b, width, generator=gen),
                       values=torch.randn(b, width, generator=gen), returns=torch.randn(b, width, generator=gen))


def _roles(ckpt, tp, pp, cp=1):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.config import Config
    from megarl.distributed import build_parallel_groups, init_distributed
    from megarl.roles.build import build_actor, build_critic, build_reference, build_reward_model

    init_distributed()
    groups = build_parallel_groups(tp, pp, cp)
    model_parallel_cuda_manual_seed(0)
    cfg = Config()
    cfg.model.path = cfg.reward.model.path = ckpt
    cfg.actor.optim.lr = cfg.critic.optim.lr = 0.0
    cfg.actor.micro_batch_size = cfg.critic.micro_batch_size = 2
    roles = (build_actor(cfg, groups, 8), build_reference(cfg, groups), build_critic(cfg, groups, 8),
             build_reward_model(cfg, groups))
    return cfg, groups, roles


def _global(groups, values):
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    if groups.dp_size > 1:
        dist.all_reduce(t, group=groups.dp)
    return t


def _measure(cfg, groups, roles, packing, max_tokens):
    """Every number the comparison reads, under one layout of micro-batches."""
    from dataclasses import replace

    actor, ref, critic, rm = roles
    for role in roles:
        role.options = replace(role.options, packing=packing, dp_balance=packing and role is not rm)
    cfg.actor.max_tokens_per_micro = max_tokens
    full = fixed_batch(57)
    rows = len(full) // groups.dp_size
    batch = full.select(torch.arange(groups.dp_rank * rows, (groups.dp_rank + 1) * rows))
    out = {"ref_logprobs": ref.logprobs(batch, 2, 1.0, max_tokens)["logprobs"] * batch.response_mask,
           "values": critic.values(batch, 2) * batch.response_mask, "scores": rm.scores(batch, 2)}
    for mode in AGG_MODES:
        cfg.actor.loss_agg = mode
        (m,) = actor.update(batch, cfg.actor, 1.0, [torch.arange(rows)], norm_len=8)
        sums = _global(groups, [m["actor/pg_loss"], m["actor/count"]])
        out[mode] = (float(sums[0] / sums[1]), m["grad_norm"], m["dp_token_imbalance"], m["dp_token_imbalance_before"])
    (c,) = critic.update(batch, cfg.critic, [torch.arange(rows)])
    sums = _global(groups, [c["critic/vf_loss"], c["critic/tokens"]])
    out["critic"] = (float(sums[0] / sums[1]), c["grad_norm"])
    cfg.actor.loss_agg = "token-mean"
    m, lp = actor.update_on_policy(replace(batch, old_logprobs=None), cfg.actor, 1.0, torch.arange(rows), norm_len=8)
    out["on_policy"] = (m["grad_norm"], lp["logprobs"] * batch.response_mask)
    return out


def _plain(x):
    """Tensors as nested lists: a spawned rank's tensors would travel as shared memory it frees on exit."""
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, (tuple, list)):
        return type(x)(_plain(v) for v in x)
    return {k: _plain(v) for k, v in x.items()} if isinstance(x, dict) else x


def _packed_vs_padded(rank, ckpt, tp, pp, max_tokens):
    cfg, groups, roles = _roles(ckpt, tp, pp)
    return _plain((_measure(cfg, groups, roles, False, 0), _measure(cfg, groups, roles, True, max_tokens)))


def _assert_close(a, b, what):
    if isinstance(a, list):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=1e-5, msg=str(what))
    else:
        assert a == pytest.approx(b, **TOL), what


@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2"])
def test_packed_equals_padded(ckpt, layout):
    tp, pp, max_tokens = {"tp2": (2, 1, 0), "pp2": (1, 2, 0), "dp2": (1, 1, 24)}[layout]
    for rank, (padded, packed) in enumerate(spawn(_packed_vs_padded, 2, ckpt, tp, pp, max_tokens)):
        for key in ("ref_logprobs", "values", "scores"):
            _assert_close(packed[key], padded[key], (layout, rank, key))
        for mode in AGG_MODES:
            for i, what in enumerate(("loss", "grad_norm")):
                _assert_close(packed[mode][i], padded[mode][i], (layout, rank, mode, what))
        for i, what in enumerate(("vf_loss", "grad_norm")):
            _assert_close(packed["critic"][i], padded["critic"][i], (layout, rank, "critic", what))
        for i, what in enumerate(("grad_norm", "logprobs")):
            _assert_close(packed["on_policy"][i], padded["on_policy"][i], (layout, rank, "on_policy", what))
        if layout == "dp2":  # loads 45 / 18 before; token-budget LPT: 32 / 31 (test_lpt_exact_and_bounded)
            assert packed["token-mean"][2:] == pytest.approx((32 / 31.5, 45 / 31.5))
            assert padded["token-mean"][2:] == (1.0, 1.0)  # padded side: no balancing
