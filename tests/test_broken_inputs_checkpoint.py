"""Training checkpoints: resumed on another data-parallel size exactly; damaged, foreign or
unreshardable ones are one-line errors.

Resharding (the actor of the tiny task, fp32, distributed optimizer): one
process takes an Adam step with seeded gradients G1, saves (step 1), takes a
second step with G2 and keeps the parameters P2. Two processes build the same
actor, load step 1, and must hold the saved parameters bitwise; after their
own step with G2 (the same on both ranks: the DP-averaged gradient is G2
exactly) they must hold P2 bitwise, which holds only if the Adam moments and
step count were resharded correctly (Adam is elementwise; the gradient norm
stays under the clip, so the norm's summation order does not matter). The
saved RNG streams belonged to one rank; resuming with two reseeds from
(trainer.seed, step). Asking the two processes for tp=2 is a one-line error
naming both layouts, raised before anything loads.

Damaged checkpoints (one process): a truncated shard, an empty or incomplete
state.json, megatron's metadata missing, another model's checkpoint (a
different hidden size): each a CheckpointError of one line naming the path.
End to end: launch/ppo.py under torchrun (2 processes) on a run directory
whose newest checkpoint has a truncated shard exits 2 with one
"checkpoint error:" line (rank 0 prints, rank 1 is silent).
Not covered: TP / PP resharding (refused, see above), GPU.
"""
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import zlib

import numpy as np
import pytest
import torch

from dist_helpers import spawn
from test_trainer_runs import ROOT, SMALL

SCALE = 1e-4  # gradient entries ~ N(0, SCALE): total norm far below actor.optim.clip_grad=1


def _actor(tp: int = 1, model_path: str | None = None, *overrides: str):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.cli import load_config
    from megarl.config import Config
    from megarl.distributed import build_parallel_groups, init_distributed
    from megarl.roles.build import build_actor

    init_distributed()
    overrides = [f"parallel.tp={tp}", *overrides] + ([f"model.path={model_path}"] if model_path else [])
    cfg = load_config([os.path.join(ROOT, "yaml/tiny.yaml"), *overrides], Config)
    groups = build_parallel_groups(tp, 1, 1)
    model_parallel_cuda_manual_seed(cfg.trainer.seed)
    return build_actor(cfg, groups, 10), groups


def _adam_step(actor, step: int) -> None:
    """One optimizer step on gradients drawn from (parameter name, step): the same on every rank."""
    actor.trainable.zero_grad()
    for name, p in actor.module.named_parameters():
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()) + step)
        p.main_grad.copy_(torch.randn(p.shape, generator=gen) * SCALE)
    ok, _, _ = actor.trainable.optimizer.step()
    assert ok
    actor.trainable.scheduler.step(increment=1)


def _params(actor) -> dict:
    """numpy copies: tensors sent back from a process that has exited would point at freed shared memory."""
    return {k: v.detach().numpy().copy() for k, v in actor.module.state_dict().items() if isinstance(v, torch.Tensor)}


def _checkpointer(root, groups):
    from megarl.trainer.checkpoint import Checkpointer
    from megarl.trainer.resume import Layout

    return Checkpointer(root, keep_last=2, layout=Layout.of(groups, True), seed=42)


def _error_of(fn) -> str:
    from megarl.errors import CheckpointError

    try:
        fn()
    except CheckpointError as e:
        return str(e)
    return "no error"


