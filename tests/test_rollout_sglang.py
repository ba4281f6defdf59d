"""SGLang adapter on CPU, without SGLang: the weight stream and the control flow against a fake engine.

Setup: the tiny random Llama checkpoint (GQA, vocab 57, eos 3) is loaded into
the actor at TP1 and TP2 (one spawn each) and exported with ``export_hf``.

Weight stream. ``iter_hf_buckets`` must yield, on TP rank 0, exactly the
tensors the export wrote (same names, once each; same shapes, dtypes and bits)
and nothing on TP rank 1. With a 20,000-byte limit the fp32 tensors of this
model are 256 B (norms) to 32 KiB (gate/up/down), so buckets both pack several
tensors and hold a single over-limit tensor alone; no bucket of two or more
tensors may exceed the limit.

Control flow, against ``tests/sglang_fake.py`` (SGLang 0.5.23's names, formats
and behaviours; see its docstring). Expected: the fake is built once, on TP
rank 0 only (``tp_size`` = TP, bfloat16, dummy weights); each request becomes
one SGLang request, in order, with its own seed as ``sampling_seed`` (requests
given in an order that is not by prompt, two per prompt), its own
``max_new_tokens``, stops = eos + params' stops; results come in request order
under the requests' keys with the fake's ids, log-probs and finish types
("stop" and "length" both occur) and are identical on both TP ranks. Weights:
streamed before the first generate and again after every release (no CPU
backup), each sync exactly the bfloat16 stream's buckets in order, then a
flush; every tensor carries one payload per TP worker and worker i read TP rank
i's. Memory: a flush before each release of all three tags; a resume re-maps
"weights" first, then "kv_cache" and "cuda_graph". Process: the fake changed
rank 0's environment, start method, SIGQUIT handler, logging and gc as SGLang
does (NCCL_ALGO too, at TP2 with deterministic inference); after the start
each rank's process state equals its state before.

Not covered: a real SGLang (see megarl/rollout/sglang.py for what only a GPU
run with SGLang verifies), the consecutive-GPU check (CUDA only), PP > 1, the
scenarios across steps (test_rollout_sglang_lifecycle.py).
"""
import io
import os
import random
from types import SimpleNamespace

import pytest
import torch

from dist_helpers import spawn, worker_actor

EOS = 3
LIMIT = 20000  # bytes per bucket
PROMPTS = [[7, 8, 9], [13, 14], [20, 21, 22, 23], [30]]
SEEDS, LIMITS = [11, 12, 13, 14], [6, 3, 8, 5]


def _sampled_requests():
    """Two requests per prompt, samples of a prompt apart (j = 0 of every prompt first), keys 10 + 2 i + j."""
    from megarl.rollout.engine import Request

    return [Request(10 + 2 * i + j, PROMPTS[i], SEEDS[i] * 100 + j, LIMITS[i]) for j in range(2) for i in range(4)]


def _job(rank, ckpt, tp, out_dir):
    from megarl.models import export_hf
    from megarl.rollout.engine import SamplingParams, sample_requests
    from megarl.rollout.sglang import SGLangEngine, SGLangOptions
    from megarl.rollout.sglang_process import process_state
    from megarl.rollout.weight_stream import iter_hf_buckets
    from sglang_fake import FakeEngine, FakeSerialized

    actor, groups = worker_actor(ckpt, tp)
    export_hf(actor.module, actor.info, groups, out_dir)
    stream = [[(n, t.clone()) for n, t in b] for b in iter_hf_buckets(actor.module, groups, actor.info, LIMIT)]
    synced = [[(n, t.clone()) for n, t in b]  # what a sync sends: SGLang's dtype
              for b in iter_hf_buckets(actor.module, groups, actor.info, LIMIT, torch.bfloat16)]
    options = SGLangOptions(model_path=ckpt, update_bucket_mb=LIMIT / 2**20, deterministic=True)
    before = process_state()
    engine = SGLangEngine(actor.module, groups, actor.info, [EOS], options, engine_factory=FakeEngine,
                          tensor_wrapper=FakeSerialized)
    after = process_state()
    sampled = engine.generate(_sampled_requests(),
                              SamplingParams(temperature=0.7, top_p=0.9, top_k=5, stop_token_ids=(5,)))
    greedy = engine.generate(sample_requests(PROMPTS[:2], 1, 0, 4), SamplingParams(temperature=0.0))
    engine.release_memory()
    metrics = engine.update_weights()
    engine.resume_memory()
    engine.release_memory()
    engine.generate(sample_requests(PROMPTS[:1], 1, 0, 2), SamplingParams())  # resumes everything first
    engine.close()
    fake = engine.engine
    buf = io.BytesIO()  # by value: tensors in shared memory would not outlive this process
    torch.save({"stream": stream, "synced": synced, "sampled": sampled, "greedy": greedy, "metrics": metrics,
                "calls": fake.calls if fake is not None else None,
                "loaded_by_worker": fake.loaded_by_worker if fake is not None else None,
                "same_state": _comparable(before) == _comparable(after)}, buf)
    return buf.getvalue()


