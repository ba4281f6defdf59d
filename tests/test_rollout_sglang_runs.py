"""launch/ppo.py with rollout.engine=sglang on the fake engine (tests/sglang_fake_launch.py), 2 processes, CPU.

Each rank's fake logs, per generate, the checksum of the weights it sampled from (sglang_fake.checksum
of its bfloat16 tensors; null: values no one chose: SGLang's dummy start, or released weights without
a CPU backup). The tiny run is bitwise reproducible on CPU, so:
- resume: 3 steps straight, versus 2 steps and a resumed third: the resumed run's first generate
  samples from the weights the straight run's third generate sampled from (not the initial ones);
- rollout-only: 2 steps sample twice from the same real weights (the checkpoint's initial weights),
  the second after SGLang dropped them on release.
Not covered: a real SGLang; eval generates (no eval set here).
"""
import json
import os
import subprocess
import sys

from test_trainer_runs import ROOT, SMALL

FAKE = ["rollout.engine=sglang", "data.eval_path=", "trainer.export_hf=false"]


def _run(tmp_path, name, *overrides, steps):
    log = str(tmp_path / f"{name}_{steps}.log")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "tests/sglang_fake_launch.py",
           "yaml/tiny.yaml", f"trainer.run_dir={tmp_path / name}", f"trainer.steps={steps}", *SMALL, *FAKE, *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MEGARL_TEST_SGLANG_LOG=log)
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return [[json.loads(line)["weights"] for line in open(f"{log}.rank{r}")] for r in range(2)]


def test_resumed_run_samples_from_its_checkpoint(tmp_path):
    straight = _run(tmp_path, "straight", "trainer.save_every=0", steps=3)
    first = _run(tmp_path, "resumed", "trainer.save_every=2", steps=2)
    resumed = _run(tmp_path, "resumed", "trainer.save_every=2", steps=3)
    for rank in range(2):
        assert len(set(straight[rank])) == 3 and None not in straight[rank]  # the weights change each step
        assert first[rank] == straight[rank][:2]
        assert resumed[rank] == straight[rank][2:]


def test_rollout_only_samples_from_real_weights_every_step(tmp_path):
    ranks = _run(tmp_path, "rollout_only", "trainer.rollout_only=true", steps=2)
    for weights in ranks:
        assert len(weights) == 2 and weights[0] is not None and weights[0] == weights[1]