def _save_and_break(rank, root, other_model):
    """World of one: steps, a checkpoint, the parameters after each step; then damaged copies."""
    actor, groups = _actor()
    ck = _checkpointer(root, groups)
    _adam_step(actor, 1)
    saved = _params(actor)
    ck.save(1, {"actor": actor}, {"step": 1})
    _adam_step(actor, 2)
    after = _params(actor)
    path = ck._dir(1)
    damaged = {}

    def attempt(name, damage, roles=None):
        shutil.copytree(path, path + ".keep")
        damage()
        damaged[name] = _error_of(lambda: ck.load(1, roles or {"actor": actor}))
        shutil.rmtree(path)
        os.rename(path + ".keep", path)

    shard = sorted(glob.glob(os.path.join(path, "actor", "*.distcp")))[0]
    attempt("truncated", lambda: os.truncate(shard, os.path.getsize(shard) // 2))
    attempt("empty_state", lambda: open(os.path.join(path, "state.json"), "w").close())
    attempt("state_lacks_keys", lambda: json.dump({"step": 1}, open(os.path.join(path, "state.json"), "w")))
    attempt("no_metadata", lambda: os.remove(os.path.join(path, "actor", ".metadata")))
    other, _ = _actor(model_path=other_model)
    attempt("other_model", lambda: None, roles={"actor": other})
    return {"saved": saved, "after": after, "damaged": damaged, "path": path}


def _resume_on_two(rank, root):
    actor, groups = _actor()
    state = _checkpointer(root, groups).load(1, {"actor": actor})
    loaded = _params(actor)
    _adam_step(actor, 2)
    after = _params(actor)
    actor_tp2, groups_tp2 = _actor(tp=2)
    refused = _error_of(lambda: _checkpointer(root, groups_tp2).load(1, {"actor": actor_tp2}))
    return {"loaded": loaded, "after": after, "step": state["step"], "refused": refused}


@pytest.fixture(scope="module")
def one_process_checkpoint(tmp_path_factory):
    from megarl.models.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("one")
    other = str(tmp_path_factory.mktemp("other_model"))
    make_tiny_checkpoint(other, "Qwen2ForCausalLM", vocab_size=57, tie_word_embeddings=True)
    (result,) = spawn(_save_and_break, 1, str(root), other)
    return root, result


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_one_process_checkpoint_resumes_on_two_and_tp_change_is_refused(one_process_checkpoint, capfd):
    root, one = one_process_checkpoint
    two = spawn(_resume_on_two, 2, str(root))
    for r in two:
        assert r["step"] == 1
        assert _same(r["loaded"], one["saved"])
        assert _same(r["after"], one["after"])
    assert not _same(one["saved"], one["after"])  # the second step changed something
    assert "RNG streams restart from trainer.seed" in capfd.readouterr().out
    refused = two[0]["refused"]
    assert refused == two[1]["refused"] and "\n" not in refused
    assert ("was saved with tp=1 pp=1 cp=1 dp=1 (distributed optimizer), this run has "
            "tp=2 pp=1 cp=1 dp=1 (distributed optimizer)") in refused
    assert "resume with parallel.tp=1 parallel.pp=1 parallel.cp=1" in refused


@pytest.mark.parametrize("case, expected", [
    ("truncated", r"cannot read .*step_000001/actor \(a truncated or damaged shard\?\): \w+"),
    ("empty_state", r".*step_000001/state.json is empty; delete that step directory"),
    ("state_lacks_keys", r".*step_000001/state.json lacks optimizer_saved, adam_steps "),
    ("no_metadata", r".*step_000001/actor lacks megatron's .metadata: an incomplete or damaged checkpoint"),
    ("other_model", r".*step_000001 holds another actor model: num_layers 4 \(this run: 2\), "
                    r"hidden_size 128 \(this run: 64\)"),
])
def test_damaged_or_foreign_checkpoint_is_one_line(one_process_checkpoint, case, expected):
    message = one_process_checkpoint[1]["damaged"][case]
    assert "\n" not in message
    assert re.match(expected, message), message


def test_truncated_shard_under_torchrun_exits_2_with_one_line(tmp_path, straight_tiny_run):
    run = tmp_path / "run"
    shutil.copytree(straight_tiny_run, run)
    shard = sorted(glob.glob(str(run / "checkpoints" / "step_000004" / "actor" / "*.distcp")))[0]
    os.truncate(shard, os.path.getsize(shard) // 2)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "launch/ppo.py",
           "yaml/tiny.yaml", f"trainer.run_dir={run}", "trainer.steps=5", *SMALL]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    ours = [line for line in p.stderr.splitlines() if line.startswith("checkpoint error:")]
    assert len(ours) == 1, p.stderr[-3000:]
    assert f"cannot read {run}/checkpoints/step_000004/actor (a truncated or damaged shard?)" in ours[0]
    assert re.search(r"exitcode\s*:\s*2\b", p.stderr), p.stderr[-3000:]
    assert "Traceback" not in p.stdout


def _megarl_train(run, *overrides, timeout=600):
    """`python -m megarl train` (the `megarl` command) on 2 processes: its exit code, stdout, stderr."""
    cmd = [sys.executable, "-m", "megarl", "train", "yaml/tiny.yaml", "--nproc", "2", f"trainer.run_dir={run}",
           *SMALL, *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def test_truncated_rng_file_of_any_rank_is_one_line(tmp_path, straight_tiny_run):
    """Rank 1's RNG-state file cut in half: every rank stops before loading the models (the ranks agree
    on the problem), rank 0 prints the one line naming rank 1's file, exit 2."""
    run = tmp_path / "run"
    shutil.copytree(straight_tiny_run, run)
    rng = run / "checkpoints" / "step_000004" / "rng" / "rank_1.pt"
    os.truncate(rng, os.path.getsize(rng) // 2)
    code, out, err = _megarl_train(run, "trainer.steps=5")
    assert code == 2, out[-2000:] + err[-3000:]
    [line] = err.splitlines()
    assert line.startswith(f"checkpoint error: cannot read {rng} (a truncated or damaged RNG-state file?): ")
    assert line.endswith("or set trainer.resume=false to start over")


def test_resuming_with_another_training_file_is_one_line(tmp_path, straight_tiny_run):
    """The run's config.yaml names the shipped train.jsonl. Another file: the config check refuses before
    any worker starts (exit 2, one line naming data.train_path). trainer.resume=force: the data sampler
    finds 100 rows where the checkpoint had 2000, one checkpoint error line, exit 2."""
    run = tmp_path / "run"
    shutil.copytree(straight_tiny_run, run)
    other = tmp_path / "train.jsonl"
    rows = open(os.path.join(ROOT, "megarl", "assets", "tiny", "train.jsonl")).readlines()
    other.write_text("".join(rows[:100]))
    code, out, err = _megarl_train(run, "trainer.steps=5", f"data.train_path={other}")
    assert (code, out) == (2, ""), err
    [line] = err.splitlines()
    assert line.startswith(f"config error: trainer.run_dir '{run}' holds a run of another config (data.train_path '")
    assert line.endswith(f"{other}'); pick a new trainer.run_dir, set trainer.resume=false to start over, or "
                         "trainer.resume=force to continue it anyway")
    code, out, err = _megarl_train(run, "trainer.steps=5", f"data.train_path={other}", "trainer.resume=force")
    assert code == 2, out[-2000:] + err[-3000:]
    [line] = err.splitlines()
    assert line.startswith(f"checkpoint error: {run}/checkpoints/step_000004: PromptSampler.load_state_dict: "
                           "checkpoint has num_items=2000 but this sampler has 100")
    assert f"data.train_path={other}); pick a new trainer.run_dir for new data" in line
