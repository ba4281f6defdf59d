"""rollout.partial with trainer.mode=async: the rollout ranks keep the unfinished groups between batches.

A token's policy version is the version of the weights the rollout rank held when it sampled it.
The staleness bound applies to a batch's oldest token (as AReaL bounds a trajectory's head version):
before generating batch k the rollout rank starts over, from the same seed, every sample holding a
token older than ``k - lag_bound`` (``partial/restarted_stale``), so no token a step trains on lags
it by more than the bound, and the training rank checks that (``SampleBatch.policy_version`` is the
oldest token's). Bounding the batch's newest version instead would let a response begun many
updates ago through whole; its earliest tokens carry the largest ratio pi_old / pi_roll, which the
per-token rollout correction then has to truncate or mask anyway.

Consequence: ``max_staleness=0`` with partial rollouts is not synchronous partial rollouts bitwise.
At bound 0 every carried token is too old, so the rollout rank samples every carried response again,
while the synchronous run continues them (its ages are unbounded). What holds at bound 0 is that
every trained token is the current policy's (checked below).

Resume: each batch carries the rollout replica's groups in flight after it; the training ranks adopt
them and save them with their checkpoints (one file per rank, as in sync), and the start message
gives them back to the rollout replica, which continues them under the checkpoint's weights.
"""
import torch

from megarl.rollout.engine import SamplingParams
from megarl.trainer.dump import dump_path
from megarl.trainer.partial import PartialRollouts
from test_partial import N, QUOTA, ScriptedEngine, _draw
from test_trainer_runs import metrics, ppo

SMALL = ["rollout.partial=true", "data.batch_size=8", "rollout.n=2", "rollout.max_new_tokens=24",
         "actor.mini_batch_size=16", "actor.micro_batch_size=8", "trainer.eval_samples=8", "trainer.tensorboard=false",
         "trainer.export_hf=false", "algorithm.rollout_correction.preset=none", "trainer.save_every=0"]
LAGGED = ["async.max_staleness=2", "async.queue_size=2"]  # batches lag <= 1, tokens <= 2: carried ones survive


def _async_steps(bound: int, lag: int, steps: int = 8):
    """The rollout rank's loop over a scripted engine: batch k is sampled by the weights ``max(0, k - lag)``
    after the restart of samples older than ``k - bound`` (lag <= bound, as the queue ensures)."""
    p, engine, draw = PartialRollouts(QUOTA, N, batches=3, max_new_tokens=16), ScriptedEngine(), _draw([0])
    for k in range(steps):
        engine.version = version = max(0, k - lag)
        p.restart_older_than(k - bound)
        before = {(id(g), j): list(s.tokens) for g in p.groups for j, s in enumerate(g.samples)}
        p.top_up(draw, seed=1000 * k)
        p.generate(engine, SamplingParams(), version)
        yield p, version, p.take(), before


def test_continued_responses_keep_their_tokens_and_each_tokens_version_and_logprob():
    continued = 0
    for k, (p, version, taken, before) in enumerate(_async_steps(bound=2, lag=1)):  # like LAGGED
        for g in taken:
            for j, s in enumerate(g.samples):
                assert s.tokens == [(s.seed + i) % 97 for i in range(1 + s.seed % 9)]
                assert s.logprobs == [-(v + i / 1000) for i, v in enumerate(s.versions)]  # the sampling policy's
                assert s.versions == sorted(s.versions) and s.versions[-1] <= version and k - s.versions[0] <= 2
                kept = before.get((id(g), j), [])
                assert s.tokens[:len(kept)] == kept  # continued across the weight push: the same tokens
                continued += bool(kept) and s.versions[0] < s.versions[-1]
    assert continued > 0


def test_bound_zero_trains_only_current_tokens_and_samples_the_carried_ones_again():
    restarted = 0
    for k, (p, version, taken, _) in enumerate(_async_steps(bound=0, lag=0)):
        assert version == k and all(v == k for g in taken for s in g.samples for v in s.versions)
        restarted += p.restarted
        p.restarted = 0
    assert restarted > 0  # without the bound these would have continued (test_partial.py)


