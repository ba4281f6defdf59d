"""Native rollout with continuous batching: greedy == ``transformers`` greedy; seeds; training log-probs.

A random Llama-shaped checkpoint (GQA, 57-token vocab padded to 128 per TP
rank) is loaded into the actor at TP1, TP2 and PP2, and the engine is made to
exercise every scheduling path at once: 7 prompts of lengths 1..23 (chunked
prefill under an 8-token budget), at most 3 sequences decoding (slots refill
as others finish), an EOS id picked so that some responses stop early and
others run to the limit, and a page pool of 6 pages of 8 tokens (room for
the longest sequence alone), which forces preemption and recompute. Greedy
responses must equal, token for token, ``transformers`` ``generate`` on each
prompt alone.

Seeds: sampled responses depend only on the request's seed — the same prompt
and seed give the same tokens alone or among other requests, in another
position. The CUDA-graph path's static input buffers and bucket padding (a
batch of 3 decoding as 4, the pad row reading no keys and writing the scratch
page; prefill chunks of at most 8 tokens as 16, in no sequence, and their
sequences and sampled rows padded to a row bucket; with PP the hidden states in
and out of each stage's buffers) run eagerly at every layout and must give the
same greedy and sampled tokens; with
one stage they also plan each decode step before the previous step's tokens
are read (fed from the device; rows past a stop token dropped).
Log-probs: the engine's log-prob of each sampled token (temperature 0.7,
top-k 20, top-p 0.9, 2 requests per prompt, prefix-shared prompts) equals the actor's training
forward over the same tokens (fp32, 1e-5). Not covered: graph capture itself
(GPU test), SGLang, bf16.
"""
import pytest
import torch

from dist_helpers import spawn, worker_actor
from megarl.models.tiny import make_tiny_checkpoint

PROMPTS = [[7, 8, 9, 10, 11, 12], [13, 14], list(range(20, 43)), [30], [5, 6, 7, 8, 9, 10, 11, 12, 13],
           [40, 41, 42], list(range(10, 22))]
MAX_NEW = 10
PAGE = 8


def _engine(actor, groups, eos, pages: int, max_batch: int):
    from megarl.rollout.native import EngineOptions, NativeEngine
    from megarl.rollout.pages import KVLayout

    st_cfg = actor.module.config
    layout = KVLayout(len(actor.module.decoder.layers), st_cfg.num_query_groups // groups.tp_size,
                      st_cfg.kv_channels, PAGE, st_cfg.params_dtype)
    budget_gb = pages * layout.page_bytes() / 2**30
    options = EngineOptions(max_batch=max_batch, page_size=PAGE, max_num_batched_tokens=8, kv_cache_gb=budget_gb)
    return NativeEngine(actor.module, groups, actor.info.vocab_size, [eos], 0, options)


def _rollout(rank, ckpt, tp, pp, eos):
    from megarl.errors import ConfigError
    from megarl.rollout.engine import SamplingParams, sample_requests
    from megarl.trainer.rollout import to_sample_batch

    actor, groups = worker_actor(ckpt, tp, pp)
    engine = _engine(actor, groups, eos, pages=6, max_batch=3)
    one_each = sample_requests(PROMPTS, 1, 0, MAX_NEW)
    greedy = engine.generate(one_each, SamplingParams(temperature=0.0))
    preemptions = engine.stats["rollout/preemptions"]
    try:  # a pool that cannot hold the longest sequence alone is a config error, not a hang
        _engine(actor, groups, eos, pages=3, max_batch=3).generate(one_each, SamplingParams())
        too_small = "no error"
    except ConfigError as e:
        too_small = str(e)

    from megarl.rollout.graphs import DecodeGraphs  # the graph path's buffers and padding, run eagerly
    from megarl.rollout.prefill_graphs import PrefillGraphs

    bucketed = _engine(actor, groups, eos, pages=64, max_batch=5)  # buckets 1, 2, 4, 5
    bucketed.graphs = DecodeGraphs(bucketed, 5, capture=False)
    bucketed.prefill_graphs = PrefillGraphs(bucketed, bucketed.graphs, capture=False)  # 8-token chunks -> 16
    padded = [r.response_ids for r in bucketed.generate(one_each, SamplingParams(temperature=0.0))]
    padded_steps = bucketed.stats["rollout/graph_steps"]
    padded_prefills = bucketed.stats["rollout/prefill_graph_steps"]
    padded_ahead = bucketed.stats["rollout/planned_ahead_steps"]
    refills_ahead = bucketed.stats["rollout/planned_ahead_prefills"]
    roomy = _engine(actor, groups, eos, pages=64, max_batch=16)
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9)
    requests = sample_requests(PROMPTS, 2, 100, MAX_NEW)
    sampled = roomy.generate(requests, params)
    alone = roomy.generate(requests[8:10], params)
    bucketed_sampled = bucketed.generate(requests, params)
    batch = to_sample_batch(sampled, 0, "cpu")
    train = actor.logprobs(batch, micro_batch_size=4, temperature=0.7)["logprobs"]
    diff = ((train - batch.rollout_logprobs).abs() * batch.response_mask).max()
    return {"greedy": [r.response_ids for r in greedy], "finish": [r.finish_reason for r in greedy],
            "preemptions": preemptions, "diff": float(diff), "too_small": too_small,
            "padded": padded, "padded_steps": padded_steps, "padded_ahead": padded_ahead,
            "padded_prefills": padded_prefills, "refills_ahead": refills_ahead,
            "bucketed_sampled": [r.response_ids for r in bucketed_sampled],
            "sampled": [r.response_ids for r in sampled], "alone": [r.response_ids for r in alone]}