def _comparable(state):
    return {k: (v if k != "signals" else {s: repr(h) for s, h in v.items()}) for k, v in state.items()}


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def run(request, ckpt, tmp_path_factory):
    out = str(tmp_path_factory.mktemp(f"export_tp{request.param}"))
    ranks = spawn(_job, request.param, ckpt, request.param, out)
    return request.param, out, [torch.load(io.BytesIO(r), weights_only=False) for r in ranks]


def _calls(ranks, name):
    return [c for c in ranks[0]["calls"] if c[0] == name]


def test_stream_equals_export(run):
    from safetensors.torch import load_file

    tp, out, ranks = run
    exported = load_file(os.path.join(out, "model.safetensors"))
    streamed = [pair for bucket in ranks[0]["stream"] for pair in bucket]
    assert sorted(n for n, _ in streamed) == sorted(exported)  # each name once
    for name, t in streamed:
        ref = exported[name]
        assert (t.dtype, t.shape) == (ref.dtype, ref.shape), name
        assert torch.equal(t.view(torch.uint8), ref.view(torch.uint8)), name  # bitwise
    assert all(r["stream"] == [] for r in ranks[1:])


def test_buckets_within_limit(run):
    buckets = run[2][0]["stream"]
    sizes = [[t.numel() * t.element_size() for _, t in b] for b in buckets]
    assert all(sum(s) <= LIMIT or len(s) == 1 for s in sizes)
    assert any(len(s) > 1 for s in sizes) and any(s[0] > LIMIT for s in sizes if len(s) == 1)
    for a, b in zip(sizes, sizes[1:]):  # greedy: the next tensor did not fit
        assert sum(a) + b[0] > LIMIT


