"""Scheduler and page pool without a model: fork sharing, copy-on-write, preemption, accounting.

A fake "model" samples token ``(seed + offset) % 50 + 10`` (never a stop token
unless asked), so every property below is exact: a prompt's ``n`` samples are
prefilled once and share its pages; the shared partial page is copied once per
sample but the last; a pool too small for every sequence preempts and
recomputes instead of failing; at the end every page is free again and each
response depends only on its seed.
"""
import numpy as np
import pytest

from megarl.rollout.pages import OutOfPages, PagePool, pages_for
from megarl.rollout.scheduler import Scheduler, Sequence

PAGE = 4
PREFILL_ROWS = 64  # where the fake device's prefill output rows start


def _fake_tokens(plan):
    return (plan.seeds + plan.offsets) % 50 + 10


def _run(prompts, n, max_new, pages, max_seqs=8, max_tokens=64, stop=(), pool=None, prefix_cache=False,
         ahead=False, mixed=False):
    """Generates with the fake model; (scheduler, pool, plans, finished sequences in order).

    ``ahead``: the engine's overlapped loop — a step's tokens are recorded only after the next
    step is planned: a step's pending inputs name rows of the device's outputs (decode rows
    first, then the last prefill's from ``PREFILL_ROWS``; a step reads them before it writes its
    own), and a due refill is planned before the pending step is recorded; every fed token is
    checked against the sequence's final tokens at the end.
    """
    pool = pool or PagePool(pages)
    sched = Scheduler(pool, PAGE, max_seqs, max_tokens, pages_for(64, PAGE), set(stop), prefix_cache, mixed)
    seqs = [Sequence(i * n + j, i, list(p), seed=7 * i + 20 * j, max_new=max_new)
            for i, p in enumerate(prompts) for j in range(n)]
    for i in range(len(prompts)):
        sched.add_group(seqs[i * n:(i + 1) * n])
    plans, fed, pending = [], [], None
    outputs = np.zeros(2 * PREFILL_ROWS, dtype=np.int64)  # the device's: decode rows, then prefill rows

    def launch(plan):  # returns the step's tokens, leaving them in the device's output rows
        plans.append(plan)
        toks = _fake_tokens(plan)
        ids = plan.input_ids.copy()  # what the device would feed
        if plan.src_rows is not None and (plan.src_rows >= 0).any():
            ids = np.where(plan.src_rows >= 0, outputs[np.maximum(plan.src_rows, 0)], ids)
        owners = [s for s, q in zip(plan.seqs, np.diff(plan.cu_seqlens_q)) for _ in range(q)]  # (T,)
        fed.extend((s, int(p), int(t)) for s, p, t in zip(owners, plan.positions, ids))
        base = 0 if plan.decode else PREFILL_ROWS
        outputs[base:base + len(toks)] = toks
        return (plan, toks, np.zeros(len(toks), dtype=np.float32)), base

    while True:
        if pending is not None and not sched.can_plan_ahead():
            refill = sched.plan_prefill() if ahead else None
            if refill is not None:
                step, base = launch(refill)
                sched.advance(refill, on_device=True, row_base=base)
                sched.record(*pending)
                pending = step
                continue
            sched.record(*pending)
            pending = None
        if not sched.has_work():
            break
        step, base = launch(sched.next_step())
        if ahead:
            sched.advance(step[0], on_device=True, row_base=base)
            if pending is not None:
                sched.record(*pending)
            pending = step
        else:
            sched.commit(*step)
    if pending is not None:
        sched.record(*pending)
    for seq, pos, tok in fed:
        assert pos >= len(seq.tokens) or seq.tokens[pos] == tok  # (past the end: a row after a stop)
    return sched, pool, plans, sorted(sched.done, key=lambda s: s.rid)


def _expected(seq, max_new):
    return [(seq.seed + k) % 50 + 10 for k in range(max_new)]


def test_prefix_is_prefilled_once_and_partial_page_copied_on_write():
    """Prompt of 6 tokens (pages: one full, one partial) and n = 4 samples.

    Prefill feeds 6 tokens once (not 24); the first decode writes position 6 in
    the shared partial page, so 3 of the 4 samples copy it (the last keeps it).
    """
    sched, pool, plans, done = _run([[1, 2, 3, 4, 5, 6]], n=4, max_new=5, pages=32)
    prefill = [p for p in plans if not p.decode]
    assert sum(len(p.input_ids) for p in prefill) == 6
    assert len(prefill[0].sampled) == 4  # one forward row sampled for all four
    first_decode = next(p for p in plans if p.decode)
    assert len(first_decode.copies[0]) == 3
    assert all(s.generated == _expected(s, 5) for s in done)
    assert pool.free == 31  # everything back (page 0 is scratch)


