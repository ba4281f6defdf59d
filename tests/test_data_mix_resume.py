"""data.train_mix through launch/ppo.py: a run stopped and resumed draws what an uninterrupted one does.

Two training sets (the tiny task's train and test files) at weights 3:1, GRPO, one process:
3 steps straight must equal 2 steps + 1 resumed step in every logged metric of step 3 except
wall-clock ones (the samples drawn, hence the scores, come from the checkpoint's data position),
and the checkpoint holds the counts taken from each set (16 samples at 3:1: 12 and 4).
Not covered: DP > 1 (tests/test_data_mixture.py checks the DP slices of one global batch).
"""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIX = ("data.train_mix=[{path: megarl/assets/tiny/train.jsonl, weight: 3}, "
       "{path: megarl/assets/tiny/test.jsonl, weight: 1}]")
SMALL = ["data.batch_size=8", "rollout.n=2", "actor.mini_batch_size=16", "actor.micro_batch_size=8",
         "data.eval_path=null", "trainer.tensorboard=false", "trainer.monitor_interval_s=0", "trainer.export_hf=false",
         "trainer.save_every=2", MIX]


def ppo(run_dir, steps: int) -> str:
    cmd = [sys.executable, "launch/ppo.py", "yaml/tiny_grpo.yaml", f"trainer.run_dir={run_dir}",
           f"trainer.steps={steps}", *SMALL]
    out = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def step_row(run_dir, step: int) -> dict:
    row = {}
    for line in open(os.path.join(run_dir, "metrics.jsonl")):
        r = json.loads(line)
        if r.pop("step") == step:
            row.update(r)
    return {k: v for k, v in row.items() if not k.startswith(("timing/", "perf/", "resources/"))}


def test_mixed_sets_resume_like_an_uninterrupted_run(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    ppo(straight, 3)
    ppo(resumed, 2)
    state = json.load(open(resumed / "checkpoints" / "step_000002" / "state.json"))
    assert state["sampler"]["taken"] == [12, 4] and state["sampler"]["kind"] == "mixture"
    assert "resumed from step 2" in ppo(resumed, 3)
    a, b = step_row(straight, 3), step_row(resumed, 3)
    assert "score/mean" in a and a == b
