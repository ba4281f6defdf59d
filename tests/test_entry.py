"""What a user sees from the entry scripts: --help, and a config mistake.

A config error must be one stderr line "config error: ..." and exit code 2,
with no traceback, and must come before the process group is joined (so a
torchrun job fails at once instead of waiting on a rendezvous). Under torchrun
the launcher adds its own failure summary (a traceback of torchrun's process,
ChildFailedError, that no child can suppress); we check that our line appears
once and the job fails. Not covered: errors raised after the group is joined.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS",
                 "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MPI_LOCALRANKID")


def run(*args, timeout=120):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_KEYS}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(list(args), cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_config_error_is_one_line_exit_2():
    p = run(sys.executable, "launch/ppo.py", "yaml/tiny.yaml", "actor.optim.lrr=1")
    assert p.returncode == 2, p.stderr
    lines = p.stderr.splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("config error:") and "did you mean 'lr'" in lines[0]
    assert "Traceback" not in p.stderr + p.stdout


def test_cross_field_error_before_joining():
    """tp=2 on a world of one fails in validation, without starting gloo."""
    p = run(sys.executable, "launch/sft.py", "yaml/tiny_sft.yaml", "parallel.tp=2")
    assert p.returncode == 2, p.stderr
    assert p.stderr.splitlines() == [
        "config error: world size 1 is not divisible by parallel.tp*pp*cp = 2*1*1; "
        "use a multiple of 2 processes or smaller sizes"
    ]


def test_bad_value_error_is_one_line():
    """A value the type check lets through (NaN is a float) fails in validation, exit 2."""
    p = run(sys.executable, "launch/ppo.py", "yaml/tiny.yaml", "actor.optim.lr=nan")
    assert p.returncode == 2, p.stderr
    assert p.stderr.splitlines() == ["config error: actor.optim.lr=nan must be a finite number > 0"]
    assert "Traceback" not in p.stderr + p.stdout


def _torchrun() -> str | None:
    local = Path(sys.executable).parent / "torchrun"
    return str(local) if local.exists() else shutil.which("torchrun")


@pytest.mark.skipif(_torchrun() is None, reason="torchrun not installed")
def test_config_error_under_torchrun():
    """torchrun's own stderr (its banner, then a ChildFailedError summary with a
    traceback of the launcher) surrounds our line; the line appears once (only
    local rank 0 prints it) and the summary reports exit code 2."""
    torchrun = _torchrun()
    p = run(torchrun, "--nproc_per_node", "2", "launch/ppo.py", "yaml/tiny.yaml", "actor.optim.lrr=1",
            timeout=180)
    assert p.returncode != 0
    ours = [line for line in p.stderr.splitlines() if line.startswith("config error:")]
    assert ours == ["config error: unknown key 'actor.optim.lrr'; did you mean 'lr'?"], p.stderr
    assert re.search(r"exitcode\s*:\s*2\b", p.stderr), p.stderr  # torchrun's summary names our exit code


@pytest.mark.parametrize("script, key", [("launch/ppo.py", "critic.optim.lr = 1e-05"),
                                         ("launch/sft.py", "sft.optim.decay = 'cosine'")])
def test_help_lists_keys_with_docs(script, key):
    p = run(sys.executable, script, "--help")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith(("PPO", "Supervised"))
    assert key in p.stdout
    assert "  actor.optim.lr = 1e-06  (float)  peak learning rate" in p.stdout
    assert p.stdout.count("\n  ") > 100  # one line per key


def test_data_error_names_file_and_line(tmp_path):
    """A malformed prompt file found after start-up: one line naming file:line, exit 2."""
    bad = tmp_path / "train.jsonl"
    bad.write_text('{"prompt": "reverse 123", "answer": "321"}\n{"answer": "1"}\n')
    p = run(sys.executable, "launch/ppo.py", "yaml/tiny_grpo.yaml", f"data.train_path={bad}",
            "data.eval_path=null", timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith("data error:")]
    assert errors == [f"data error: {bad}:2: row has neither 'prompt' nor 'messages' (its columns: answer); name "
                      "the prompt column with data.prompt_key (e.g. data.prompt_key=question data.answer_key=answer) "
                      "or map rows with data.row_map"]
    assert "Traceback" not in p.stderr + p.stdout


def test_resume_of_another_config_is_one_line_before_joining(tmp_path, monkeypatch):
    """A run directory holding a PPO run's config.yaml and a checkpoint; launch/ppo.py with the GRPO
    yaml pointed at it stops in the checks (exit 2, one line naming the differences), starting nothing."""
    from megarl.cli import load_config
    from megarl.config import Config
    from megarl.trainer.run_config import save_run_config

    monkeypatch.chdir(ROOT)
    save_run_config(load_config(["yaml/tiny.yaml", f"trainer.run_dir={tmp_path}"], Config))
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("40")
    p = run(sys.executable, "launch/ppo.py", "yaml/tiny_grpo.yaml", f"trainer.run_dir={tmp_path}")
    assert p.returncode == 2, p.stderr
    [line] = p.stderr.splitlines()
    assert line.startswith(f"config error: trainer.run_dir '{tmp_path}' holds a run of another config (algorithm"
                           ".advantage 'gae' -> 'grpo'") and "trainer.resume=force" in line
    assert "Traceback" not in p.stderr + p.stdout and p.stdout == ""


# --- the `megarl` command (megarl/launcher.py; `python -m megarl` is the same main) ------------

SMALL_RUN = ["data.batch_size=8", "rollout.n=2", "actor.mini_batch_size=8", "actor.micro_batch_size=4",
             "critic.micro_batch_size=4", "trainer.eval_samples=8", "trainer.tensorboard=false",
             "trainer.monitor_interval_s=0"]


@pytest.mark.parametrize("args, line", [
    (["yaml/tiny.yaml", "--nproc", "2", "actor.optim.lrr=1"],
     "config error: unknown key 'actor.optim.lrr'; did you mean 'lr'?"),
    (["yaml/tiny.yaml", "--nproc", "3"], "config error: data.batch_size=32 must be a multiple of the data-parallel "
                                         "size 3"),
    (["yaml/tiny.yaml", "--nproc", "two"], "config error: megarl train: argument --nproc: invalid int value: 'two'; "
                                           "see megarl train --help"),
    (["yaml/tiny.yaml", "--nprocs", "2"], "config error: megarl train: unknown option --nprocs; known: --nproc, "
                                          "--max-restarts, --stop-timeout"),
])
def test_megarl_train_config_error_is_one_line_before_any_worker(args, line):
    p = run(sys.executable, "-m", "megarl", "train", *args)
    assert (p.returncode, p.stderr.splitlines(), p.stdout) == (2, [line], "")


def test_megarl_train_runs_stops_on_sigint_and_resumes(tmp_path):
    """2 workers under the in-process elastic agent: plain step lines on stdout (not a terminal), nothing
    from torchrun on stderr. SIGINT to the launcher after step 1: the agent forwards it, the workers finish
    their step and save it, the launcher prints one line and exits 130. The same command with trainer.steps
    one past the saved step resumes and finishes (exit 0, stderr empty)."""
    import signal

    base = [sys.executable, "-m", "megarl", "train", "yaml/tiny.yaml", "--nproc", "2",
            f"trainer.run_dir={tmp_path}", *SMALL_RUN]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_KEYS}
    p = subprocess.Popen([*base, "trainer.steps=200"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    for line in p.stdout:
        if line.startswith("step 1/200  score "):
            p.send_signal(signal.SIGINT)
            break
    out, err = p.communicate(timeout=300)
    assert p.returncode == 130, out + err
    [line] = err.splitlines()
    assert line.startswith("megarl train: stopped by SIGINT; each worker finished its step and saved it")
    saved = int((tmp_path / "checkpoints" / "latest").read_text())
    assert f"stopped by SIGINT after step {saved}; checkpoint saved" in out
    p = run(*base, f"trainer.steps={saved + 1}", timeout=300)
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert f"resumed from step {saved}" in p.stdout and f"\nstep {saved + 1}/{saved + 1}  score " in p.stdout
    assert (tmp_path / "hf" / "model.safetensors").is_file() and (tmp_path / "config.yaml").is_file()
