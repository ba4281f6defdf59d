"""An exactly on-policy update skips the separate old-log-prob forward without changing the step.

When the actor takes one optimizer step on the whole batch (one epoch, one
mini-batch per rank) with the weights that generated it, the old log-probs
are the update's own forward log-probs, detached. Skipping the separate
forward then changes nothing beyond fp32 rounding:

- Skip: old = lp.detach(), so log_ratio = lp - old = 0 exactly and the ratio
  exp(0) = 1 exactly; PPO's clipped surrogate, dual clip (bound c * -A > -A)
  and GSPO's sequence ratio exp(mean 0) all evaluate at ratio 1, clip_frac
  and approx_kl are 0, and the gradient is -A * grad lp (plus the entropy
  and KL-loss terms, which do not read old log-probs).
- Full: old comes from a separate forward (eval mode, no grad) under the same
  weights, over micro-batches of the rows in batch order, while the update
  runs micro-batches of the shuffled mini-batch. A token's log-prob then
  differs only by the rounding of differently shaped matmuls: |lp - old| <=
  4.8e-7 measured (fp32, CPU), ratio 1 + O(1e-7), far inside every clip range,
  so the loss and the gradient differ by that relative amount. When both
  forwards see the same micro-batches (rows in order; here also the
  token-budget bins) they round alike: log-probs, loss, grad norm and
  weights are bitwise equal (asserted for rows in order).

Asserted: loss, grad norm and every metric to 1e-6, updated weights to 1e-6
(lr 1e-4; Adam's first step lr * g / (|g| + eps) turns a 1e-7 relative change
of a near-zero g into up to ~1e-3 lr: 2e-7 measured), and the log-probs the
on-policy step returns equal the separate forward's on response tokens, at
PP1 and PP2 (the per-token outputs reach both stages). Short runs: step 1
with the skip logs the same policy entropy, rollout-vs-training mismatch and
KL as a replay of its dumped rollout through the full path (same rollout,
same initial weights), and a critic warm-up step keeps the old forward.

Not covered: bf16 (the rollout-vs-training mismatch there is what the metric
reports, not a test tolerance), TP/CP layouts of the on-policy step (it runs
the same head as the layout-tested update), GPU kernels.
"""
import math

import pytest
import torch

from dist_helpers import spawn
from megarl.models.tiny import make_tiny_checkpoint
from test_roles_layout import fixed_batch
from test_trainer_runs import SMALL, metrics, ppo

SETTINGS = {  # name: ActorConfig overrides
    "ppo": {},
    "ppo-dual-clip-entropy-kl": {"dual_clip": 3.0, "entropy_coef": 0.01, "kl_loss_coef": 0.1,
                                 "loss_agg": "seq-mean-token-sum-norm"},
    "gspo": {"policy_loss": "gspo", "loss_agg": "seq-mean-token-mean"},
    "ppo-dynamic-micro": {"max_tokens_per_micro": 24},
    "ppo-same-micro-batches": {"rows": "in order"},  # both forwards see the same micro-batches
}


def _config(**changes):
    from megarl.config import Config

    cfg = Config()
    for key, value in changes.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    return cfg


@pytest.mark.parametrize("changes, step, rows, dp, dropout, expected", [
    ({}, 0, 32, 1, 0.0, True),  # batch 32 x n 1 = mini-batch 32, one epoch
    ({"actor.ppo_epochs": 2}, 0, 32, 1, 0.0, False),
    ({"actor.mini_batch_size": 16}, 0, 32, 1, 0.0, False),  # two optimizer steps
    ({}, 0, 16, 2, 0.0, True),  # DP2: 16 rows per rank, per-rank mini-batch 16
    ({"actor.mini_batch_size": 16}, 0, 16, 2, 0.0, False),  # DP2: per-rank mini-batch 8 < 16 rows
    ({}, 0, 48, 1, 0.0, False),  # replayed rollout larger than the mini-batch
    ({"algorithm.kl_in_reward": True}, 0, 32, 1, 0.0, False),  # KL in the reward needs old log-probs first
    ({"critic.warmup_steps": 2}, 1, 32, 1, 0.0, False),  # gae: the actor waits for the critic
    ({"critic.warmup_steps": 2}, 2, 32, 1, 0.0, True),
    ({"critic.warmup_steps": 2, "algorithm.advantage": "grpo"}, 0, 32, 1, 0.0, True),  # no critic
    ({}, 0, 32, 1, 0.1, False),  # dropout: the old forward runs without it
])
def test_on_policy_predicate(changes, step, rows, dp, dropout, expected):
    from megarl.trainer.phases import on_policy_update

    assert on_policy_update(_config(**changes), step, rows, dp, dropout) is expected


