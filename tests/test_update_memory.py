"""What a PPO step on the tiny MoE leaves alive when the actor's optimizer steps (the point where a GPU run of
the Qwen3-30B-A3B shape with r3 ran out of memory, benchmarks/bench_moe_e2e.py --router-replay).

One single-process step of yaml/tiny_moe.yaml (EP1, grouped experts as on CUDA, fp32) with
``actor.router_replay=r3``, the no-replay probe every step and ``actor.mini_batch_size`` half the batch (so
the probe, the old-log-prob forward and the reference forward run, then two optimizer steps of 4 micro-batches),
watched by tests/update_memory_probe.py. At the entry of each optimizer step:
- no tensor saved for backward by any graph of the run is still held (tests/saved_tensor_watch.py):
  every micro-batch's activations went with its backward, and no forward-only output carries a graph;
- no tensor field of the step's batch requires grad (old / reference log-probs, advantages, expert ids);
- the Python-reachable tensors that are none of the weights, grad buffers, optimizer state and the
  reference's weights (the batch, the engine's small buffers, metrics) hold < half the actor's weight
  bytes (measured: 0.14x): a second copy of the weights or of the grads would be >= 1x.
Not covered: CUDA (allocator caching, CUDA graphs, torch._grouped_mm's CUDA backward); the GPU run reports
``memory/<phase>_live_gb`` and ``memory/actor_before_step_gb`` for that.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from saved_tensor_watch import SavedWatch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_watch_sees_kept_graphs_and_not_freed_ones():
    w = torch.randn(16, 16, requires_grad=True)
    with SavedWatch() as watch:
        (torch.randn(4, 16) @ w).tanh().sum().backward()  # backward ran: its saved tensors are gone
        assert watch.alive() == (0, 0)
        kept = (torch.randn(4, 16) @ w).tanh()  # a graph kept by a live output: x (4x16) and tanh's result
        assert watch.alive() == (2, 2 * 4 * 16 * 4)
        metric = torch.expm1(kept).sum().detach()  # a metric branch, dropped: nothing of it stays
        assert watch.alive()[0] == 2 and metric.grad_fn is None
        del kept
        assert watch.alive() == (0, 0)


def test_r3_step_keeps_no_graph_and_no_weight_sized_copy(tmp_path):
    out = tmp_path / "live.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "tests/update_memory_probe.py",
           "yaml/tiny_moe.yaml", "parallel.ep=1", "model.moe_experts=grouped", "data.batch_size=16", "rollout.n=8",
           "actor.mini_batch_size=64", "actor.micro_batch_size=16", "actor.forward_micro_batch_size=32",
           "actor.router_replay=r3", "actor.router_replay_probe_every=1", "data.eval_path=null", "trainer.steps=1",
           "trainer.tensorboard=false", "trainer.export_hf=false", "trainer.save_last=false", "trainer.save_every=0",
           f"trainer.run_dir={tmp_path / 'run'}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", LIVE_MEMORY_OUT=str(out))
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    rows = json.loads(out.read_text())
    assert len(rows) == 2  # 128 rows in mini-batches of 64
    for r in rows:
        assert (r["saved"], r["saved_bytes"]) == (0, 0), r["held"]
        assert r["batch_grad"] == []
        assert r["other_bytes"] < 0.5 * r["param_bytes"], r
