"""Multi-turn rollouts under trainer.mode=async: tools, environments and HTTP agents on the rollout ranks.

The rollout ranks build the same engine as the synchronous run (the multi-turn agent loop or the
agent server wraps it: megarl.rollout.factory), so a couple of steps at ``async.max_staleness=0``
sample the same tokens, get the same rewards and run the same update as synchronous training in one
process. Not bitwise: the rollout log-probs of the later turns (``mismatch/*``,
``rollout_correction/*``, each within 1e-5) and the engine's counters (``rollout/*``: the rollout
rank's engine schedules and caches its own requests, without the evaluation passes the colocated
engine also runs). Single-turn rollouts are bitwise (test_async_pipeline.py).
"""
import pytest

from test_trainer_runs import metrics, ppo

SMALL = ["data.batch_size=4", "rollout.n=2", "actor.mini_batch_size=8", "actor.micro_batch_size=4",
         "trainer.eval_samples=4", "trainer.tensorboard=false", "trainer.export_hf=false", "trainer.save_every=0"]
ASYNC = ["trainer.mode=async", "async.max_staleness=0", "placement.rollout_ranks=1"]
NOT_EQUAL = ("timing/", "perf/", "resources/", "weight_sync/", "async/", "rollout/", "mismatch/", "rollout_correction/")


@pytest.mark.parametrize("config, extra", [
    ("yaml/tiny_tools.yaml", []),  # rollout.multi_turn with the calculator tool
    ("yaml/tiny_env.yaml", []),  # rollout.multi_turn with an environment
    ("yaml/tiny_agent_http.yaml", ["rollout.server.workers=4"]),  # rollout.server: the agent's HTTP calls
])
def test_staleness_zero_matches_sync(tmp_path, config, extra):
    sync, asyn = tmp_path / "sync", tmp_path / "async"
    ppo(config, sync, *SMALL, *extra, steps=2, nproc=1)
    ppo(config, asyn, *SMALL, *extra, *ASYNC, steps=2, nproc=2)
    a, b = metrics(sync), metrics(asyn)
    for step in (1, 2):
        assert {k: v for k, v in a[step].items() if not k.startswith(NOT_EQUAL)} == \
            {k: v for k, v in b[step].items() if not k.startswith(NOT_EQUAL)}, step
        assert b[step]["async/staleness"] == 0 and b[step]["async/policy_version"] == step - 1
        assert a[step]["mismatch/abs_max"] < 1e-5 and b[step]["mismatch/abs_max"] < 1e-5
        assert abs(a[step]["mismatch/abs_mean"] - b[step]["mismatch/abs_mean"]) < 1e-6
    assert a[2]["eval/accuracy"] == b[2]["eval/accuracy"]
