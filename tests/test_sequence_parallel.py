"""Sequence parallelism on megatron-core's local layer spec gives the numbers of plain TP.

Under ``parallel.sequence_parallel`` each TP rank holds 1 / tp of the sequence between the attention and
MLP blocks (norms and residual adds run on that slice; the linears gather and reduce-scatter it). The
functions computed are the same, so on the fixed batch of tests/test_packed_training.py (tiny Llama, TP2,
packed and padded rows) the reference's log-probs, the critic's values, the reward model's scores, the
actor's loss and grad norm in every loss aggregation, the critic's update and the on-policy update equal
TP2 without it (fp32, 1e-5). The grad norm holds only if every norm weight's gradient, a partial sum
per TP rank under sequence parallelism, is summed over TP: megarl/models/local_norm.py marks the weights
for megatron-core's sum (the value head marks its own). Not covered: transformer-engine's spec, PP with it.
"""
import pytest

from dist_helpers import spawn
from test_packed_training import AGG_MODES, _assert_close, _measure, _plain


def _layouts(rank, ckpt):
    from dataclasses import replace

    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.config import Config
    from megarl.distributed import build_parallel_groups, init_distributed
    from megarl.roles.build import build_actor, build_critic, build_reference, build_reward_model

    init_distributed()
    out = {}
    for sequence_parallel in (False, True):
        groups = build_parallel_groups(2, 1, 1)
        model_parallel_cuda_manual_seed(0)
        cfg = Config()
        cfg.model.path = cfg.reward.model.path = ckpt
        cfg.parallel.tp, cfg.parallel.sequence_parallel = 2, sequence_parallel
        cfg.actor.optim.lr = cfg.critic.optim.lr = 0.0
        cfg.actor.micro_batch_size = cfg.critic.micro_batch_size = 2
        roles = (build_actor(cfg, groups, 8), build_reference(cfg, groups), build_critic(cfg, groups, 8),
                 build_reward_model(cfg, groups))
        out[sequence_parallel] = {"pad_multiple": roles[0].options.pad_multiple,
                                  "packed": _measure(cfg, groups, roles, True, 0),
                                  "padded": _measure(cfg, groups, roles, False, 0)}
        out[sequence_parallel]["marked"] = sorted(
            name for name, p in roles[0].module.named_parameters() if getattr(p, "sequence_parallel", False))
    return _plain(out)


def test_sequence_parallel_equals_plain_tp(ckpt):
    for rank in spawn(_layouts, 2, ckpt):
        plain, split = rank[False], rank[True]
        assert (plain["pad_multiple"], split["pad_multiple"]) == (1, 2)
        assert "decoder.final_layernorm.weight" in split["marked"] and not plain["marked"]
        assert "decoder.layers.0.input_layernorm.weight" in split["marked"]
        for rows in ("packed", "padded"):
            a, b = plain[rows], split[rows]
            for key in ("ref_logprobs", "values", "scores"):
                _assert_close(b[key], a[key], (rows, key))
            for mode in AGG_MODES:
                for i, what in enumerate(("loss", "grad_norm")):
                    _assert_close(b[mode][i], a[mode][i], (rows, mode, what))
            for i, what in enumerate(("vf_loss", "grad_norm")):
                _assert_close(b["critic"][i], a["critic"][i], (rows, "critic", what))
            for i, what in enumerate(("grad_norm", "logprobs")):
                _assert_close(b["on_policy"][i], a["on_policy"][i], (rows, "on_policy", what))
