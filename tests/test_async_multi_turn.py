"""Multi-turn rollouts under trainer.mode=async: tools, environments and HTTP agents on the rollout ranks.

The rollout ranks build the same engine as the synchronous run (the multi-turn agent loop or the
agent server wraps it: megarl.rollout.factory), so a couple of steps at ``async.max_staleness=0``
sample the same tokens, get the same rewards and run the same update as synchronous training in one
process; for tools and environments with ``rollout.prefix_cache=false`` the rollout log-probs are equal
too (``mismatch/*``, ``rollout_correction/*``). Not bitwise: the engine's counters (``rollout/*``: the
rollout rank runs no evaluation passes), and the rollout log-probs with HTTP agents or with the prefix
cache on (within 1e-5; two synchronous runs differ as much among themselves). Cause (measured: the
prefix cache off makes tools and environments bitwise): a row's K/V bits depend on the step that
computed them (a decode, or a prefill in some batch), and wall-clock times pick that step (when an
agent's HTTP call arrives; at which step an overlapped tool reply lands, which decides whose cached
pages a later turn reuses). Single-turn rollouts are bitwise (test_async_pipeline.py).
"""
import pytest

from test_trainer_runs import metrics, ppo

SMALL = ["data.batch_size=4", "rollout.n=2", "actor.mini_batch_size=8", "actor.micro_batch_size=4",
         "trainer.eval_samples=4", "trainer.tensorboard=false", "trainer.export_hf=false", "trainer.save_every=0"]
ASYNC = ["trainer.mode=async", "async.max_staleness=0", "placement.rollout_ranks=1"]
NOT_EQUAL = ("timing/", "perf/", "resources/", "weight_sync/", "async/", "rollout/")
ARRIVAL = ("mismatch/", "rollout_correction/")  # HTTP agents: set by when each call arrives (see the cause above)


@pytest.mark.parametrize("config, extra", [
    ("yaml/tiny_tools.yaml", ["rollout.prefix_cache=false"]),  # rollout.multi_turn with the calculator tool
    ("yaml/tiny_env.yaml", ["rollout.prefix_cache=false"]),  # rollout.multi_turn with an environment
    ("yaml/tiny_agent_http.yaml", ["rollout.server.workers=4"]),  # rollout.server: the agent's HTTP calls
])
def test_staleness_zero_matches_sync(tmp_path, config, extra):
    sync, asyn = tmp_path / "sync", tmp_path / "async"
    ppo(config, sync, *SMALL, *extra, steps=2, nproc=1)
    ppo(config, asyn, *SMALL, *extra, *ASYNC, steps=2, nproc=2)
    a, b = metrics(sync), metrics(asyn)
    skip = NOT_EQUAL + (ARRIVAL if "http" in config else ())
    for step in (1, 2):
        assert {k: v for k, v in a[step].items() if not k.startswith(skip)} == \
            {k: v for k, v in b[step].items() if not k.startswith(skip)}, step
        assert b[step]["async/staleness"] == 0 and b[step]["async/policy_version"] == step - 1
        assert a[step]["mismatch/abs_max"] < 1e-5 and b[step]["mismatch/abs_max"] < 1e-5
        assert abs(a[step]["mismatch/abs_mean"] - b[step]["mismatch/abs_mean"]) < 1e-6
    assert a[2]["eval/accuracy"] == b[2]["eval/accuracy"]