def _token_ages(root, step: int):
    """Dumped batch ``step``: its response tokens' ages (training step minus version), its policy_version,
    its oldest token's version, and how many responses hold tokens of more than one version."""
    d = torch.load(dump_path(str(root), step, 0), weights_only=False)
    mask = d["response_mask"] > 0
    versions = d["token_versions"][mask]
    mixed = sum(len(set(row[m].tolist())) > 1 for row, m in zip(d["token_versions"], mask))
    return (step - 1) - versions, d["policy_version"], int(versions.min()), mixed


def test_async_partial_carries_responses_within_the_bound(tmp_path):
    run = tmp_path / "run"
    ppo("yaml/tiny_async.yaml", run, *SMALL, *LAGGED, f"trainer.dump_rollouts={tmp_path / 'd'}", steps=4)
    rows, mixed = metrics(run), 0
    for step in (1, 2, 3, 4):
        r = rows[step]
        assert 0 <= r["async/staleness"] <= 1 and r["async/staleness"] <= r["partial/age_max"] <= 2, (step, r)
        ages, oldest, first, m = _token_ages(tmp_path / "d", step)
        assert int(ages.min()) >= 0 and int(ages.max()) == r["partial/age_max"] and oldest == first
        mixed += m
    assert mixed > 0  # responses continued across a weight push: tokens of two versions in one response


def test_bound_zero_first_step_equals_sync_then_only_current_tokens(tmp_path):
    """Step 1 has nothing carried: it equals synchronous partial rollouts bitwise. Later steps differ
    (module docstring): the carried responses are sampled again, so no trained token is stale."""
    sync, asyn = tmp_path / "sync", tmp_path / "async"
    ppo("yaml/tiny_async.yaml", sync, *SMALL, "trainer.mode=sync", steps=1, nproc=1)
    ppo("yaml/tiny_async.yaml", asyn, *SMALL, "async.max_staleness=0", steps=3)
    a, b = metrics(sync), metrics(asyn)
    ignored = ("timing/", "perf/", "resources/", "weight_sync/", "async/", "eval/")
    assert {k: v for k, v in a[1].items() if not k.startswith(ignored)} == \
        {k: v for k, v in b[1].items() if not k.startswith(ignored)}
    for step in (1, 2, 3):
        assert b[step]["partial/stale_token_frac"] == b[step]["partial/age_max"] == b[step]["async/staleness"] == 0
    assert sum(b[s].get("partial/restarted_stale", 0) for s in (2, 3)) > 0


def test_resume_gives_the_rollout_rank_its_groups_in_flight(tmp_path):
    """2 steps, a stop, 2 more: the checkpoint holds the groups in flight (the training rank's file), the
    rollout rank continues them under the checkpoint's weights (nothing dropped), and every step of both
    sessions keeps every token within the bound."""
    run, args = tmp_path / "run", [*SMALL[:-1], *LAGGED, "trainer.save_every=2"]
    ppo("yaml/tiny_async.yaml", run, *args, steps=2)
    state = torch.load(run / "checkpoints" / "step_000002" / "partial" / "rank_0.pt", weights_only=False)
    carried = [s for g in state["groups"] for s in g["samples"] if s["tokens"]]
    assert carried and all(len(s["versions"]) == len(s["tokens"]) == len(s["logprobs"]) for s in carried)
    assert "resumed from step 2" in ppo("yaml/tiny_async.yaml", run, *args, steps=4)
    rows = metrics(run)
    assert rows[3]["async/policy_version"] == 2 and "partial/dropped_on_resume" not in rows[3]
    assert rows[3]["partial/resumed"] > 0 or rows[4]["partial/resumed"] > 0
    assert all(rows[s]["partial/age_max"] <= 2 for s in (1, 2, 3, 4))