@pytest.mark.parametrize("mixed", [False, True])
def test_small_pool_preempts_and_results_do_not_change(mixed):
    """6 prompts x 2 samples of up to 12 tokens with room for ~3 sequences: preemption, same tokens."""
    prompts = [[7] * (3 + i) for i in range(6)]
    sched, pool, _, done = _run(prompts, n=2, max_new=12, pages=12, max_seqs=4, max_tokens=8, mixed=mixed)
    big_sched, _, _, big_done = _run(prompts, n=2, max_new=12, pages=200, max_seqs=16)
    assert sched.preemptions > 0 and big_sched.preemptions == 0
    assert [s.generated for s in done] == [s.generated for s in big_done]
    assert all(s.generated == _expected(s, 12) for s in done)
    assert pool.free == 11


@pytest.mark.parametrize("mixed", [False, True])
def test_chunked_prefill_respects_the_token_budget(mixed):
    """Decode rows of a mixed step count against the budget too."""
    sched, _, plans, done = _run([[3] * 21, [4] * 5], n=1, max_new=2, pages=40, max_tokens=8, mixed=mixed)
    assert all(len(p.input_ids) <= 8 for p in plans if not p.decode)
    assert sum(len(p.input_ids) - p.decoding for p in plans if not p.decode) == 26
    assert any(p.decoding for p in plans) == mixed
    assert [len(s.generated) for s in done] == [2, 2]


def test_stop_tokens_end_sequences_and_free_slots():
    """Seeds chosen so sample 0 stops at its 2nd token: finish 'stop', the others run to length."""
    stop = (0 + 1) % 50 + 10  # the token of (seed 0, offset 1); no other sample meets it
    _, pool, _, done = _run([[1, 2], [3]], n=2, max_new=6, pages=20, stop=[stop])
    assert done[0].finish == "stop" and done[0].generated == [10, stop]
    assert [s.finish for s in done[1:]] == ["length"] * 3
    assert pool.free == 19


@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("max_seqs,pages", [(3, 40), (4, 7)])
def test_planning_ahead_gives_the_same_responses(max_seqs, pages, mixed):
    """The overlapped loop (tokens recorded a step late, fed from the device meanwhile) against
    the step-by-step one: stop tokens at varied steps, more requests than slots, and (7 pages) a
    pool tight enough to preempt; same responses, finish reasons, and every page back. Mixed:
    refills planned ahead decode the running sequences too, their tokens still pending."""
    prompts = [[1, 2], [3], [4, 5, 6], [7] * 9, [8, 9]]
    stops = [(7 * i + 20 * j + k) % 50 + 10 for i, j, k in ((0, 0, 2), (2, 1, 4), (3, 0, 0))]
    runs = [_run(prompts, n=2, max_new=7, pages=pages, max_seqs=max_seqs, stop=stops, ahead=a, mixed=mixed and a)
            for a in (False, True)]
    (_, pool_a, _, sync), (sched_b, pool_b, plans_b, ahead) = runs
    assert any(p.decode and (p.src_rows >= 0).any() for p in plans_b)  # some steps were planned ahead
    assert any(p.decode and (p.src_rows >= PREFILL_ROWS).any() for p in plans_b)  # fed by a pending prefill
    if mixed:  # a refill's decode rows fed from a pending decode
        assert any(p.decoding and (p.src_rows[:p.decoding] >= 0).any() for p in plans_b)
    assert (sched_b.preemptions > 0) == (pages == 7)
    assert [(s.generated, s.finish) for s in ahead] == [(s.generated, s.finish) for s in sync]
    assert {s.finish for s in sync} == {"stop", "length"}
    assert pool_b.free == pool_a.free == pages - 1
    assert sched_b.running == [] and not sched_b.waiting


def test_pool_refuses_what_it_does_not_have():
    pool = PagePool(3)  # page 0 is scratch: two to hand out
    pool.alloc(2)
    with pytest.raises(OutOfPages, match="asked for 1 pages, 0 free"):
        pool.alloc(1)


@pytest.mark.parametrize("mixed", [False, True])
def test_long_prompt_chunked_beside_decoding_sequences_in_a_tight_pool(mixed):
    """Three short prompts decode while a 40-token prompt is prefilled in 8-token chunks, in a
    pool of 13 pages (the long one alone needs 7 with its response, every sample together ~20).
    Decode runs out of pages while the long prompt is half prefilled: that prompt gives its
    pages back first (and is recomputed later), then decoding sequences are preempted; every
    response is still its seed's and every page comes back. (Mixed, the decode goes on during the
    chunks, and one preemption is enough.)"""
    prompts = [[6] * 3, [7] * 5, [8] * 2, [5] * 40]
    sched, pool, _, done = _run(prompts, n=2, max_new=10, pages=14, max_seqs=4, max_tokens=8, mixed=mixed)
    assert sched.preemptions >= (1 if mixed else 2)
    assert all(s.generated == _expected(s, 10) for s in done) and len(done) == 8
    assert pool.free == 13


