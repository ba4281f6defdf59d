"""The prefix cache while the native engine records expert ids: a reused page brings its tokens' ids.

Without a model (the scheduler and pool, a fake forward whose ids at a fed row are a function of its
position and token, so a cold prefill's record is known exactly): every finished sequence's record —
prompt positions 0 .. P - 2 and each response token's sampling row — equals that function at every
position, while pages are reused from earlier requests of the call and from an earlier call, step by
step and with steps launched ahead (a step's ids are filed a step late, after the next is planned: a
refill planned then must not reuse a page whose ids are not written yet; it would read unrecorded
marks). Pages leaving the cache (eviction, ``forget``, ``reset``) drop their ids.

With a tiny random fp32 Qwen3-MoE (megarl/models/tiny.py) in the engine: a two-turn conversation
(turn-1 requests sharing a 17-token prefix, turn 2 = turn 1 + response + new tokens) with the prefix
cache on reuses pages in both turns, and its tokens, response ids and prompt ids equal those of the
same requests with the cache off, bitwise, the log-probs within 1e-5 — eagerly and through the graphs'
buffers run uncaptured (steps launched ahead). On CPU fp32 the routing of a token whose K/V a decode
row computed equals the routing a cold prefill computes for it (the router logits differ in the last
bits; no top-k choice is that close in these models), which is what makes the comparison bitwise.
After the weights move (``update_weights``) no page of the earlier weights is reused: the prompt ids
equal a cold engine's under the new weights, and differ from the earlier ids.
Not covered: bf16 on a GPU, where a cached page's ids are those of the forward that computed it
(another batch than a cold prefill's, so routing may differ by numerics); CUDA-graph capture. Layouts
are elsewhere, with the prefix cache on: EP2 (tests/test_rollout_moe.py: cached prompt ids equal
``transformers``' routing), TP2 and PP2 (tests/test_moe_r3_runs.py: r3 agreement 1).
"""
import numpy as np
import pytest

from dist_helpers import spawn
from megarl.rollout.pages import PagePool, pages_for, prefix_keys
from megarl.rollout.scheduler import Scheduler, Sequence
from megarl.rollout.step_experts import StepExperts, sequence_expert_ids

PAGE, EXPERTS, SHAPE = 4, 8, (2, 2)  # fake: (layers, k) = (2, 2) ids a token
PREFILL_ROWS = 64


