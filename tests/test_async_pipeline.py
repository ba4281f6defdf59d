"""trainer.mode=async: 1 rollout rank + 1 training rank against synchronous training in one process.

With ``async.max_staleness=0`` the rollout rank generates batch k only once it holds the weights
after k updates, which the training rank pushed bitwise (see test_async_weights.py); it draws the
same prompts (the sampler at the same position, same data.seed) with the same per-request seeds
(rollout_seed(step, dp_rank)), scores with the same rewards, and the training rank runs the same
update on that batch. So every logged value of a step (score, losses, grad norms, KL, entropy,
response lengths, engine counters) equals the synchronous run's bitwise on CPU; only timings,
resource samples, the weight-sync byte count and the async/* lag metrics differ.

With ``max_staleness=1`` batch k (k >= 1) is sampled by the weights after k - 1 updates: every step
logs async/staleness = min(k, 1) and the policy version; after a resume from step s, batch s is
sampled by the checkpoint's weights (staleness 0), never by a version older than the bound.

Not covered here: TP > 1 on the training side of a whole run (the weight push at TP2 -> TP1 is
tested in test_async_weights.py), GPUs, several rollout replicas.
"""
import os
import signal
import subprocess
import sys
import time

import torch

from megarl.trainer.dump import dump_path
from test_trainer_runs import ROOT, SMALL, metrics, ppo
from test_trainer_signals import _logged_steps

ASYNC = ["trainer.save_every=0", "trainer.export_hf=false", "algorithm.rollout_correction.preset=none"]
IGNORED = ("timing/", "perf/", "resources/", "weight_sync/", "async/")


def _comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(IGNORED)}


def test_staleness_zero_equals_sync(tmp_path):
    sync, asyn = tmp_path / "sync", tmp_path / "async"
    ppo("yaml/tiny_async.yaml", sync, *SMALL, *ASYNC, "trainer.mode=sync", steps=3, nproc=1)
    ppo("yaml/tiny_async.yaml", asyn, *SMALL, *ASYNC, "async.max_staleness=0", steps=3, nproc=2)
    a, b = metrics(sync), metrics(asyn)
    assert sorted(a) == sorted(b) == [0, 1, 2, 3]
    for step in (1, 2, 3):
        assert _comparable(a[step]) == _comparable(b[step]), step
        assert b[step]["async/staleness"] == 0.0 and b[step]["async/policy_version"] == step - 1
    assert a[0]["eval/accuracy"] == b[0]["eval/accuracy"] and a[3]["eval/accuracy"] == b[3]["eval/accuracy"]
    assert b[1]["weight_sync/bytes"] > 0


def test_resume_keeps_the_staleness_bound(tmp_path):
    """A run that ends at step 2 with batches in flight (the rollout rank had already sampled batch 3
    with the weights after 1 update) resumes to step 4: the lost batch is generated again from the
    checkpoint's weights. Every step of both sessions has 0 <= async/staleness <= 1; step 3 after the
    resume is sampled by version 2 (the checkpoint's), step 4 by version 2 (lag 1); the prompts are the
    uninterrupted run's (the trainer's sampler moved with the queue: the dumped batches' prompts are
    equal), while the responses of steps 3-4 may differ from it (other weights sampled them)."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    args = [*SMALL, "trainer.save_every=2", "trainer.export_hf=false"]
    ppo("yaml/tiny_async.yaml", straight, *args, f"trainer.dump_rollouts={tmp_path / 'd1'}", steps=4)
    ppo("yaml/tiny_async.yaml", resumed, *args, steps=2)
    out = ppo("yaml/tiny_async.yaml", resumed, *args, f"trainer.dump_rollouts={tmp_path / 'd2'}", steps=4)
    assert "resumed from step 2" in out
    a, b = metrics(straight), metrics(resumed)
    assert [a[s]["async/policy_version"] for s in (1, 2, 3, 4)] == [0, 0, 1, 2]
    assert [b[s]["async/policy_version"] for s in (1, 2, 3, 4)] == [0, 0, 2, 2]
    assert all(0 <= r["async/staleness"] <= 1 for r in (*a.values(), *b.values()) if "async/staleness" in r)
    for step in (3, 4):
        d1, d2 = (torch.load(dump_path(str(tmp_path / d), step, 0), weights_only=False) for d in ("d1", "d2"))
        assert d1["prompts"] == d2["prompts"], step
    for step in (1, 2):  # before the interruption: the same run (the short one also evaluated at step 2)
        assert _comparable(a[step]) == {k: v for k, v in _comparable(b[step]).items() if k != "eval/accuracy"}


def test_sigterm_stops_both_roles_and_resumes(tmp_path):
    """SIGTERM to the whole launch: the training rank finishes its step, saves, tells the rollout rank
    to stop (which ignores the signal and waits for that word), and both exit 0 without a traceback.
    The resumed run's first batch is sampled by the checkpoint's weights (staleness 0), later ones
    within the bound."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "launch/ppo.py",
           "yaml/tiny_async.yaml", f"trainer.run_dir={run}", "trainer.steps=6", *SMALL, *ASYNC]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 600
    while _logged_steps(run) < 1 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    os.killpg(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    at = int(open(run / "checkpoints" / "latest").read())
    assert 1 <= at < 6 and f"stopped by SIGTERM after step {at}" in out, out[-3000:]
    assert "Traceback" not in out.split("stopped by")[0], out[-3000:]
    resumed = ppo("yaml/tiny_async.yaml", run, *SMALL, *ASYNC, steps=6)
    assert f"resumed from step {at}" in resumed
    rows = metrics(run)
    assert rows[at + 1]["async/policy_version"] == at and rows[at + 1]["async/staleness"] == 0
    assert all(0 <= rows[s]["async/staleness"] <= 1 for s in range(1, 7))