def _greedy_no_stop(model, prompt):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(MAX_NEW):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def ckpt_and_hf(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    model = make_tiny_checkpoint(str(path), "LlamaForCausalLM", seed=1, vocab_size=57, eos_token_id=3)
    # EOS: a token greedy emits mid-response for some prompts (they stop early), not for all
    free = [_greedy_no_stop(model, p) for p in PROMPTS]
    counts = torch.bincount(torch.tensor([t for f in free for t in f[1:-2]]), minlength=57)
    counts[0] = 0  # not the pad id
    eos = int(counts.argmax())
    expected = [model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0,
                               eos_token_id=eos)[0, len(p):].tolist() for p in PROMPTS]
    assert any(len(e) < MAX_NEW for e in expected) and any(len(e) == MAX_NEW for e in expected)
    return str(path), eos, expected


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_continuous_batching_greedy_seeds_and_logprobs(ckpt_and_hf, tp, pp):
    ckpt, eos, expected = ckpt_and_hf
    results = spawn(_rollout, tp * pp, ckpt, tp, pp, eos)
    r = results[0]
    assert r["greedy"] == expected
    assert r["finish"] == ["stop" if eos in e else "length" for e in expected]
    assert r["preemptions"] > 0  # the 6-page pool cannot hold every sequence
    assert r["too_small"].startswith("rollout.kv_cache_gb:")
    # decode and prefill through the graph buffers, batches padded to buckets (3 -> 4 rows, chunks of
    # at most 8 tokens -> 16, sequences and sampled rows to the row buckets): same tokens
    assert r["padded"] == expected and r["padded_steps"] > 0 and r["padded_prefills"] > 0
    # one stage: decode steps were planned while the previous one ran (its tokens fed on the device),
    # and refills launched before the pending decode's tokens were read (theirs fed on the device too)
    assert (r["padded_ahead"] > 0) == (pp == 1)
    assert (r["refills_ahead"] > 0) == (pp == 1)
    assert r["bucketed_sampled"] == r["sampled"]
    assert r["diff"] < 1e-5
    assert r["alone"] == r["sampled"][8:10]  # prompt 4's two samples, same seed, alone
    assert len({tuple(s) for s in r["sampled"]}) > len(PROMPTS)  # samples of a prompt differ
    for other in results[1:]:  # every rank of the replica decodes the same tokens
        assert other["greedy"] == r["greedy"] and other["sampled"] == r["sampled"]


def _shared_prefills(rank, ckpt, eos):
    """n-fold requests together and alone; identical prompts apart and adjacent; a group over max_batch."""
    from megarl.rollout.engine import SamplingParams, sample_requests

    actor, groups = worker_actor(ckpt)
    roomy, narrow = (_engine(actor, groups, eos, pages=64, max_batch=b) for b in (16, 2))
    params = SamplingParams(temperature=0.8, top_k=30)

    def run(requests, engine=roomy):
        results = engine.generate(requests, params)
        return {"results": [(r.key, r.response_ids, r.finish_reason, r.logprobs) for r in results],
                "prefill_tokens": engine.stats["rollout/prefill_tokens"],
                "preemptions": engine.stats["rollout/preemptions"]}

    n_fold = sample_requests(PROMPTS, 3, 5, MAX_NEW)
    a, b, c = PROMPTS[2], PROMPTS[4], PROMPTS[1]
    apart = sample_requests([a, b, list(a), c, list(b)], 2, 9, MAX_NEW)  # equal contents, other lists
    first_seen = {}
    adjacent = sorted(apart, key=lambda r: first_seen.setdefault(tuple(r.prompt), len(first_seen)))
    wide_group = sample_requests([a], 5, 13, MAX_NEW)
    return {"n_fold": run(n_fold), "alone": [run([r]) for r in n_fold], "apart": run(apart),
            "adjacent": run(adjacent), "adjacent_keys": [r.key for r in adjacent],
            "wide": run(wide_group), "narrow": run(wide_group, narrow), "lengths": (len(a), len(b), len(c))}


