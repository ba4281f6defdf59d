"""trainer.mode=async with a reward model, ReMax and DAPO's dynamic sampling, against synchronous training
with as many data-parallel ranks as the async run has rollout replicas.

The rollout ranks build the reward model at their own layout (TP 1 here, as the synchronous run's) and
score each batch right after generating it, in the synchronous step's order (ReMax's greedy responses
scored first, then the samples; dynamic sampling: round by round, the replicas agreeing on each round
over their own data-parallel group). With ``async.max_staleness=0`` the weights that sample batch k are
the synchronous run's after k updates (bitwise, test_async_weights.py), and the prompts, seeds and round
seeds are the same functions of (step, round, dp rank); so the dumped batches (tokens, scores, group
ids) and every logged value except timings, resource samples and the async/* and weight-sync counters
are equal bitwise on CPU: reward/rm/mean, the greedy baseline's effect on advantages and losses, dapo/*
counts, score/*. The trainer adopts the rollout's sampler position after each batch (dynamic sampling
draws one batch of prompts per round), so its checkpoint records the synchronous run's data position.

Not covered: bitwise equality at rollout TP 2 (TP sums in another order), ReMax on several
replicas, GPUs.
"""
import json

import torch

from megarl.algos.dapo import informative_groups
from megarl.trainer.dump import dump_path
from test_async_pipeline import _comparable
from test_trainer_runs import SMALL, metrics, ppo

DAPO_SMALL = ["data.batch_size=8", "rollout.n=4", "actor.mini_batch_size=16", "actor.micro_batch_size=8",
              "trainer.eval_samples=8", "trainer.tensorboard=false", "trainer.export_hf=false"]
ASYNC = ["trainer.mode=async", "async.max_staleness=0"]


def _dumps(root, step: int, dp_rank: int = 0) -> dict:
    return torch.load(dump_path(str(root), step, dp_rank), weights_only=False)


def _same_batches(a, b, steps, dp: int = 1) -> None:
    for step, rank in ((s, r) for s in steps for r in range(dp)):
        x, y = _dumps(a, step, rank), _dumps(b, step, rank)
        for key in ("input_ids", "response_mask", "lengths", "rollout_logprobs", "group_ids", "scores"):
            assert torch.equal(x[key], y[key]), (step, rank, key)
        assert x["prompts"] == y["prompts"] and x["responses"] == y["responses"], (step, rank)


def test_reward_model_and_remax_equal_sync(tmp_path):
    """A random Qwen2ForSequenceClassification reward model (clipped to [0, 5]) beside the math term,
    ReMax advantages: 2 steps, the async run's scores (rm term included) and metrics equal sync's. At
    rollout TP 2 (3 ranks) the same tokens are sampled here and the scores agree within 1e-5."""
    from megarl.models.tiny import make_tiny_checkpoint

    rm_dir = tmp_path / "rm"
    make_tiny_checkpoint(str(rm_dir), "Qwen2ForSequenceClassification", vocab_size=57)
    args = [*SMALL, "trainer.save_every=0", "trainer.export_hf=false", "algorithm.rollout_correction.preset=none",
            "algorithm.advantage=remax", f"reward.model.path={rm_dir}", "reward.model.clip=[0,5]",
            "reward.model.micro_batch_size=4"]
    sync, asyn = tmp_path / "sync", tmp_path / "async"
    ppo("yaml/tiny_async.yaml", sync, *args, "trainer.mode=sync", f"trainer.dump_rollouts={tmp_path / 'd1'}",
        steps=2, nproc=1)
    out = ppo("yaml/tiny_async.yaml", asyn, *args, "async.max_staleness=0",
              f"trainer.dump_rollouts={tmp_path / 'd2'}", steps=2, nproc=2)
    assert out.count("loading the reward model") == 0  # the training rank does not build it (rank 0 speaks)
    a, b = metrics(sync), metrics(asyn)
    for step in (1, 2):
        assert _comparable(a[step]) == _comparable(b[step]), step
        assert 0.0 < b[step]["reward/rm/mean"] <= 5.0 and b[step]["reward/rm/failures"] == 0.0
    _same_batches(tmp_path / "d1", tmp_path / "d2", (1, 2))
    tp2 = tmp_path / "tp2"  # the policy copy and the reward model at TP 2 over 2 rollout ranks
    ppo("yaml/tiny_async.yaml", tp2, *args, *ASYNC, "placement.rollout_ranks=2", "placement.rollout_tp=2",
        f"trainer.dump_rollouts={tmp_path / 'd3'}", steps=2, nproc=3)
    c = metrics(tp2)
    for step in (1, 2):  # the same tokens sampled here; TP sums in another order: scores within float32 rounding
        x, y = _dumps(tmp_path / "d1", step), _dumps(tmp_path / "d3", step)
        assert torch.equal(x["input_ids"], y["input_ids"]), step
        assert torch.allclose(x["scores"], y["scores"], rtol=0, atol=1e-5), step
        assert abs(a[step]["reward/rm/mean"] - c[step]["reward/rm/mean"]) < 1e-5 and c[step]["reward/rm/failures"] == 0


