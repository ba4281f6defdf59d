"""trainer.mode=async with rollout.engine=sglang: the weight push goes into SGLang (tests/sglang_fake.py).

Weights. The training ranks (TP1, TP2, or TP1 pushing to a rollout TP2 group) perturb their loaded
weights and push them in ~20 kB buckets (several per push); the rollout ranks hold no Megatron copy:
:class:`~megarl.trainer.weight_push.PushReceiver` hands each received bucket to
``SGLangEngine.load_weights``, whose fake engine (on the rollout group's TP rank 0) records what each
of its TP workers read. Expected: exactly the exporter's HF tensors of the trainer (same names, each
once), cast to bfloat16 (``rollout.sglang.dtype``), bitwise, as SGLang's workers receive them; at
rollout TP2 every tensor carries one payload per worker (each rank sends its own copy) and both
workers read the same values; one weight-update session per push (begin, one
``update_weights_from_tensor`` per bucket, end, then one flush), never a release or a resume, the
engine started with ``enable_memory_saver`` and ``weights_cpu_backup`` off. A generate before the first
push is an error (SGLang would sample from its dummy weights); a push without a tensor the rollout side
needs fails after closing SGLang's session (the next push can begin).

Whole runs (tests/sglang_fake_launch.py: each rank's fake logs the checksum of the weights every
generate sampled from). 1 rollout rank + 1 training rank at ``async.max_staleness=0`` against the
synchronous colocated run of the same fake in one process: batch k is sampled from the weights after
k updates in both, so the checksums the rollout rank's SGLang sampled from equal the synchronous
engine's, step by step (the pushed tensors and the colocated stream are the same bf16 bits); the fake's
tokens and log-probs depend on the prompt and seed only (their math scores are 0; DAPO's overlong shaping
scores their lengths, so the policy has a signal), so every logged value but timings, the
weight-sync counters and the async/* lag metrics is equal bitwise, with the rollout correction
preset on (``preset=sglang``: truncated IS re-weights every token, since the fake's log-probs are far
from the policy's; ``preset=async``'s band would mask them all and nothing would train). The training
rank starts no SGLang (it evaluates with the native engine).

Resume: 2 steps, then a resumed third: the rollout rank's first generate after the resume samples from
the checkpoint's weights (the straight run's after 2 updates), not SGLang's dummy start.

Not covered: a real SGLang (its weight loaders, CUDA IPC across GPUs, its memory), several rollout
replicas, multi-turn rollouts over SGLang in async mode.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from dist_helpers import spawn
from megarl.models.tiny import make_tiny_checkpoint
from test_async_weights import CHECK_TAG, _hf_tensors, _perturb
from test_trainer_runs import ROOT, SMALL, metrics

EXTRA = "model.layers.0.not_in_the_model.weight"


def _rollout_side(path, placement, rollout_tp, sources):
    from sglang_fake import FakeEngine, FakeSerialized

    from megarl.distributed import build_parallel_groups
    from megarl.models.hf_config import read_hf_config
    from megarl.models.weight_map import expected_hf_names
    from megarl.rollout.engine import Request, SamplingParams
    from megarl.rollout.sglang import SGLangEngine, SGLangOptions
    from megarl.trainer.async_channel import recv_object
    from megarl.trainer.weight_push import PushReceiver

    groups = build_parallel_groups(rollout_tp)
    info = read_hf_config(path)
    options = SGLangOptions(model_path=path, enable_memory_saver=False, weights_cpu_backup=False)
    engine = SGLangEngine(None, groups, info, [3], options, engine_factory=FakeEngine, tensor_wrapper=FakeSerialized)
    try:
        engine.generate([Request(0, [5, 6], 1, 4)], SamplingParams())
        early = "no error"
    except RuntimeError as e:
        early = str(e)
    wire = PushReceiver(expected_hf_names(info), placement, sources, torch.device("cpu"))
    version = wire.receive(engine.load_weights)
    bad = PushReceiver(expected_hf_names(info) | {EXTRA}, placement, sources, torch.device("cpu"))
    try:
        bad.receive(engine.load_weights)
        missing = "no error"
    except RuntimeError as e:
        missing = str(e)
    if groups.tp_rank > 0:
        return {"version": version, "early": early, "missing": missing}
    fake = engine.engine
    kinds = [c[0] for c in fake.calls[1:]]  # after __init__
    buckets = kinds.index("end_weight_update") - 1
    first = fake.calls[2: 2 + buckets]  # push 7's update_weights_from_tensor calls
    loaded = [(n, t) for _, call in first for n, t in call["named_tensors"]]
    theirs = {k: v for src in sources for k, v in recv_object(placement.objects, src, CHECK_TAG).items()}
    return {"version": version, "early": early, "missing": missing,
            "names": sorted(n for n, _ in loaded) == sorted(theirs),  # each once
            "equal": all(torch.equal(t, theirs[n].to(torch.bfloat16)) for n, t in loaded),
            "dtypes": {str(t.dtype) for _, t in loaded}, "buckets": buckets,
            "calls": kinds[: buckets + 3], "after": kinds[buckets + 3:],
            "payloads": {p for c in first for p in c[1]["payloads"]}, "session_open": fake.session,
            "saver": (fake.kwargs["enable_memory_saver"], fake.kwargs["enable_weights_cpu_backup"])}


def _worker(rank, path, tp, rollout_tp):
    from megarl.distributed.init import init_distributed
    from megarl.distributed.placement import build_placement
    from megarl.trainer.async_channel import Outbox, send_object
    from megarl.trainer.weight_push import WeightPusher, push_sources
    from test_async_weights import _build

    init_distributed()
    placement = build_placement(rollout_tp)
    placement.enter()
    coords = {"dp_rank": 0, "tp_rank": rank - tp if placement.is_rollout else rank, "pp_rank": 0, "cp_rank": 0}
    if placement.is_rollout:
        sources = push_sources(placement.directory(coords))
        result = _rollout_side(path, placement, rollout_tp, sources)
    else:
        module, info, groups = _build(path, {"tp": tp}, False, rollout_tp)
        placement.directory(coords)
        _perturb(module)
        pusher = WeightPusher(module, info, groups, placement, placement.rollout_ranks, bucket_bytes=20_000)
        pusher.push(7)
        pusher.push(8)  # the push the receiver that expects one tensor more fails on
        full = _hf_tensors(module, info, groups)
        if groups.tp_rank == 0:
            outbox = Outbox()
            send_object(placement.objects, full, placement.rollout_ranks[0], CHECK_TAG, outbox)
            outbox.wait()
        pusher.outbox.wait()
        result = None
    placement.leave()
    return result


@pytest.mark.parametrize("arch, tp, rollout_tp", [("Qwen2ForCausalLM", 1, 1), ("Qwen2ForCausalLM", 2, 1),
                                                  ("LlamaForCausalLM", 1, 2)])
def test_pushed_weights_reach_sglang_bitwise(tmp_path, arch, tp, rollout_tp):
    from megarl.models.hf_config import read_hf_config
    from megarl.models.weight_map import expected_hf_names

    make_tiny_checkpoint(str(tmp_path), arch, seed=4, vocab_size=301)
    results = spawn(_worker, tp + rollout_tp, str(tmp_path), tp, rollout_tp)
    got = results[tp]
    assert got["version"] == 7 and got["names"] and got["equal"] and got["dtypes"] == {"torch.bfloat16"}
    assert len(expected_hf_names(read_hf_config(str(tmp_path)))) > got["buckets"] >= 3
    assert got["calls"] == ["begin_weight_update"] + ["update_weights_from_tensor"] * got["buckets"] + \
        ["end_weight_update", "flush_cache"]
    assert got["payloads"] == {rollout_tp} and got["saver"] == (False, False)
    assert "release_memory_occupation" not in got["after"] and "resume_memory_occupation" not in got["after"]
    assert got["after"][0] == "begin_weight_update" and got["after"][-1] == "end_weight_update"  # push 8, closed
    assert not got["session_open"]
    for r in results[tp:]:
        assert "none has come yet" in r["early"]
        assert r["missing"] == f"weight push 8: no tensors for {EXTRA}; tensors the rollout side has no place for: -"


FAKE = ["rollout.engine=sglang", "data.eval_path=", "trainer.export_hf=false", "algorithm.dapo.overlong_buffer=8",
        "algorithm.rollout_correction.preset=sglang"]  # the fake's tokens score 0 at math: response lengths make the signal
IGNORED = ("timing/", "perf/", "resources/", "weight_sync/", "async/", "rollout/engine_seconds")


def _run(tmp_path, name, *overrides, nproc, steps=3):
    log = str(tmp_path / f"{name}_{steps}.log")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "tests/sglang_fake_launch.py",
           "yaml/tiny_async.yaml", f"trainer.run_dir={tmp_path / name}", f"trainer.steps={steps}", *SMALL, *FAKE,
           *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MEGARL_TEST_SGLANG_LOG=log)
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    logs = [f"{log}.rank{r}" for r in range(nproc)]
    return metrics(tmp_path / name), [[json.loads(x)["weights"] for x in open(f)] if os.path.exists(f) else None
                                      for f in logs]


def test_staleness_zero_equals_sync_with_sglang(tmp_path):
    sync, sync_logs = _run(tmp_path, "sync", "trainer.mode=sync", "trainer.save_every=0", nproc=1)
    asyn, async_logs = _run(tmp_path, "async", "async.max_staleness=0", "trainer.save_every=0", nproc=2)
    assert async_logs[0] is None  # the training rank started no SGLang
    sampled = sync_logs[0]
    assert len(sampled) == 3 and None not in sampled and len(set(sampled)) == 3  # the weights change every step
    assert async_logs[1] == sampled
    for step in (1, 2, 3):
        a = {k: v for k, v in sync[step].items() if not k.startswith(IGNORED)}
        b = {k: v for k, v in asyn[step].items() if not k.startswith(IGNORED)}
        assert a == b, step
        assert asyn[step]["async/staleness"] == 0 and asyn[step]["async/policy_version"] == step - 1
        assert sync[step]["rollout_correction/ratio_mean"] < 0.9  # the correction re-weighted the tokens
    assert asyn[1]["weight_sync/bytes"] > 0


def test_resumed_async_run_samples_from_its_checkpoint(tmp_path):
    """3 steps straight, versus 2 steps and a resumed third (``max_staleness=0``): the rollout rank's
    SGLang samples batch 3 of the resumed run from the checkpoint's weights, which are the straight run's
    after 2 updates (the start message and the first push come before any generate)."""
    _, straight = _run(tmp_path, "straight", "async.max_staleness=0", "trainer.save_every=0", nproc=2)
    _, first = _run(tmp_path, "resumed", "async.max_staleness=0", "trainer.save_every=2", nproc=2, steps=2)
    rows, resumed = _run(tmp_path, "resumed", "async.max_staleness=0", "trainer.save_every=2", nproc=2)
    assert len(set(straight[1])) == 3 and None not in straight[1]
    assert first[1] == straight[1][:2] and resumed[1] == straight[1][2:]
    assert rows[3]["async/policy_version"] == 2 and rows[3]["async/staleness"] == 0


def test_training_ranks_start_the_native_engine():
    """In async mode the training ranks' engine only evaluates: native, on the actor's own weights."""
    from megarl.config import Config
    from megarl.rollout.factory import engine_title, training_engine_config

    cfg = Config()
    cfg.rollout.engine, cfg.trainer.mode, cfg.model.dtype = "sglang", "async", "bfloat16"
    assert training_engine_config(cfg).rollout.engine == "native" and cfg.rollout.engine == "sglang"
    assert engine_title(cfg) == "the native engine for evaluation (the rollout ranks run SGLang)"
    cfg.trainer.mode = "sync"
    assert training_engine_config(cfg) is cfg and engine_title(cfg) == "the sglang rollout engine"
