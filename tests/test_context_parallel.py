"""Ulysses context parallelism (megarl/models/context_parallel.py): CP2 gives the numbers of CP1.

The CP ranks hold chunks r and 2cp-1-r of every sequence (megatron's load-balanced
layout, padded to 2cp chunks); the attention all-to-alls trade tokens for heads
and back; heads gather the per-position numbers into whole sequences. On the tiny
Llama (fp32, CPU) the reference's log-probs, the critic's values, the reward
model's scores, the actor's loss and grad norm in all four aggregations, the
critic update and the on-policy update equal one process's (CP1) within 1e-5,
at CP2 and at CP2 x TP2. The layout and the all-to-alls are also checked alone.
"""
import pytest
import torch

from dist_helpers import spawn
from test_packed_training import AGG_MODES, _assert_close, _measure, _plain, _roles


def test_chunk_index_is_load_balanced_and_covers_every_token():
    from megarl.models.context_parallel import chunk_index

    index = chunk_index([0, 8, 12], cp=2)  # sequences of 8 and 4 tokens: chunks of 2 and 1
    assert index.tolist() == [[0, 1, 6, 7, 8, 11], [2, 3, 4, 5, 9, 10]]
    assert sorted(index.reshape(-1).tolist()) == list(range(12))


def _all_to_alls(rank):
    """seq_to_heads then heads_to_seq is the identity; the middle holds whole sequences."""
    from megarl.distributed import build_parallel_groups, init_distributed
    from megarl.models.context_parallel import chunk_index, gather_order, heads_to_seq, seq_to_heads

    init_distributed()
    groups = build_parallel_groups(1, 1, 2)
    index = chunk_index([0, 8, 12], cp=2)
    full = torch.arange(12 * 4 * 3, dtype=torch.float).reshape(12, 4, 3)  # [T, H, d]
    mine = full[index[groups.cp_rank]]
    mid = seq_to_heads(mine, gather_order(index), groups.cp, 2)  # [T, H/2, d]: this rank's 2 heads, all tokens in order
    back = heads_to_seq(mid, index, groups.cp, 2)
    heads = slice(2 * groups.cp_rank, 2 * groups.cp_rank + 2)
    return bool(torch.equal(mid, full[:, heads])) and bool(torch.equal(back, mine))


def test_all_to_alls_trade_tokens_for_heads_and_back():
    assert all(spawn(_all_to_alls, 2))


def _numbers(rank, ckpt, tp, cp):
    cfg, groups, roles = _roles(ckpt, tp, 1, cp)
    return _plain(_measure(cfg, groups, roles, True, 0))


@pytest.fixture(scope="module")
def cp1(ckpt):
    return spawn(_numbers, 1, ckpt, 1, 1)[0]


@pytest.mark.parametrize("tp,cp", [(1, 2), (2, 2)])
def test_context_parallel_equals_one_process(ckpt, cp1, tp, cp):
    for rank, got in enumerate(spawn(_numbers, tp * cp, ckpt, tp, cp)):
        for key in ("ref_logprobs", "values", "scores"):
            _assert_close(got[key], cp1[key], (tp, cp, rank, key))
        for mode in AGG_MODES:
            for i, what in enumerate(("loss", "grad_norm")):
                _assert_close(got[mode][i], cp1[mode][i], (tp, cp, rank, mode, what))
        for i, what in enumerate(("vf_loss", "grad_norm")):
            _assert_close(got["critic"][i], cp1["critic"][i], (tp, cp, rank, "critic", what))
        for i, what in enumerate(("grad_norm", "logprobs")):
            _assert_close(got["on_policy"][i], cp1["on_policy"][i], (tp, cp, rank, "on_policy", what))
