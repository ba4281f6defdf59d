"""SIGTERM mid-run: the run finishes its step, saves atomically and exits; resuming equals never stopping.

launch/ppo.py under torchrun (2 processes, CPU, tiny task) gets SIGTERM on its
whole process group (what a terminal's Ctrl-C or SLURM's signal to every task
does) once step 1 is logged. Checked: the workers finish the step and say where
they stopped, without a traceback (torchrun itself still reports the signal it
got), ``latest`` names the step they stopped after, no ``.partial``
directory is left, and resuming to the end gives the exported weights of an
uninterrupted run bitwise. A checkpoint interrupted mid-save (a ``.partial``
directory) is ignored by resume and removed by the next save; a ``latest``
naming no saved step is a one-line error.
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from test_trainer_runs import ROOT, SMALL, ppo


def _logged_steps(run_dir) -> int:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return 0
    return max([json.loads(line).get("step", 0) for line in open(path) if line.strip()] or [0])


@pytest.fixture(scope="module")
def straight_weights(straight_tiny_run):
    return load_file(straight_tiny_run / "hf" / "model.safetensors")


def _start(run_dir, *extra) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "launch/ppo.py", "yaml/tiny.yaml", f"trainer.run_dir={run_dir}", "trainer.steps=4", *SMALL, *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _wait_for_step(proc, run_dir, step: int) -> None:
    deadline = time.monotonic() + 600
    while _logged_steps(run_dir) < step and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before it could be interrupted"


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sigterm_stops_at_a_step_boundary_and_resume_equals_uninterrupted(tmp_path, straight_weights):
    stopped = tmp_path / "stopped"
    proc = _start(stopped, "trainer.save_every=0")
    _wait_for_step(proc, stopped, 1)
    os.killpg(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    at = int(open(stopped / "checkpoints" / "latest").read())
    assert 1 <= at < 4, out[-3000:]
    assert f"stopped by SIGTERM after step {at}" in out, out[-3000:]
    assert not [d for d in os.listdir(stopped / "checkpoints") if d.endswith(".partial")]
    assert "Traceback" not in out.split("stopped by")[0], out[-3000:]  # no worker was interrupted mid-step
    resumed = ppo("yaml/tiny.yaml", stopped, *SMALL, "trainer.save_every=0", steps=4)
    assert f"resumed from step {at}" in resumed
    assert _same(straight_weights, load_file(stopped / "hf" / "model.safetensors"))


def _partial_and_bad_latest(rank, root):
    from megarl.distributed import init_distributed
    from megarl.errors import CheckpointError
    from megarl.trainer.checkpoint import Checkpointer

    init_distributed()
    ck = Checkpointer(root, keep_last=2)
    ck.save(1, {}, {"step": 1})
    os.makedirs(os.path.join(ck.root, "step_000002.partial", "actor"))  # killed while saving step 2
    seen = ck.latest_step()
    ck.save(3, {}, {"step": 3})
    left = sorted(os.listdir(ck.root))
    open(os.path.join(ck.root, "latest"), "w").write("7")
    try:
        ck.latest_step()
        bad = "no error"
    except CheckpointError as e:
        bad = str(e)
    return {"seen": seen, "left": left, "bad": bad}


def test_interrupted_save_is_ignored_and_cleaned_and_a_bad_latest_is_one_line(tmp_path):
    from dist_helpers import spawn

    (r,) = spawn(_partial_and_bad_latest, 1, str(tmp_path))
    assert r["seen"] == 1
    assert r["left"] == ["latest", "step_000001", "step_000003"]
    assert "names step '7', which is not a saved step" in r["bad"] and "\n" not in r["bad"]