def test_prefix_cache_reuses_earlier_pages_and_drops_them_on_forget():
    """Turn 2 of a conversation (turn 1's prompt + response + 5 new tokens) with the pool of
    turn 1 kept: its full pages of turn-1 tokens come from the cache, so prefill feeds only
    the rest; a page nobody holds stays cached but counts as free; forget() drops the cache."""
    pool = PagePool(40)
    _, _, first = _run_on(pool, [[3] * 9], max_new=8)  # 16 tokens computed at the end: 4 full pages
    assert pool.free == 39  # cached pages are idle, hence free
    turn2 = first[0].tokens + [9] * 5  # 22 tokens
    sched, plans, done = _run_on(pool, [turn2], max_new=3)
    assert sched.reused_tokens == 16
    assert sum(len(p.input_ids) for p in plans if not p.decode) == 22 - 16
    assert done[0].generated == _expected(done[0], 3)
    pool.forget()
    sched, _, _ = _run_on(pool, [turn2], max_new=3)
    assert sched.reused_tokens == 0


def test_mixed_steps_decode_while_a_long_prompt_is_chunked():
    """Two short prompts decode while a 40-token prompt is prefilled in chunks of 8 new tokens: every
    chunk after the first carries a decode row of each running sequence (inside the budget), so the
    short ones finish steps earlier than when the chunks stop their decode, with the same responses."""
    prompts = [[6] * 3, [7] * 2, [5] * 40]
    runs = {m: _run(prompts, n=1, max_new=12, pages=40, max_seqs=4, max_tokens=8, mixed=m) for m in (False, True)}
    (_, _, plain_plans, plain), (sched, pool, plans, done) = runs[False], runs[True]
    chunks = [p for p in plans if not p.decode and p.seqs[-1].prompt == prompts[2]]
    assert [p.decoding for p in chunks] == [0] + [2] * (len(chunks) - 1)  # the first is the 3 prompts at once
    assert all(len(p.input_ids) <= 8 for p in chunks)
    assert all(len(p.sampled) >= p.decoding for p in chunks)
    def finished_at(plans, rid):
        return max(i for i, p in enumerate(plans) if any(s.rid == rid for s in p.sampled))

    plain_chunks = [p for p in plain_plans if not p.decode]  # each after the first stops the decode for a step
    assert finished_at(plans, 0) + len(plain_chunks) - 1 == finished_at(plain_plans, 0) == 16
    assert [s.generated for s in done] == [s.generated for s in plain] == [_expected(s, 12) for s in done]
    assert pool.free == 39 and not sched.running


def _run_on(pool, prompts, max_new):
    """One prompt per group on ``pool``, prefix cache on: (scheduler, plans, finished sequences)."""
    sched, _, plans, done = _run(prompts, 1, max_new, 0, pool=pool, prefix_cache=True)
    return sched, plans, done


def test_a_mixed_step_planned_ahead_is_held_to_the_graphs_tokens():
    """``plan_prefill(mixed_max_tokens)``: a mixed step (running rows + prompt) keeps under the cap, which
    the engine sets to its prefill graphs' size; a prefill with nothing running, or one whose prompts
    would not fit the cap (a wave of refills), is unmixed at the full budget."""
    sched = Scheduler(PagePool(100), PAGE, 8, 64, pages_for(64, PAGE), set(), mixed=True)
    sched.add_group([Sequence(0, 0, [3] * 40, 0, 5)])
    first = sched.plan_prefill(16)
    assert first.decoding == 0 and len(first.input_ids) == 40
    sched.commit(first, np.array([11]), np.zeros(1, dtype=np.float32))
    sched.add_group([Sequence(1, 1, [4] * 40, 1, 5)])
    mixed = sched.plan_prefill(48)
    assert mixed.decoding == 1 and len(mixed.input_ids) == 41 and mixed.input_ids[0] == 11
    sched.commit(mixed, np.array([12, 13]), np.zeros(2, dtype=np.float32))
    sched.add_group([Sequence(2, 2, [5] * 60, 2, 5)])  # more than the cap: one unmixed step at the budget
    large = sched.plan_prefill(48)
    assert large.decoding == 0 and len(large.input_ids) == 60


@pytest.mark.parametrize("ahead", [False, True])
def test_waves_of_fixed_length_requests_stay_in_step(ahead):
    """4 waves of 8 prompts (8 tokens each) on 8 slots, a 32-token budget: a wave takes two unmixed
    prefills of 4 whole prompts, never a mixed step that cuts the last prompt to make room for the 4
    running rows (that start a step later would outlive the other sequences and end the run with one
    decoding alone), so every decode step is full and the run takes waves x (max_new - 1) of them."""
    prompts = [[3 + i] * 8 for i in range(32)]
    sched, pool, plans, done = _run(prompts, n=1, max_new=10, pages=80, max_seqs=8, max_tokens=32, ahead=ahead,
                                    mixed=True)
    decodes = [p for p in plans if p.decode]
    assert [len(p.seqs) for p in decodes] == [8] * (4 * 9)
    assert [len(p.input_ids) for p in plans if not p.decode] == [32] * 8
    assert [s.generated for s in done] == [_expected(s, 10) for s in done]
    assert pool.free == 79 and not sched.running  # all but the scratch page
