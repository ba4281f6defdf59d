"""Eval sets in a real run and launch/eval.py on its checkpoint and its export.

A two-step LoRA PPO run on the tiny task with one named eval set (16 prompts x 4
samples at temperature 1, every step) logs eval/tiny/pass@1, pass@4 and mean@4
at steps 0, 1, 2. launch/eval.py then evaluates the run's newest checkpoint
(the actor rebuilt with its adapters) on two DP ranks and must log exactly the
values the one-process run logged after its last step: a response depends only
on its seed and the weights, and the seeds follow the prompt. The run's HF
export (adapters merged into W, rounded once) must agree within one sample.
megarl.report and curves.png are read from the same run.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dist_helpers import free_port
from megarl.monitor.curves import panels_present
from megarl.monitor.run_files import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EVAL_SET = "[{name: tiny, path: megarl/assets/tiny/test.jsonl, n: 4, temperature: 1.0, k: [1, 4], limit: 16}]"
COMMON = ["actor.lora.rank=4", "actor.lora.alpha=8", "actor.optim.lr=1e-2", "data.batch_size=8",
          "actor.mini_batch_size=32", "actor.micro_batch_size=16", "critic.micro_batch_size=16",
          f"data.eval_sets={EVAL_SET}", "trainer.eval_samples=16"]


def run(script: str, *args: str, nproc: int = 1) -> subprocess.CompletedProcess:
    launcher = ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
                str(free_port())] if nproc > 1 else []
    done = subprocess.run([sys.executable, *launcher, os.path.join("launch", script), "yaml/tiny.yaml", *COMMON, *args],
                          cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("eval_run")
    done = run("ppo.py", "trainer.steps=2", "trainer.eval_every=1", f"trainer.run_dir={run_dir}",
               "trainer.monitor_interval_s=0", "trainer.tensorboard=false")
    return run_dir, done.stdout


def test_the_run_logs_each_set_every_eval(trained):
    run_dir, stdout = trained
    rows = read_metrics(str(run_dir / "metrics.jsonl"))
    for step in (0, 1, 2):
        assert {"eval/tiny/pass@1", "eval/tiny/pass@4", "eval/tiny/mean@4", "eval/accuracy"} <= set(rows[step])
        r = rows[step]
        assert 0 <= r["eval/tiny/pass@1"] <= r["eval/tiny/pass@4"] <= 1 and r["eval/tiny/prompts"] == 16
        assert r["eval/tiny/pass@1"] == pytest.approx(r["eval/tiny/mean@4"])  # 0/1 scores: pass@1 = mean
    assert stdout.count("eval tiny (16 prompts x 4): pass@1 ") == 4  # steps 0, 1, 2 and the final one
    assert ("eval sets", ["eval/tiny/mean@4", "eval/tiny/pass@1", "eval/tiny/pass@4"]) in panels_present(rows)
    report = subprocess.run([sys.executable, "-m", "megarl.report", str(run_dir)], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    line = next(x for x in report.stdout.splitlines() if x.startswith("eval sets"))
    assert f"tiny pass@4 {rows[0]['eval/tiny/pass@4']:.3f} (step 0) -> {rows[2]['eval/tiny/pass@4']:.3f} (step 2)" \
        in line


def test_eval_py_on_the_checkpoint_gives_the_runs_last_values(trained, tmp_path):
    run_dir, _ = trained
    rows = read_metrics(str(run_dir / "metrics.jsonl"))
    out = tmp_path / "ckpt.json"
    done = run("eval.py", "--checkpoint", str(run_dir), "--out", str(out), f"trainer.run_dir={tmp_path / 'x'}",
               nproc=2)  # two DP ranks: each evaluates half the prompts, seeds follow the prompt
    got = json.loads(out.read_text())
    assert set(got) == {"eval/tiny/pass@1", "eval/tiny/pass@4", "eval/tiny/mean@4", "eval/tiny/prompts",
                        "eval/tiny/failed", "eval/accuracy"}
    assert got == {k: rows[2][k] for k in got}
    assert f"held-out accuracy {rows[2]['eval/accuracy']:.3f} on 16 prompts" in done.stdout
    exported = tmp_path / "hf.json"
    run("eval.py", f"model.path={run_dir / 'hf'}", "actor.lora.rank=0", "--out", str(exported),
        f"trainer.run_dir={tmp_path / 'y'}")
    hf = json.loads(exported.read_text())
    assert abs(hf["eval/tiny/mean@4"] - got["eval/tiny/mean@4"]) <= 1 / 64  # one sample of 16 x 4
    assert abs(hf["eval/accuracy"] - got["eval/accuracy"]) <= 1 / 16


def test_eval_py_on_a_directory_that_is_no_checkpoint_is_one_line(tmp_path):
    done = subprocess.run([sys.executable, "launch/eval.py", "yaml/tiny.yaml", "--checkpoint", str(tmp_path),
                           f"trainer.run_dir={tmp_path / 'x'}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"checkpoint error: --checkpoint {tmp_path}: not a training checkpoint (a run directory, its checkpoints/, "
        "or checkpoints/step_N holding state.json and actor/)")