def fake_ids(positions: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """(T,) positions and fed tokens -> (T, layers, k) uint8 ids, each a function of (position, token)."""
    p, t = positions[:, None, None], tokens[:, None, None]
    layer, k = np.arange(SHAPE[0])[None, :, None], np.arange(SHAPE[1])[None, None, :]
    return ((p * 3 + t * (5 + 2 * layer) + k) % EXPERTS).astype(np.uint8)


def _run(pool, prompts, n, max_new, max_tokens, ahead, record=True, max_seqs=8):
    """Generates with a fake model (recording experts unless not ``record``), prefix cache on; (scheduler,
    finished sequences). ``ahead``: each step's tokens and ids are recorded after the next step is planned
    and advanced, as the engine's overlapped loop does (tests/test_rollout_scheduler.py has the same loop
    without ids)."""
    sched = Scheduler(pool, PAGE, max_seqs, max_tokens, pages_for(64, PAGE), set(), prefix_cache=True,
                      record_experts=record)
    seqs = [Sequence(i * n + j, i, list(p), seed=7 * i + 20 * j, max_new=max_new)
            for i, p in enumerate(prompts) for j in range(n)]
    for i in range(len(prompts)):
        sched.add_group(seqs[i * n:(i + 1) * n])
    outputs = np.zeros(2 * PREFILL_ROWS, dtype=np.int64)  # the device's: decode rows, then prefill rows

    def launch(plan):  # the step's tokens and expert ids, its tokens left in the device's output rows
        fed = plan.input_ids.copy()
        if plan.src_rows is not None:
            fed = np.where(plan.src_rows >= 0, outputs[np.maximum(plan.src_rows, 0)], fed)
        toks = (plan.seeds + plan.offsets) % 50 + 10
        base = 0 if plan.decode else PREFILL_ROWS
        outputs[base:base + len(toks)] = toks
        experts = StepExperts(plan, pool.experts) if record else None
        return (plan, toks, np.zeros(len(toks), dtype=np.float32)), experts, fake_ids(plan.positions, fed), base

    def files(experts, ids):
        if experts is not None:
            experts.record(ids)

    def recorded(step):
        (plan, toks, lps), experts, ids, _ = step
        files(experts, ids)
        sched.record(plan, toks, lps)

    pending = None
    while True:
        if pending is not None and not sched.can_plan_ahead():
            refill = sched.plan_prefill() if ahead else None
            if refill is not None:
                step = launch(refill)
                sched.advance(refill, on_device=True, row_base=step[3])
                recorded(pending)
                pending = step
                continue
            recorded(pending)
            pending = None
        if not sched.has_work():
            break
        step = launch(sched.next_step())
        if ahead:
            sched.advance(step[0][0], on_device=True, row_base=step[3])
            if pending is not None:
                recorded(pending)
            pending = step
        else:
            (plan, toks, lps), experts, ids, _ = step
            files(experts, ids)
            sched.commit(plan, toks, lps)
    if pending is not None:
        recorded(pending)
    return sched, sorted(sched.done, key=lambda s: s.rid)


def _assert_cold_record(seq) -> None:
    """``seq``'s record is what a cold prefill and its decode compute: fake_ids at every position."""
    response, prompt = sequence_expert_ids(seq)
    tokens = np.array(seq.tokens)
    p = len(seq.prompt)
    np.testing.assert_array_equal(prompt, fake_ids(np.arange(p - 1), tokens[:p - 1]))
    np.testing.assert_array_equal(response, fake_ids(np.arange(p - 1, len(tokens) - 1), tokens[p - 1:-1]))


def _two_calls(ahead: bool, record: bool):
    """Call 1: prompt A (12 tokens, the whole 12-token budget of a step), B = A's first 10 tokens + 3 and
    C = A's first 9 + 6 (each can take A's first 2 pages), 2 samples each; call 2 on the same pool: each
    sequence of call 1 + 5 tokens (its full pages of call 1 cached, decode-written ones included).
    (reused tokens per call, finished sequences per call)."""
    pool = PagePool(64)
    pool.keep_experts(PAGE, SHAPE, np.uint8)
    a = list(range(30, 42))
    sched1, first = _run(pool, [a, a[:10] + [5, 6, 7], a[:9] + [8] * 6], 2, 6, 12, ahead, record)
    turn2 = [s.tokens + [11, 12, 13, 14, 15] for s in first]
    sched2, second = _run(pool, turn2, 1, 4, 12, ahead, record)
    assert not sched2._ids_due  # every page registered in the call has its ids by its end
    return (sched1.reused_tokens, sched2.reused_tokens), first + second


@pytest.mark.parametrize("ahead", [False, True], ids=["stepwise", "ahead"])
def test_reused_pages_bring_the_ids_their_forward_recorded(ahead):
    """Every record equals a cold prefill's; the cache reuses as much as without recording, but for B's
    first 2 pages when launched ahead: B's prefill is planned before A's (its first step) is recorded,
    so it computes them itself (reusing them, it would read unrecorded marks)."""
    reused, seqs = _two_calls(ahead, record=True)
    for seq in seqs:
        _assert_cold_record(seq)
    plain, _ = _two_calls(ahead, record=False)
    assert reused == ((plain[0] - 8, plain[1]) if ahead else plain)
    assert plain == ((16, 96) if ahead else (16, 104))  # ahead: a sequence at its length limit retires with
    #                                                     its last fed token pending, its last page unregistered


@pytest.mark.parametrize("ahead", [False, True], ids=["stepwise", "ahead"])
def test_only_pages_with_tokens_of_unrecorded_steps_wait(ahead):
    """One slot: X (4 prompt tokens, 9 new: 10, 11, .. 18 from seed 0) ends at its length limit and
    registers its decode-written full pages; Y, its first 12 tokens + 1, is admitted next and reuses
    them, as much as without recording (step by step: every prompt position but the last, P - 1 = 12). Launched ahead, X ends when the step feeding position 11 is
    advanced, before the two steps feeding positions 10 and 11 are recorded (page 2 is not registered:
    its last token is pending); page 1 (positions 4..7) was registered then too, but its ids are
    written, so Y reuses it (waiting for the last step advanced, as for page 2's ids, it would not)."""
    x = [1, 2, 3, 4]
    y = x + list(range(10, 18)) + [5]
    for record in (True, False):
        pool = PagePool(16)
        pool.keep_experts(PAGE, SHAPE, np.uint8)
        sched, seqs = _run(pool, [x, y], 1, 9, 64, ahead, record, max_seqs=1)
        assert seqs[0].generated == list(range(10, 19))
        assert sched.reused_tokens == (8 if ahead else 12)
        for seq in seqs if record else ():
            _assert_cold_record(seq)


def test_pages_leaving_the_cache_drop_their_ids():
    """Eviction sets an evicted page's rows back to the unrecorded mark, ``forget`` and ``reset`` every
    cached page's (ids are read from cached pages only); a page in ``unless`` is not taken by ``lookup``."""
    pool = PagePool(4)  # pages 1..3
    pool.keep_experts(PAGE, SHAPE, np.uint8)
    pages = pool.alloc(3)
    rows = np.arange(3 * PAGE)
    pool.experts.write(np.array(pages).repeat(PAGE) * PAGE + rows % PAGE, fake_ids(rows, rows))
    keys = prefix_keys(list(range(2 * PAGE)), PAGE, 2)
    assert pool.register(pages[0], keys[0]) and pool.register(pages[1], keys[1])
    assert not pool.register(pages[2], keys[1])  # a key cached already: nothing changes
    pool.release(pages)
    assert pool.lookup(keys[0], unless={pages[0]}) is None and pool.refs[pages[0]] == 0
    mark = pool.experts.mark
    assert (pool.experts.rows[pages] != mark).all()
    assert pool.alloc(2) == [pages[2], pages[0]]  # the free page, then the oldest idle one, evicted
    assert (pool.experts.rows[pages[0]] == mark).all() and (pool.experts.rows[pages[1]] != mark).all()
    assert pool.lookup(keys[0]) is None and pool.lookup(keys[1]) == pages[1]
    np.testing.assert_array_equal(pool.experts.read([pages[1]], PAGE), fake_ids(rows[PAGE:8], rows[PAGE:8]))
    pool.forget()
    assert (pool.experts.rows[pages[1]] == mark).all() and (pool.experts.rows[pages[2]] != mark).all()
    assert pool.lookup(keys[1]) is None
    pool.register(pages[2], keys[1])
    pool.reset()
    assert (pool.experts.rows == mark).all() and pool.lookup(keys[1]) is None


# -- the engine ----------------------------------------------------------------------------------
def _engine(actor, groups, cached: bool, graphs: bool):
    from megarl.rollout.graphs import DecodeGraphs
    from megarl.rollout.native import EngineOptions, NativeEngine
    from megarl.rollout.prefill_graphs import PrefillGraphs

    options = EngineOptions(max_batch=4, page_size=8, max_num_batched_tokens=16, kv_cache_gb=0.002,
                            record_experts=True, prefix_cache=cached)
    engine = NativeEngine(actor.module, groups, actor.info.vocab_size, [], 0, options)
    if graphs:
        engine.graphs = DecodeGraphs(engine, options.max_batch, capture=False)
        engine.prefill_graphs = PrefillGraphs(engine, engine.graphs, capture=False)
    return engine


def _results(results) -> dict:
    return {"tokens": [r.response_ids for r in results], "logprobs": [r.logprobs for r in results],
            "experts": [r.expert_ids for r in results], "prompt_experts": [r.prompt_expert_ids for r in results]}


def _conversation(rank, ckpt):
    import torch
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.config import Config
    from megarl.distributed import build_parallel_groups, init_distributed
    from megarl.roles.build import build_actor
    from megarl.rollout.engine import SamplingParams, sample_requests

    init_distributed()
    groups = build_parallel_groups(1, 1)
    model_parallel_cuda_manual_seed(0)
    cfg = Config()
    cfg.model.path = ckpt
    actor = build_actor(cfg, groups, optimizer_steps=1)
    shared = list(range(30, 47))  # two prompts that start with the same 17 tokens
    turn1 = [shared + [5, 6], shared + [7], list(range(60, 75))]
    params = SamplingParams(temperature=0.9)
    out, engines = {}, {}
    for graphs in (False, True):
        for cached in (False, True):
            engine = engines[(graphs, cached)] = _engine(actor, groups, cached, graphs)
            first = engine.generate(sample_requests(turn1, 2, 10, 9), params)
            hits = [engine.stats["rollout/prefix_cached_tokens"]]
            turn2 = [r.prompt_ids + r.response_ids + [11, 12, 13] for r in first]
            second = engine.generate(sample_requests(turn2, 1, 50, 6), params)
            hits.append(engine.stats["rollout/prefix_cached_tokens"])
            out[(graphs, cached)] = {"turn1": _results(first), "turn2": _results(second), "hits": hits,
                                     "stats": dict(engine.stats), "turn2_prompts": turn2}
    with torch.no_grad():  # new weights: the routers move (the engine reads them in place)
        gen = torch.Generator().manual_seed(3)
        for name, p in actor.module.named_parameters():
            if "router" in name:
                p.add_(0.5 * torch.randn(p.shape, generator=gen))
    warm = engines[(False, True)]  # its cache holds turn 2's pages, computed with the old weights
    pool = warm.cache.pool
    cached = [len(pool._key_of), int((pool.experts.rows[list(pool._key_of)] != pool.experts.mark).sum())]
    warm.update_weights()
    cached += [len(pool._key_of), int((pool.experts.rows[list(pool._key_of)] != pool.experts.mark).sum())]
    requests = sample_requests(out[(False, True)]["turn2_prompts"], 1, 50, 6)
    out["synced"] = {"warm": _results(warm.generate(requests, params)),
                     "cold": _results(_engine(actor, groups, False, False).generate(requests, params)),
                     "hits": warm.stats["rollout/prefix_cached_tokens"], "cached": cached}
    out["cut_short"] = _cut_short_call(warm, requests, params)
    out["cut_short"]["cold"] = out["synced"]["cold"]
    return out


def _cut_short_call(engine, requests, params) -> dict:
    """A call whose third step raises, then the same requests again on the same engine."""
    def failing_runner(rows, longest, make=engine._runner):
        runner, steps = make(rows, longest), []
        run = runner.run

        def run_until_third(plan):
            steps.append(plan)
            if len(steps) == 3:
                raise RuntimeError("injected failure")
            return run(plan)
        runner.run = run_until_third
        return runner

    engine._runner = failing_runner
    try:
        engine.generate(requests, params)
        raised = False
    except RuntimeError:
        raised = True
    del engine._runner  # the class's again
    pool = engine.cache.pool
    state = {"raised": raised, "cached": len(pool._key_of), "held": int(pool.refs[1:].sum())}
    return {**state, "again": _results(engine.generate(requests, params))}


@pytest.fixture(scope="module")
def conversation(ckpt):
    return spawn(_conversation, 1, ckpt)[0]


def _assert_same(warm: dict, cold: dict) -> None:
    """Tokens, response and prompt ids bitwise, log-probs within 1e-5."""
    assert warm["tokens"] == cold["tokens"]
    for got, want in zip(warm["logprobs"], cold["logprobs"]):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    for key in ("experts", "prompt_experts"):
        for got, want in zip(warm[key], cold[key]):
            assert got.dtype == np.uint8 and (got < 4).all()  # recorded everywhere: no unrecorded mark
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_conversation_with_the_prefix_cache_records_what_a_cold_engine_records(conversation, graphs):
    warm, cold = conversation[(graphs, True)], conversation[(graphs, False)]
    # turn 1: the second prompt takes the first's 2 full pages (its samples fork them) — eagerly; launched
    # ahead, its prefill is planned before the first prompt's first chunk is recorded, so it computes them
    # (with them, it would read unrecorded marks). Turn 2: each of the 6 conversations takes its full pages
    # of turn 1 — 3 of the first 4 (27 or 28 tokens), 2 of the last 2 (24 tokens, the last one never fed)
    assert warm["hits"] == [0 if graphs else 16, 4 * 24 + 2 * 16] and cold["hits"] == [0, 0]
    if graphs:
        assert warm["stats"]["rollout/planned_ahead_steps"] > 0 and warm["stats"]["rollout/graph_steps"] > 0
    for turn in ("turn1", "turn2"):
        _assert_same(warm[turn], cold[turn])


def test_weight_update_drops_the_cached_pages_and_their_ids(conversation):
    """``update_weights`` empties the prefix cache (pages and ids); turn 2's prompts again, under the new
    weights: only pages this call computes are reused (4 conversations share 17 tokens: 3 x 2 pages;
    the last 2 share 8 tokens: 1 page), and every id is the new weights' (a cold engine's)."""
    synced = conversation["synced"]
    before = conversation[(False, True)]["turn2"]["prompt_experts"]
    pages, recorded, pages_after, recorded_after = synced["cached"]
    assert pages > 0 and recorded == pages * 8 * 2 * 2 and pages_after == recorded_after == 0
    assert synced["hits"] == 3 * 16 + 8
    _assert_same(synced["warm"], synced["cold"])
    assert any((got != old).any() for got, old in zip(synced["warm"]["prompt_experts"], before))


def test_a_call_cut_short_leaves_no_held_or_cached_pages(conversation):
    """An error mid-call: the next call starts on a fresh pool (no page still held by the cut call's
    sequences, nothing cached whose K/V or ids its steps may not have written) and samples as a cold engine."""
    cut = conversation["cut_short"]
    assert cut["raised"] and cut["cached"] == 0 and cut["held"] == 0
    _assert_same(cut["again"], cut["cold"])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from megarl.models.tiny import make_tiny_checkpoint

    path = str(tmp_path_factory.mktemp("prefix_experts"))
    make_tiny_checkpoint(path, "Qwen3MoeForCausalLM", seed=17)
    return path
