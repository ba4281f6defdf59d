"""actor.router_replay=r3 through launch/ppo.py: dumped rollouts keep their expert ids and replay with them.

yaml/tiny_moe.yaml (4 MoE layers, 8 experts, top-2, EP2 on 2 ranks, fp32), one step each (item 4: two):
1. ``trainer.rollout_only=true trainer.dump_rollouts=DIR actor.router_replay=r3``: each DP rank's
   dump holds (B, L, 4, 2) uint8 expert ids, recorded exactly on the positions P - 1 .. P + R - 2
   of each row (response tokens; one position before each, as the row that sampled it).
2. ``trainer.replay_rollouts=DIR actor.router_replay=r3`` trains on it: with the weights that
   generated (the shipped ones) in fp32 the training router agrees with the rollout on every
   recorded choice with and without replay (r3/agreement = r3/no_replay/agreement = 1, per layer
   too) and both log-prob mismatches are at fp32 rounding (<= 1e-4). Again with one mini-batch
   (an on-policy update: no old-log-prob forward; the update's replayed forward is measured).
3. The same dump with its ids removed, replayed under r3: exit 2, one line naming the key and the fix.
4. ``rollout.partial=true`` at PP2, two steps: the batch gathers every stage's layers, responses resumed
   across the update train under r3.
5. A live step at TP2 (sequence parallelism): agreement 1 with and without replay.
Items 4 and 5 also run with ``rollout.prefix_cache=true`` (pages of 8 tokens): prompts reuse pages of
earlier prompts, and each stage / TP rank takes those pages' recorded ids with them; the same checks hold.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from test_trainer_runs import ROOT, metrics, ppo

CACHED = ("rollout.prefix_cache=true", "rollout.page_size=8")
FAST = ("data.batch_size=8", "rollout.n=4", "actor.mini_batch_size=16", "actor.micro_batch_size=8",
        "trainer.eval_samples=16", "trainer.tensorboard=false", "trainer.export_hf=false", "trainer.save_last=false")


def test_r3_dump_and_replay(tmp_path):
    dumps = tmp_path / "dumps"
    ppo("yaml/tiny_moe.yaml", tmp_path / "gen", *FAST, "trainer.rollout_only=true", f"trainer.dump_rollouts={dumps}",
        "actor.router_replay=r3", steps=1)
    for dp in (0, 1):
        d = torch.load(dumps / f"step_000001_dp{dp}.pt", weights_only=False)
        ids, lengths, mask = d["expert_ids"], d["lengths"], d["response_mask"]
        assert ids.dtype == torch.uint8 and ids.shape == (*d["input_ids"].shape, 4, 2)
        for row in range(len(lengths)):
            assert int(mask[row].nonzero()[0]) > 1  # a prompt of several tokens, each recorded too
            recorded = (ids[row, :, 0, 0] != 255).nonzero().flatten().tolist()
            assert recorded == list(range(int(lengths[row]) - 1))  # every token but the last (never fed)
            assert ids[row, recorded].max() < 8

    run = tmp_path / "replay"
    ppo("yaml/tiny_moe.yaml", run, *FAST, f"trainer.replay_rollouts={dumps}", "actor.router_replay=r3", steps=1)
    m = metrics(run)[1]
    for prefix in ("r3", "r3/no_replay"):
        assert m[f"{prefix}/agreement"] == 1.0 and m[f"{prefix}/agreement/layer_3"] == 1.0
    assert m["mismatch/abs_max"] <= 1e-4 and m["mismatch/no_replay/abs_max"] <= 1e-4

    # one mini-batch: the update is on-policy, its own forward (replayed) stands in for the old one
    on_policy = tmp_path / "on_policy"
    ppo("yaml/tiny_moe.yaml", on_policy, *FAST, "actor.mini_batch_size=32", f"trainer.replay_rollouts={dumps}",
        "actor.router_replay=r3", steps=1)
    m = metrics(on_policy)[1]
    assert m["perf/old_logprob_forward_skipped"] == 1.0
    assert m["r3/agreement"] == 1.0 and m["r3/no_replay/agreement"] == 1.0 and m["mismatch/abs_max"] <= 1e-4

    bare = tmp_path / "bare"
    bare.mkdir()
    for dp in (0, 1):
        d = torch.load(dumps / f"step_000001_dp{dp}.pt", weights_only=False)
        d["expert_ids"] = None
        torch.save(d, bare / f"step_000001_dp{dp}.pt")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "launch/ppo.py",
           "yaml/tiny_moe.yaml", f"trainer.run_dir={tmp_path / 'bare_run'}", "trainer.steps=1", *FAST,
           f"trainer.replay_rollouts={bare}", "actor.router_replay=r3"]
    out = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"),
                         capture_output=True, text=True, timeout=900)
    assert out.returncode != 0
    lines = [x for x in (out.stdout + out.stderr).splitlines() if "holds no recorded expert ids" in x]
    assert lines and "actor.router_replay=none" in lines[0]


@pytest.mark.parametrize("cached", [False, True], ids=["cold", "prefix_cache"])
def test_r3_at_tp2(tmp_path, cached):
    """One GRPO step of yaml/tiny_moe.yaml at TP2 (sequence parallelism, EP1, one DP replica): the engine
    records at TP2, every TP rank replays its slice of the sequence, and with the weights that generated
    every recorded choice is the router's own (agreement 1 per layer, with and without replay)."""
    run = tmp_path / "tp2"
    ppo("yaml/tiny_moe.yaml", run, *FAST, "data.batch_size=4", "parallel.tp=2", "parallel.ep=1",
        "parallel.sequence_parallel=true", "actor.router_replay=r3", *(CACHED if cached else ()), steps=1)
    m = metrics(run)[1]
    assert (m["rollout/prefix_cached_tokens"] > 0) == cached
    for prefix in ("r3", "r3/no_replay"):
        assert m[f"{prefix}/agreement"] == 1.0 and m[f"{prefix}/agreement/layer_3"] == 1.0
    assert m["mismatch/abs_max"] <= 1e-4 and m["mismatch/no_replay/abs_max"] <= 1e-4


@pytest.mark.parametrize("cached", [False, True], ids=["cold", "prefix_cache"])
def test_r3_partial_rollouts_at_pp2(tmp_path, cached):
    """``rollout.partial=true`` under r3 at PP2 (each stage records its own 2 layers; the trained batch
    gathers all 4), two steps: step 1 trains what the weights of step 1 sampled (every recorded choice
    agrees, with and without replay, on all 4 layers); step 2 trains responses resumed across the update
    (partial/resumed > 0), their ids the ones each token's policy used (tests/test_moe_r3_turns.py checks
    that token by token)."""
    ppo("yaml/tiny_moe.yaml", tmp_path, *FAST, "rollout.partial=true", "parallel.ep=1", "parallel.pp=2",
        *(CACHED if cached else ()), steps=2)
    m = metrics(tmp_path)
    assert (m[1]["rollout/prefix_cached_tokens"] > 0) == cached
    for prefix in ("r3", "r3/no_replay"):
        assert m[1][f"{prefix}/agreement"] == 1.0 and m[1][f"{prefix}/agreement/layer_3"] == 1.0
    assert m[2]["partial/resumed"] > 0 and 0 < m[2]["r3/agreement"] <= 1.0
