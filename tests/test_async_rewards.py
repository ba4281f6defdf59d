"""trainer.mode=async with a reward model, ReMax and DAPO's dynamic sampling (1 rollout rank + 1 training
rank) against synchronous training in one process.

The rollout rank builds the reward model at its own layout (TP 1 here, as the synchronous run's) and
scores each batch right after generating it, in the synchronous step's order (samples, then ReMax's
greedy responses before them; dynamic sampling: round by round). With ``async.max_staleness=0`` the
weights that sample batch k are the synchronous run's after k updates (bitwise, test_async_weights.py),
the prompts, seeds and round seeds are the same functions of (step, round, dp rank), so the dumped
batches (tokens, scores, group ids) and every logged value except timings, resource samples and the
async/* and weight-sync counters are equal bitwise on CPU: reward/rm/mean, the greedy baseline's
effect on the advantages and losses, dapo/* counts, score/*. The trainer adopts the rollout's sampler
position after each batch (dynamic sampling draws one batch of prompts per round), so the checkpoint
of step 2 records the same data position as the synchronous run's.

Not covered: several rollout replicas agreeing on rounds (the synchronous DP agreement is the same
code, tests/test_dapo.py), a reward model at rollout TP 2, GPUs.
"""
import json

import torch

from megarl.algos.dapo import informative_groups
from megarl.trainer.dump import dump_path
from test_async_pipeline import _comparable
from test_trainer_runs import SMALL, metrics, ppo

DAPO_SMALL = ["data.batch_size=8", "rollout.n=4", "actor.mini_batch_size=16", "actor.micro_batch_size=8",
              "trainer.eval_samples=8", "trainer.tensorboard=false", "trainer.export_hf=false"]
ASYNC = ["trainer.mode=async", "placement.rollout_ranks=1", "async.max_staleness=0"]


def _dumps(root, step: int) -> dict:
    return torch.load(dump_path(str(root), step, 0), weights_only=False)


def _same_batches(a, b, steps) -> None:
    for step in steps:
        x, y = _dumps(a, step), _dumps(b, step)
        for key in ("input_ids", "response_mask", "lengths", "rollout_logprobs", "group_ids", "scores"):
            assert torch.equal(x[key], y[key]), (step, key)
        assert x["prompts"] == y["prompts"] and x["responses"] == y["responses"], step


def test_reward_model_and_remax_equal_sync(tmp_path):
    """A random Qwen2ForSequenceClassification reward model (clipped to [0, 5]) beside the math term,
    ReMax advantages: 2 steps, the async run's scores (rm term included) and metrics equal sync's."""
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


def test_dynamic_sampling_equals_sync_and_keeps_informative_groups(tmp_path):
    """yaml/tiny_dapo.yaml (dynamic sampling, max 3 rounds, overlong shaping) for 3 steps: the async
    run's batches and metrics equal sync's bitwise (dapo/* counts included); every step trains on 8
    groups; when none was filled (dapo/groups_filled = 0) every group of the dumped batch has scores
    that differ; some step needed a second round (so the sampler drew more than one batch of prompts
    in a step, and the trainer's position followed: the last checkpoint's sampler state is sync's)."""
    sync, asyn = tmp_path / "sync", tmp_path / "async"
    args = [*DAPO_SMALL, "trainer.save_every=3"]
    ppo("yaml/tiny_dapo.yaml", sync, *args, f"trainer.dump_rollouts={tmp_path / 'd1'}", steps=3, nproc=1)
    ppo("yaml/tiny_dapo.yaml", asyn, *args, *ASYNC, f"trainer.dump_rollouts={tmp_path / 'd2'}", steps=3, nproc=2)
    a, b = metrics(sync), metrics(asyn)
    for step in (1, 2, 3):
        assert _comparable(a[step]) == _comparable(b[step]), step
        m = b[step]
        assert m["dapo/groups_kept"] + m["dapo/groups_filled"] == 8, m
        batch = _dumps(tmp_path / "d2", step)
        groups = informative_groups(batch["scores"], batch["group_ids"])
        assert len(groups) == 8 and sum(inf for _, inf in groups) >= m["dapo/groups_kept"]
        if m["dapo/groups_filled"] == 0:
            assert all(inf for _, inf in groups), step
    assert sum(b[s]["dapo/rounds"] for s in (1, 2, 3)) > 3
    _same_batches(tmp_path / "d1", tmp_path / "d2", (1, 2, 3))
    state = [json.load(open(run / "checkpoints" / "step_000003" / "state.json"))["sampler"] for run in (sync, asyn)]
    assert state[0] == state[1]