def _batch(vocab: int):
    """The layout test's batch without old log-probs, with reference log-probs."""
    batch = fixed_batch(vocab)
    batch.old_logprobs = None
    gen = torch.Generator().manual_seed(1)
    batch.ref_logprobs = -torch.rand(batch.input_ids.shape, generator=gen) * 4
    return batch


def _one_update(ckpt, groups, overrides: dict, skip: bool):
    """A fresh actor, one optimizer step; (step metrics, old log-probs, updated weights)."""
    from megarl.roles.build import build_actor

    cfg = _config(**{"model.path": ckpt, "actor.micro_batch_size": 2})
    cfg.actor.optim.lr = 1e-4
    overrides = dict(overrides)
    in_order = overrides.pop("rows", None) == "in order"
    for key, value in overrides.items():
        setattr(cfg.actor, key, value)
    actor = build_actor(cfg, groups, optimizer_steps=1)
    initial = {k: v.detach().clone() for k, v in actor.module.named_parameters()}
    batch = _batch(57)
    shuffled = torch.randperm(len(batch), generator=torch.Generator().manual_seed(3))  # as _mini_batches
    index = torch.arange(len(batch)) if in_order else shuffled
    if skip:
        step, out = actor.update_on_policy(batch, cfg.actor, 1.0, index, norm_len=8)
        old = out["logprobs"]
    else:
        old = actor.logprobs(batch, cfg.actor.micro_batch_size, 1.0, cfg.actor.max_tokens_per_micro)["logprobs"]
        batch.old_logprobs = old
        (step,) = actor.update(batch, cfg.actor, 1.0, [index], norm_len=8)
    weights = {k: v.detach().clone() for k, v in actor.module.named_parameters()}
    moved = max(float((weights[k] - initial[k]).abs().max()) for k in weights)
    return step, old * batch.response_mask, weights, moved


def _compare(rank, ckpt, pp, settings):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.distributed import build_parallel_groups, init_distributed

    init_distributed()
    groups = build_parallel_groups(1, pp)
    model_parallel_cuda_manual_seed(0)
    out = {}
    for name, overrides in settings.items():
        (s_full, old_full, w_full, moved), (s_skip, old_skip, w_skip, _) = (
            _one_update(ckpt, groups, overrides, skip) for skip in (False, True))
        out[name] = {
            "steps": (s_full, s_skip),
            "logprob_diff": float((old_full - old_skip).abs().max()),
            "weight_diff": max(float((w_full[k] - w_skip[k]).abs().max()) for k in w_full),
            "weights_bitwise": all(torch.equal(w_full[k], w_skip[k]) for k in w_full),
            "weight_moved": moved,
        }
    return out


def _assert_same(result, name):
    full, skip = result["steps"]
    assert full.keys() == skip.keys(), name
    for key in full:
        assert skip[key] == pytest.approx(full[key], abs=1e-6, rel=1e-6), (name, key, full[key], skip[key])
    assert skip["actor/clip_frac"] == 0.0 and skip["actor/approx_kl"] == 0.0, name  # ratio exactly 1
    assert result["logprob_diff"] <= 1e-6, name
    assert result["weight_diff"] <= 1e-6 < result["weight_moved"], name