def test_dynamic_sampling_on_two_replicas_equals_sync(tmp_path):
    """yaml/tiny_dapo.yaml (dynamic sampling, max 3 rounds, overlong shaping) with a reward model whose
    scores are clipped to [0, 0] (so the math term decides which groups are informative), 3 steps:
    synchronous on 2 ranks (DP 2) against async on 2 rollout + 2 training ranks (2 replicas). The two
    rollout replicas agree on the rounds as the synchronous DP ranks do, so the batches and metrics are
    equal bitwise (dapo/* counts summed over both replicas); some step had a replica full while the
    other was short (fewer groups generated than 8 per round: it drew the round's prompts without
    generating or scoring, which needs the reward model's out-of-memory agreement to stay inside its
    replica); every step trains on 8 groups, and when none was filled (dapo/groups_filled = 0) every
    dumped group's scores differ; the trainer's sampler followed the rounds (the checkpoint's data
    position is sync's)."""
    from megarl.models.tiny import make_tiny_checkpoint

    rm_dir = tmp_path / "rm"
    make_tiny_checkpoint(str(rm_dir), "Qwen2ForSequenceClassification", vocab_size=57)
    sync, asyn = tmp_path / "sync", tmp_path / "async"
    args = [*DAPO_SMALL, "trainer.save_every=3", f"reward.model.path={rm_dir}", "reward.model.clip=[0,0]",
            "reward.model.micro_batch_size=4"]
    ppo("yaml/tiny_dapo.yaml", sync, *args, f"trainer.dump_rollouts={tmp_path / 'd1'}", steps=3, nproc=2)
    ppo("yaml/tiny_dapo.yaml", asyn, *args, *ASYNC, "placement.rollout_ranks=2",
        f"trainer.dump_rollouts={tmp_path / 'd2'}", steps=3, nproc=4)
    a, b = metrics(sync), metrics(asyn)
    for step in (1, 2, 3):
        assert _comparable(a[step]) == _comparable(b[step]), step
        m = b[step]
        assert m["dapo/groups_kept"] + m["dapo/groups_filled"] == 8 and m["reward/rm/mean"] == 0.0, m
        dumped = [_dumps(tmp_path / "d2", step, r) for r in (0, 1)]
        groups = [g for d in dumped for g in informative_groups(d["scores"], d["group_ids"])]
        assert len(groups) == 8 and sum(inf for _, inf in groups) >= m["dapo/groups_kept"]
        if m["dapo/groups_filled"] == 0:
            assert all(inf for _, inf in groups), step
    assert any(b[s]["dapo/groups_generated"] < 8 * b[s]["dapo/rounds"] for s in (1, 2, 3))
    _same_batches(tmp_path / "d1", tmp_path / "d2", (1, 2, 3), dp=2)
    state = [json.load(open(run / "checkpoints" / "step_000003" / "state.json"))["sampler"] for run in (sync, asyn)]
    assert state[0] == state[1]


def test_dynamic_sampling_resume_equals_uninterrupted(tmp_path):
    """Dynamic sampling on 1 rollout + 1 training rank, max_staleness=0: 2 steps, then resumed to 4,
    equal 4 straight steps bitwise (steps 3-4). The resumed rollout rank starts from the sampler state
    in the start message (the checkpoint's, which the trainer took from the batches), so it must
    know the extra rounds' prompts of steps 1-2 (some step there took more than one round)."""
    args = [*DAPO_SMALL, *ASYNC, "placement.rollout_ranks=1", "trainer.save_every=2"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    ppo("yaml/tiny_dapo.yaml", straight, *args, steps=4)
    ppo("yaml/tiny_dapo.yaml", resumed, *args, steps=2)
    assert "resumed from step 2" in ppo("yaml/tiny_dapo.yaml", resumed, *args, steps=4)
    a, b = metrics(straight), metrics(resumed)
    assert a[1]["dapo/rounds"] + a[2]["dapo/rounds"] > 2
    for step in (3, 4):
        assert _comparable(a[step]) == _comparable(b[step]), step
