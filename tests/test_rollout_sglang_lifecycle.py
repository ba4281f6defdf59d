"""The SGLang adapter across a run's steps, against tests/sglang_fake.py (SGLang 0.5.23's behaviours).

Setup: the tiny random Llama checkpoint in the actor at TP1 (one spawn), each scenario a new engine.
Expected values are checksums (sglang_fake.checksum) of the actor's weights as SGLang would hold them
(the HF export cast to bfloat16, computed in the worker right before the generate they are compared to).

1. Memory (the step-2 OOM): GPU of 100 units, the trainer holding 40 when SGLang starts, so SGLang's
   pool is 0.5 x 60 = 30 (weights 5, CUDA graphs 1, KV cache 24). After a step the trainer holds 10
   more (optimizer state) and caches 25 (activations): 25 free, less than the 5 + 24 + 1 SGLang maps
   back. The adapter must empty torch's cache (the patched ``torch.cuda.empty_cache``) before
   resuming: then 50 are free and the second generate runs.
2. Resume: the actor's weights change after the engine starts (what loading a checkpoint does); the
   first generate must sample from the changed weights.
3. Rollout-only: generate, release, generate with no weight update between: SGLang re-maps released
   weights without values, so the second generate must sample from re-streamed weights; with
   ``weights_cpu_backup`` SGLang keeps them and nothing is streamed again.
4. Busy: a release while requests run is refused with an error that names the flush, and SGLang is
   still alive after it (SGLang's own release would kill its scheduler).
5. A weight sync SGLang fails: the error reaches the caller, SGLang's weight-update session is closed
   and the weights stay stale, so the next generate streams them again and samples from them.
6. Start: TP rank 0 takes 6 s to start SGLang while every collective of the run times out after 3 s
   (TP2, no actor); the peers wait on the start group (``start_timeout_s``=60) and the run goes on.

Not covered: a real SGLang or GPU; memory of the TP ranks other than 0 (the fake lives on rank 0).
"""
import pytest
import torch

from dist_helpers import spawn, worker_actor


def _expected(actor, groups):
    from megarl.rollout.weight_stream import iter_hf_tensors
    from sglang_fake import checksum

    return checksum(dict(iter_hf_tensors(actor.module, groups, actor.info, torch.bfloat16)))


def _engine(actor, groups, ckpt, factory=None, **options):
    from megarl.rollout.sglang import SGLangEngine, SGLangOptions
    from sglang_fake import FakeEngine, FakeSerialized

    return SGLangEngine(actor.module, groups, actor.info, [3], SGLangOptions(model_path=ckpt, **options),
                        engine_factory=factory or FakeEngine, tensor_wrapper=FakeSerialized)


def _generate(engine):
    from megarl.rollout.engine import SamplingParams, sample_requests

    engine.generate(sample_requests([[7, 8, 9]], 1, 0, 3), SamplingParams())
    return [c[1]["weights"] for c in engine.engine.calls if c[0] == "generate"][-1]


def _memory(actor, groups, ckpt):
    import sglang_fake

    gpu = sglang_fake.GPU
    gpu.total, gpu.trainer_allocated, gpu.trainer_cached, gpu.engine = 100, 40, 0, 0
    torch.cuda.empty_cache = gpu.empty_cache  # this process's torch allocator is the fake GPU's
    engine = _engine(actor, groups, ckpt)
    _generate(engine)
    engine.release_memory()
    gpu.trainer_allocated += 10  # optimizer state
    gpu.trainer_cached += 25  # activations freed into torch's cache
    engine.update_weights()
    try:
        _generate(engine)
        outcome = "ok"
    except Exception as e:  # noqa: BLE001 - what it raised is the result
        outcome = str(e)
    result = {"pool": engine.engine.sizes, "outcome": outcome, "free_after": gpu.free()}
    gpu.total = 10**9
    return result