def test_on_policy_step_equals_full_path(ckpt):
    (result,) = spawn(_compare, 1, ckpt, 1, SETTINGS)
    for name in SETTINGS:
        _assert_same(result[name], name)
        print(name, {k: v for k, v in result[name].items() if k != "steps"})
    assert result["ppo-same-micro-batches"]["logprob_diff"] == 0.0
    assert result["ppo-same-micro-batches"]["weights_bitwise"]


def test_on_policy_step_pipeline(ckpt):
    """PP2: the on-policy step's per-token log-probs reach both stages and match the full path."""
    for result in spawn(_compare, 2, ckpt, 2, {"ppo": {}}):
        _assert_same(result["ppo"], "pp2")


def test_short_run_metrics_with_skip(tmp_path):
    """Step 1 of a GRPO run (KL loss against a random reference, so KL > 0) with one
    mini-batch (skip; its rollout dumped) and a replay of that rollout with two mini-batches
    (full path): the same rollout under the same initial weights, so the same entropy,
    rollout-vs-training mismatch and KL; only the skip run lacks timing/old_logprobs."""
    ref = tmp_path / "ref"
    make_tiny_checkpoint(str(ref), "Qwen2ForCausalLM", seed=1, vocab_size=57, eos_token_id=3)
    common = (*SMALL, "data.eval_path=null", "trainer.export_hf=false", "trainer.save_last=false",
              f"ref.path={ref}")
    dump = f"trainer.dump_rollouts={tmp_path / 'rollouts'}"
    ppo("yaml/tiny_grpo.yaml", tmp_path / "skip", *common, "actor.mini_batch_size=16", dump, steps=1)
    ppo("yaml/tiny_grpo.yaml", tmp_path / "full", *common, f"trainer.replay_rollouts={tmp_path / 'rollouts'}",
        steps=1)
    skip, full = metrics(tmp_path / "skip")[1], metrics(tmp_path / "full")[1]
    assert skip["perf/old_logprob_forward_skipped"] == 1.0 and "timing/old_logprobs" not in skip
    assert full["perf/old_logprob_forward_skipped"] == 0.0 and "timing/old_logprobs" in full
    keys = ("policy/entropy", "mismatch/abs_mean", "mismatch/abs_max", "kl/mean")
    for key in keys:
        assert math.isfinite(skip[key]), key
        assert skip[key] == pytest.approx(full[key], abs=1e-6, rel=1e-5), (key, skip[key], full[key])
    assert 0.0 < skip["policy/entropy"] < math.log(57)
    assert 0.0 <= skip["mismatch/abs_mean"] <= skip["mismatch/abs_max"] < 1e-3  # fp32 engine vs training
    assert skip["kl/mean"] > 0.01
    print({k: (skip[k], full[k]) for k in keys})


def test_critic_warmup_then_skip(tmp_path):
    """GAE with a critic warm-up of one step: step 1 updates only the critic, so it keeps the
    old forward (for the entropy and mismatch metrics); step 2 is on-policy and skips it."""
    ppo("yaml/tiny.yaml", tmp_path, *SMALL, "data.eval_path=null", "trainer.export_hf=false",
        "trainer.save_last=false", "actor.mini_batch_size=16", "critic.warmup_steps=1", steps=2)
    rows = metrics(tmp_path)
    first, second = rows[1], rows[2]
    assert first["perf/old_logprob_forward_skipped"] == 0.0 and "timing/old_logprobs" in first
    assert "actor/grad_norm" not in first
    assert second["perf/old_logprob_forward_skipped"] == 1.0 and "timing/old_logprobs" not in second
    assert second["actor/grad_norm"] > 0.0 and second["actor/clip_frac"] == 0.0
    for row in (first, second):
        assert 0.0 < row["policy/entropy"] < math.log(57)
        assert 0.0 <= row["mismatch/abs_mean"] <= row["mismatch/abs_max"] < 1e-3
        assert math.isfinite(row["critic/explained_variance"]) and math.isfinite(row["advantage/mean"])