def test_identical_prompts_share_one_prefill_and_keep_their_tokens(ckpt_and_hf):
    """The native engine groups requests by prompt content (TP1, 16 slots, 64 pages: no preemption).

    n-fold (``sample_requests``: 7 prompts x 3): each prompt is prefilled once, so the prefill steps
    feed sum(len(prompt)) tokens (not 3x), and every request's tokens equal those of the same request
    given alone (its forks read the leader's pages; log-probs to 1e-5, as batches differ). Identical
    prompts apart in the list (prompt slots a, b, a, c, b; 2 samples each; the repeats are other list
    objects) prefill a, b, c once each — as when the same requests come adjacent — with the same
    tokens per key, results in request order. A group larger than max_batch (5 samples on 2 slots)
    is split (3 prefills) with the same tokens. Not covered: TP/PP (the layout test above runs n = 2
    groups at every layout), the prefix cache (off)."""
    ckpt, eos, _ = ckpt_and_hf
    (r,) = spawn(_shared_prefills, 1, ckpt, eos)
    la, lb, lc = r["lengths"]
    assert r["n_fold"]["prefill_tokens"] == sum(len(p) for p in PROMPTS)
    assert r["n_fold"]["preemptions"] == 0
    assert [k for k, *_ in r["n_fold"]["results"]] == list(range(3 * len(PROMPTS)))
    for (key, ids, finish, lps), (alone,) in zip(r["n_fold"]["results"], [a["results"] for a in r["alone"]]):
        assert (key, ids, finish) == alone[:3]
        assert torch.allclose(torch.tensor(lps), torch.tensor(alone[3]), rtol=0, atol=1e-5)
    assert len({tuple(ids) for _, ids, _, _ in r["n_fold"]["results"]}) > len(PROMPTS)  # samples differ
    assert r["apart"]["prefill_tokens"] == r["adjacent"]["prefill_tokens"] == la + lb + lc
    assert [k for k, *_ in r["apart"]["results"]] == list(range(10))
    assert [k for k, *_ in r["adjacent"]["results"]] == r["adjacent_keys"] != list(range(10))
    by_key = {k: (ids, finish) for k, ids, finish, _ in r["adjacent"]["results"]}
    assert all(by_key[k] == (ids, finish) for k, ids, finish, _ in r["apart"]["results"])
    assert r["wide"]["prefill_tokens"] == la and r["narrow"]["prefill_tokens"] == 3 * la
    assert [x[:3] for x in r["narrow"]["results"]] == [x[:3] for x in r["wide"]["results"]]


def _multi_turn(rank, ckpt):
    """Two turns with the prefix cache on and off; turn 2 = turn-1 prompt + response + new tokens."""
    from megarl.rollout.engine import SamplingParams, sample_requests
    from megarl.rollout.native import EngineOptions, NativeEngine

    actor, groups = worker_actor(ckpt)
    greedy = SamplingParams(temperature=0.0)
    shared = list(range(30, 47))  # two prompts that start with the same 17 tokens
    turn1 = [shared + [5, 6], shared + [7]]
    out = {}
    for cached in (False, True):
        engine = NativeEngine(actor.module, groups, actor.info.vocab_size, [], 0,
                              EngineOptions(max_batch=4, page_size=PAGE, max_num_batched_tokens=8,
                                            prefix_cache=cached))
        first = engine.generate(sample_requests(turn1, 1, 0, MAX_NEW), greedy)
        hits1 = engine.stats["rollout/prefix_cached_tokens"]
        turn2 = [r.prompt_ids + r.response_ids + [11, 12, 13] for r in first]
        second = engine.generate(sample_requests(turn2, 1, 0, MAX_NEW), greedy)
        out[cached] = {"turn1": [r.response_ids for r in first], "turn2": [r.response_ids for r in second],
                       "turn2_prompts": turn2, "hits": (hits1, engine.stats["rollout/prefix_cached_tokens"])}
        engine.update_weights()
        out[cached]["after_sync"] = (engine.generate(sample_requests(turn2, 1, 0, MAX_NEW), greedy)
                                     and engine.stats["rollout/prefix_cached_tokens"])
    return out