def test_generate_control_flow(run):
    from megarl.rollout.engine import mix_seed

    tp, _, ranks = run
    init = ranks[0]["calls"][0][1]
    assert init["tp_size"] == tp and all(r["calls"] is None for r in ranks[1:])
    assert init["skip_tokenizer_init"] and init["load_format"] == "dummy" and init["dtype"] == "bfloat16"
    (_, sent, outs), (_, greedy_sent, _), _ = _calls(ranks, "generate")
    requests = _sampled_requests()
    assert sent["return_logprob"] and sent["input_ids"] == [r.prompt for r in requests]
    for req, sp in zip(requests, sent["sampling_params"], strict=True):
        assert (sp["sampling_seed"], sp["max_new_tokens"]) == (req.seed, req.max_new_tokens)  # seed as is
        assert (sp["stop_token_ids"], sp["ignore_eos"], sp["temperature"], sp["top_k"]) == ([3, 5], False, 0.7, 5)
    results = ranks[0]["sampled"]
    assert [r.key for r in results] == [r.key for r in requests]
    for req, r, out in zip(requests, results, outs, strict=True):
        assert r.prompt_ids == req.prompt and r.response_ids == out["output_ids"]
        assert r.logprobs == [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        assert r.finish_reason == out["meta_info"]["finish_reason"]["type"]
    assert {r.finish_reason for r in results} == {"stop", "length"}
    g = greedy_sent["sampling_params"]
    assert [sp["sampling_seed"] for sp in g] == [mix_seed(mix_seed(0, i), 0) for i in range(2)]
    assert all(sp["temperature"] == 0.0 and sp["max_new_tokens"] == 4 for sp in g)
    for other in ranks[1:]:
        assert (other["sampled"], other["greedy"]) == (ranks[0]["sampled"], ranks[0]["greedy"])


def test_weight_sync_and_memory_calls(run):
    """Weights stream before the first generate (dummy until then), after each release (no CPU backup)
    before the next generate, weights resumed before the KV cache, a flush before every release."""
    _, _, ranks = run
    stream = ranks[0]["synced"]
    names = [c[0] for c in ranks[0]["calls"]]
    sync = ["begin_weight_update"] + ["update_weights_from_tensor"] * len(stream) + ["end_weight_update", "flush_cache"]
    release = ["flush_cache", "release_memory_occupation"]
    resume = ["resume_memory_occupation"]
    assert names == (["__init__"] + sync + ["generate", "generate"] + release + resume + sync + resume + release
                     + resume + sync + resume + ["generate", "shutdown"])
    updates = _calls(ranks, "update_weights_from_tensor")
    for k, (_, sent) in enumerate(updates):
        bucket = stream[k % len(stream)]
        assert [n for n, _ in sent["named_tensors"]] == [n for n, _ in bucket]
        assert all(a.dtype == torch.bfloat16 and torch.equal(a, b) for (_, a), (_, b) in zip(sent["named_tensors"], bucket))
        assert sent["load_format"] is None and sent["flush_cache"] is False
    every = ["kv_cache", "weights", "cuda_graph"]
    assert [c[1]["tags"] for c in _calls(ranks, "release_memory_occupation")] == [every, every]
    resumed = [c[1]["tags"] for c in _calls(ranks, "resume_memory_occupation")]
    assert resumed == [["weights"], ["kv_cache", "cuda_graph"]] * 2
    m = ranks[0]["metrics"]
    assert m["weight_sync/buckets"] == len(stream) and m["weight_sync/seconds"] >= 0
    assert m["weight_sync/bytes"] == sum(t.numel() * 2 for b in stream for _, t in b)  # bfloat16
    assert len(stream) < len(ranks[0]["stream"])  # half the bytes of float32: fewer buckets
    assert all(r["metrics"] == {**m, "weight_sync/seconds": r["metrics"]["weight_sync/seconds"]} for r in ranks[1:])


def test_each_tp_rank_sends_its_own_copy(run):
    """One payload per SGLang TP worker per tensor, and worker i read TP rank i's payload of every tensor."""
    tp, _, ranks = run
    names = [[n for n, _ in b] for b in ranks[0]["synced"]]
    assert all(sent["payloads"] == [tp] * len(sent["named_tensors"]) for _, sent in
               _calls(ranks, "update_weights_from_tensor"))
    assert ranks[0]["loaded_by_worker"] == [[bucket] * tp for bucket in names] * 3


def test_engine_start_leaves_the_process_as_it_was(run):
    """The fake set NCCL_ALGO, CUDA_DEVICE_MAX_CONNECTIONS, spawn, SIGQUIT, logging, gc as SGLang does;
    after the start rank 0's environment, start method, handlers, logging and gc are as before."""
    tp, _, ranks = run
    seen = ranks[0]["calls"][0][1]["environ_seen"]
    assert seen["CUDA_DEVICE_MAX_CONNECTIONS"] == "8" and ("NCCL_ALGO" in seen) == (tp > 1)
    assert all(r["same_state"] for r in ranks)


def test_requests_and_outputs_edge_cases():
    from megarl.rollout.engine import Request, SamplingParams
    from megarl.rollout.sglang import build_requests, parse_output

    (sp,) = build_requests([Request(0, [1, 2], 5, 3)], SamplingParams(), eos_ids=[])
    assert sp["ignore_eos"] and sp["stop_token_ids"] is None  # megarl's ignore_eos: no stop at all
    ok = {"output_ids": [4, 3], "meta_info": {"finish_reason": {"type": "stop", "matched": 3},
                                               "output_token_logprobs": [(-0.5, 4, None), (-1.5, 3, None)]}}
    assert parse_output(ok, 0) == ([4, 3], [-0.5, -1.5], "stop")
    aborted = {"output_ids": [], "meta_info": {"finish_reason": {"type": "abort", "message": "oom"},
                                                "output_token_logprobs": []}}
    with pytest.raises(RuntimeError, match="oom"):
        parse_output(aborted, 1)
    with pytest.raises(RuntimeError, match="do not match"):
        parse_output({**ok, "output_ids": [4, 4]}, 2)


def test_pipeline_and_context_parallel_are_refused():
    from megarl.errors import ConfigError
    from sglang_fake import FakeEngine
    from megarl.rollout.sglang import SGLangEngine, SGLangOptions

    with pytest.raises(ConfigError, match="parallel.pp=1"):
        SGLangEngine(None, SimpleNamespace(pp_size=2), None, [3], SGLangOptions(model_path="x"), FakeEngine)
    with pytest.raises(ConfigError, match="parallel.cp=1"):
        SGLangEngine(None, SimpleNamespace(pp_size=1, cp_size=2), None, [3], SGLangOptions(model_path="x"), FakeEngine)


def test_missing_sglang_is_a_config_error():
    import importlib.util

    from megarl.errors import ConfigError
    from megarl.rollout.sglang import NOT_INSTALLED, SGLangEngine, SGLangOptions, load_engine_class

    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed here")
    assert NOT_INSTALLED == ("rollout.engine=sglang: SGLang is not installed (pip install sglang==0.5.23); "
                             "use rollout.engine=native")
    with pytest.raises(ConfigError, match="^rollout.engine=sglang: SGLang is not installed"):
        load_engine_class()
    with pytest.raises(ConfigError, match="pip install sglang==0.5.23"):
        SGLangEngine(None, SimpleNamespace(pp_size=1, cp_size=1), None, [3], SGLangOptions(model_path="x"))