def _resume_and_rollout_only(actor, groups, ckpt):
    out = {}
    engine = _engine(actor, groups, ckpt)
    with torch.no_grad():
        for p in actor.module.parameters():
            p.add_(0.25)  # a checkpoint loaded after the engine started
    out["resumed"] = (_generate(engine), _expected(actor, groups))
    engine.release_memory()  # a rollout-only step: no training, no update_weights
    out["rollout_only"] = (_generate(engine), _expected(actor, groups))
    backed = _engine(actor, groups, ckpt, weights_cpu_backup=True)
    _generate(backed)
    backed.release_memory()
    updates = len([c for c in backed.engine.calls if c[0] == "update_weights_from_tensor"])
    out["backup"] = (_generate(backed), _expected(actor, groups), updates,
                     len([c for c in backed.engine.calls if c[0] == "update_weights_from_tensor"]))
    return out


def _busy(actor, groups, ckpt):
    engine = _engine(actor, groups, ckpt)
    _generate(engine)
    engine.engine.running = 1
    try:
        engine.release_memory()
        error = None
    except Exception as e:  # noqa: BLE001 - what it raised is the result
        error = f"{type(e).__name__}: {e}"
    dead = engine.engine.dead
    engine.engine.running, engine.engine.dead = 0, False
    engine.release_memory()
    return {"error": error, "dead": dead, "released": sorted(engine.released)}


def _failed_sync(actor, groups, ckpt):
    from sglang_fake import FailingOnceFakeEngine

    engine = _engine(actor, groups, ckpt, FailingOnceFakeEngine)
    try:
        engine.update_weights()
        error = None
    except RuntimeError as e:
        error = str(e)
    return {"error": error, "stale": engine.weights_stale, "retry": (_generate(engine), _expected(actor, groups))}


def _lifecycle_job(rank, ckpt):
    actor, groups = worker_actor(ckpt, 1)
    return {"memory": _memory(actor, groups, ckpt), **_resume_and_rollout_only(actor, groups, ckpt),
            "busy": _busy(actor, groups, ckpt), "failed_sync": _failed_sync(actor, groups, ckpt)}


@pytest.fixture(scope="module")
def lifecycle(ckpt):
    return spawn(_lifecycle_job, 1, ckpt)[0]


def test_resume_after_training_memory_fits(lifecycle):
    m = lifecycle["memory"]
    assert m["pool"] == {"weights": 5, "cuda_graph": 1, "kv_cache": 24}
    assert m["outcome"] == "ok" and m["free_after"] == 100 - 50 - 30


def test_resumed_run_samples_from_the_loaded_weights(lifecycle):
    sampled_from, actor = lifecycle["resumed"]
    assert sampled_from == actor


def test_rollout_only_step_two_samples_from_real_weights(lifecycle):
    sampled_from, actor = lifecycle["rollout_only"]
    assert sampled_from is not None and sampled_from == actor
    sampled_from, actor, before, after = lifecycle["backup"]
    assert sampled_from == actor and before == after > 0  # the CPU backup: nothing streamed again


def test_release_while_busy_is_refused_before_sglang(lifecycle):
    b = lifecycle["busy"]
    assert b["error"].startswith("RuntimeError: SGLang flush_cache before releasing memory failed")
    assert not b["dead"] and b["released"] == ["cuda_graph", "kv_cache", "weights"]


def test_failed_sync_closes_the_session_and_is_retried(lifecycle):
    f = lifecycle["failed_sync"]
    assert f["error"] == "SGLang update_weights_from_tensor failed: load_weights failed" and f["stale"]
    sampled_from, actor = f["retry"]
    assert sampled_from == actor  # the next generate streamed again (begin_weight_update accepted)


def _start_job(rank):
    from megarl.distributed import build_parallel_groups, init_distributed
    from megarl.rollout.sglang import SGLangEngine, SGLangOptions
    from sglang_fake import FakeSerialized, SlowFakeEngine

    init_distributed(timeout_s=3)
    groups = build_parallel_groups(2)
    engine = SGLangEngine(None, groups, None, [3], SGLangOptions(model_path="x", start_timeout_s=60),
                          engine_factory=SlowFakeEngine, tensor_wrapper=FakeSerialized)
    engine.close()
    return engine.engine.calls[-1][0] if engine.engine is not None else None


def test_slow_engine_start_outlasts_the_collective_timeout():
    assert spawn(_start_job, 2) == ["shutdown", None]