def test_prefix_cache_reuses_a_conversations_pages(ckpt_and_hf):
    """Turn 1: two prompts sharing 17 tokens (2 full pages of 8), prefilled in 8-token chunks, so
    the second request, prefilled after the first, takes the first's pages. Turn 2 (prompt + response + 3 tokens) takes turn 1's full pages again. Greedy
    tokens equal the cold engine's and ``transformers``'; after a weight sync nothing is reused."""
    ckpt, _, _ = ckpt_and_hf
    (r,) = spawn(_multi_turn, 1, ckpt)
    warm, cold = r[True], r[False]
    assert warm["turn1"] == cold["turn1"] and warm["turn2"] == cold["turn2"]
    assert cold["hits"] == (0, 0) and cold["after_sync"] == 0
    # turn 2: each conversation takes its 3 full pages of turn 1 (24 tokens each)
    assert warm["hits"] == (16, 48)
    assert warm["after_sync"] == 16  # after a weight sync only the two turn-2 prompts share again
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    for prompt, got in zip(warm["turn2_prompts"], warm["turn2"]):  # turn-1 responses may hold the pad id,
        assert got == _greedy_no_stop(model, prompt)  # which generate() would mask: plain forwards instead


def _split_k(rank, ckpt, eos):
    """Decode with the split-K projections forced on (CUDA's default; off on CPU), partials counted."""
    from megarl.rollout import split_linear, stage
    from megarl.rollout.engine import SamplingParams, sample_requests
    from megarl.trainer.rollout import to_sample_batch

    calls = []

    def counted(x, weight, parts):
        calls.append((x.shape[0], parts))
        return split_linear.split_k_linear(x, weight, parts)

    stage.split_k_linear = counted
    actor, groups = worker_actor(ckpt)
    engine = _engine(actor, groups, eos, pages=64, max_batch=5)
    assert not engine.stage.split_k  # CPU
    engine.stage.split_k = True
    greedy = engine.generate(sample_requests(PROMPTS, 1, 0, MAX_NEW), SamplingParams(temperature=0.0))
    sampled = engine.generate(sample_requests(PROMPTS, 2, 100, MAX_NEW), SamplingParams(temperature=0.7, top_k=20))
    batch = to_sample_batch(sampled, 0, "cpu")
    train = actor.logprobs(batch, micro_batch_size=4, temperature=0.7)["logprobs"]
    diff = ((train - batch.rollout_logprobs).abs() * batch.response_mask).max()
    return {"greedy": [r.response_ids for r in greedy], "diff": float(diff), "calls": calls,
            "layers": len(engine.stage.layers)}


def test_split_k_with_qkv_bias_keeps_greedy_tokens_and_training_logprobs(tmp_path):
    """Qwen2 (QKV bias, added by the attention kernel to the summed partials): greedy equals
    transformers, the sampled tokens' log-probs the training forward."""
    model = make_tiny_checkpoint(str(tmp_path), "Qwen2ForCausalLM", seed=2, vocab_size=57, eos_token_id=3)
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    expected = [_greedy_no_stop(model, p) for p in PROMPTS]
    (r,) = spawn(_split_k, 1, str(tmp_path), 3)
    assert r["greedy"] == [e[: e.index(3) + 1] if 3 in e else e for e in expected]
    assert r["diff"] < 1e-5 and r["calls"]


def test_split_k_decode_keeps_greedy_tokens_and_training_logprobs(ckpt_and_hf):
    """qkv, proj and fc2 as split-K partials summed in the next kernel (every layer's, the last fc2's by
    the final norm; decode steps only): greedy still equals transformers, log-probs the training forward."""
    ckpt, eos, expected = ckpt_and_hf
    (r,) = spawn(_split_k, 1, ckpt, eos)
    assert r["greedy"] == expected
    assert r["diff"] < 1e-5
    assert r["calls"] and all(parts > 1 and rows <= 5 for rows, parts in r["calls"])  # decode rows only
    assert len(r["calls"]) % (3 * r["layers"]) == 0  # per decode step: every qkv, proj and fc2


def test_engine_options_take_their_defaults_and_values_from_the_rollout_section():
    """EngineOptions() has RolloutConfig()'s defaults; engine_options(cfg) carries every rollout key it names
    (each set here to a non-default value) and sizes the graphs for the longest prompt + response."""
    import dataclasses

    from megarl.config import Config, RolloutConfig
    from megarl.rollout.factory import engine_options
    from megarl.rollout.native import EngineOptions

    keys = [f.name for f in dataclasses.fields(EngineOptions) if f.name != "max_model_len"]
    assert len(keys) == 8 and {k: getattr(EngineOptions(), k) for k in keys} == {
        k: getattr(RolloutConfig(), k) for k in keys}
    cfg = Config()
    changed = {"max_batch": 7, "page_size": 32, "max_num_batched_tokens": 99, "kv_cache_gb": 1.5,
               "kv_cache_fraction": 0.25, "cuda_graphs": False, "prefix_cache": True, "mixed_prefill": False}
    for key, value in changed.items():
        setattr(cfg.rollout, key, value)
    cfg.data.max_prompt_len, cfg.rollout.max_new_tokens = 40, 24
    assert engine_options(cfg) == EngineOptions(**changed, max_model_len=64)
