"""End-to-end runs of launch/ppo.py on the tiny task (2 processes, CPU).

Resume: 4 steps straight must equal 2 steps, a stop, and 2 resumed steps,
bitwise in fp32: the exported actor weights and every logged metric of steps
3 and 4 except wall-clock ones; re-running the finished run adds nothing. This holds because all randomness is a
function of (seed, step, rank) or lives in the checkpoint (models, Adam
state, LR schedule, data position, KL controller, RNG).

Learning: a shortened GRPO run must raise the mean reward and the held-out
accuracy; the multi-turn tool run (yaml/tiny_tools.yaml) must gain 30 points. Not covered here: multi-node, GPU.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["data.batch_size=8", "rollout.n=2", "actor.mini_batch_size=8", "actor.micro_batch_size=4",
         "critic.micro_batch_size=4", "trainer.eval_samples=8", "trainer.tensorboard=false"]


def ppo(config: str, run_dir, *overrides, steps: int, nproc: int = 2):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "launch/ppo.py", config, f"trainer.run_dir={run_dir}", f"trainer.steps={steps}", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def metrics(run_dir) -> dict[int, dict]:
    rows = {}
    for line in open(os.path.join(run_dir, "metrics.jsonl")):
        row = json.loads(line)
        rows.setdefault(row.pop("step"), {}).update(row)
    return rows


def _comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(("timing/", "perf/", "resources/"))}


def test_resume_equals_uninterrupted(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    ppo("yaml/tiny.yaml", straight, *SMALL, "trainer.save_every=2", steps=4)
    ppo("yaml/tiny.yaml", resumed, *SMALL, "trainer.save_every=2", "trainer.export_hf=false", steps=2)
    out = ppo("yaml/tiny.yaml", resumed, *SMALL, "trainer.save_every=2", steps=4)
    assert "resumed from step 2" in out
    a, b = metrics(straight), metrics(resumed)
    for step in (3, 4):
        assert _comparable(a[step]) == _comparable(b[step]), step
    wa, wb = load_file(straight / "hf" / "model.safetensors"), load_file(resumed / "hf" / "model.safetensors")
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert sorted(os.listdir(resumed / "checkpoints")) == ["latest", "step_000002", "step_000004"]
    rows, exported = open(resumed / "metrics.jsonl").read(), os.path.getmtime(resumed / "hf" / "model.safetensors")
    again = ppo("yaml/tiny.yaml", resumed, *SMALL, "trainer.save_every=2", steps=4)  # the finished run, re-run
    assert "already finished step 4" in again
    assert open(resumed / "metrics.jsonl").read() == rows  # no duplicate eval row
    assert os.path.getmtime(resumed / "hf" / "model.safetensors") == exported  # not exported again
    shutil.rmtree(resumed / "hf")  # as a kill during the final export leaves it: a partial directory only
    (resumed / "hf.partial").mkdir()
    (resumed / "hf.partial" / "model.safetensors").write_bytes(b"truncated")
    ppo("yaml/tiny.yaml", resumed, *SMALL, "trainer.save_every=2", steps=4)
    assert not (resumed / "hf.partial").exists() and open(resumed / "metrics.jsonl").read() == rows
    wc = load_file(resumed / "hf" / "model.safetensors")
    assert all(torch.equal(wa[k], wc[k]) for k in wa)  # exported again, the same weights


@pytest.mark.slow
def test_short_grpo_run_learns(tmp_path):
    out = ppo("yaml/tiny_grpo.yaml", tmp_path, "trainer.export_hf=false", "trainer.tensorboard=false",
              "trainer.save_every=0", "trainer.eval_samples=100", steps=12)
    rows = metrics(tmp_path)
    scores = [rows[s]["score/mean"] for s in range(1, 13)]
    assert sum(scores[-3:]) / 3 > sum(scores[:3]) / 3 + 0.2, scores
    assert rows[12]["eval/accuracy"] > rows[0]["eval/accuracy"] + 0.2, out[-500:]


@pytest.mark.slow
def test_tiny_tools_run_learns_to_call_the_calculator(tmp_path):
    """yaml/tiny_tools.yaml as shipped (multi-turn GRPO, calculator tool): +30 points of held-out
    accuracy, and by the end nearly every sample calls the tool."""
    out = ppo("yaml/tiny_tools.yaml", tmp_path, "trainer.export_hf=false", "trainer.tensorboard=false",
              "trainer.save_every=0", steps=30)
    rows = metrics(tmp_path)
    assert rows[30]["eval/accuracy"] >= rows[0]["eval/accuracy"] + 0.3, out[-500:]
    assert rows[1]["agent/tool_calls_mean"] < 0.6 < rows[30]["agent/tool_calls_mean"]


def test_reward_model_and_remax_step(tmp_path):
    """One step with a reward-model term (a random Qwen2ForSequenceClassification scored at
    the last token, clipped to [0, 5]) beside the math term, and the ReMax estimator (an
    extra greedy rollout per prompt as the baseline): the run finishes and logs both terms."""
    from megarl.models.tiny import make_tiny_checkpoint

    rm_dir = tmp_path / "rm"
    make_tiny_checkpoint(str(rm_dir), "Qwen2ForSequenceClassification", vocab_size=57)
    ppo("yaml/tiny_grpo.yaml", tmp_path / "run", *SMALL, "trainer.export_hf=false", "trainer.save_last=false",
        "algorithm.advantage=remax", f"reward.model.path={rm_dir}", "reward.model.clip=[0,5]",
        "reward.model.micro_batch_size=4", steps=1)
    row = metrics(tmp_path / "run")[1]
    assert 0.0 <= row["reward/rm/mean"] <= 5.0 and "reward/math/mean" in row
    assert row["reward/rm/failures"] == 0.0


def test_rollout_only_run_neither_evaluates_nor_exports_and_replay_is_checked_up_front(tmp_path):
    """A rollout-only run (2 steps dumped) trains nothing: no held-out evaluation, no HF export, no
    checkpoint, no eval row; it saves its config.yaml. Replaying 3 steps of the 2 dumped is refused
    before any process joins (exit 2, one line), so no trained step can be lost at step 3."""
    dump = tmp_path / "rollouts"
    out = ppo("yaml/tiny_grpo.yaml", tmp_path / "gen", *SMALL, "trainer.rollout_only=true",
              f"trainer.dump_rollouts={dump}", steps=2)
    assert "evaluating" not in out and "held-out accuracy" not in out and "exporting" not in out
    assert sorted(os.listdir(dump)) == [f"step_00000{s}_dp{r}.pt" for s in (1, 2) for r in (0, 1)]
    run = tmp_path / "gen"
    assert not (run / "hf").exists() and not (run / "checkpoints").exists() and (run / "config.yaml").is_file()
    assert sorted(metrics(run)) == [0, 1, 2] and not any("eval/accuracy" in r for r in metrics(run).values())
    cmd = [sys.executable, "launch/ppo.py", "yaml/tiny_grpo.yaml", f"trainer.run_dir={tmp_path / 'replay'}",
           f"trainer.replay_rollouts={dump}", "trainer.steps=3", *SMALL]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, WORLD_SIZE="2"))
    assert p.returncode == 2 and p.stderr.splitlines() == [
        f"config error: trainer.replay_rollouts: '{dump}' has no dump of step 3 for data-parallel rank 0 (dumped: "
        "steps 1..2); set trainer.steps=2 or fewer, or dump more steps with the same data-parallel size"], p.stderr
