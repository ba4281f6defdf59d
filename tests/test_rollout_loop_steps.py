"""The engine's step loop (`StepLoop`) with a fake device: how many steps of what size.

The device is replaced by a stand-in that samples token ``(seed + offset) % 50 + 10`` (as in
test_rollout_scheduler.py) and treats every decode step as a graph launch and a prefill as one when
it fits the (scaled-down) prefill-graph cap, so the plan-ahead paths run as on a GPU. The
benchmark's fixed-length waves (``bench_rollout.py --ragged-waves``) scaled down: 16 slots, 128-token
prompts, a 1,024-token budget (a wave is two prefills), a 512-token graph cap (a refill of 3 prompts
and the running rows fits, a wave does not). On a GPU this loop produced the same step counts as the
engine (session 16: 4,597 decode steps, 18 prefills at 128 slots), which is how a run that ended
with one request decoding alone was found.
"""
import numpy as np
import pytest

from megarl.rollout.loop import StepLoop
from megarl.rollout.pages import PagePool, pages_for
from megarl.rollout.runners import StepOutput, StepRunner
from megarl.rollout.scheduler import Scheduler, Sequence

SLOTS, PROMPT, PAGE, BUDGET, GRAPH_TOKENS = 16, 128, 16, 1024, 512


def _fake_tokens(plan):
    return (plan.seeds + plan.offsets) % 50 + 10


class _FakeGraphs(StepRunner):
    """Every decode step a graph launch, a prefill one when it fits GRAPH_TOKENS: launched ahead."""

    ahead_tokens = GRAPH_TOKENS

    def __init__(self):
        super().__init__(None, None)
        self.plans = []

    def runs_ahead(self, plan):
        return plan.decode or len(plan.input_ids) <= GRAPH_TOKENS

    def execute(self, plan):
        self.plans.append(plan)
        tokens = _fake_tokens(plan)
        return StepOutput(via_graph=True, tokens=tokens, logprobs=np.zeros(len(tokens), dtype=np.float32),
                          row_base=0 if plan.decode else SLOTS)


def _loop(limits, mixed):
    """Runs the loop over one request per limit; (plans in launch order, finished sequences by rid)."""
    runner = _FakeGraphs()
    max_pages = pages_for(PROMPT + max(limits), PAGE)
    sched = Scheduler(PagePool(SLOTS * max_pages + 8), PAGE, SLOTS, BUDGET, max_pages, set(), mixed=mixed)
    for i, n in enumerate(limits):
        sched.add_group([Sequence(i, i, [1 + i % 7] * PROMPT, seed=i, max_new=n)])
    StepLoop(sched, runner).run()
    return runner.plans, sorted(sched.done, key=lambda s: s.rid)


@pytest.mark.parametrize("mixed", [True, False])
def test_fixed_length_waves_keep_every_decode_step_full(mixed):
    """8 waves of 16 requests of 64 tokens: each wave is two whole-prompt prefills (none cut to make room
    for running rows), then 63 decode steps of all 16 slots: 8 x 63 in all, nothing decoding alone."""
    plans, done = _loop([64] * (8 * SLOTS), mixed)
    decodes = [len(p.seqs) for p in plans if p.decode]
    assert decodes == [SLOTS] * (8 * 63)
    assert [len(p.input_ids) for p in plans if not p.decode] == [BUDGET] * 16
    assert all(s.generated == [(s.seed + k) % 50 + 10 for k in range(64)] for s in done)


def test_ragged_refills_are_mixed_and_every_token_is_made():
    """Ragged lengths: each refill of a few prompts rides with the running rows (a mixed step under the
    graph cap), and every request gets exactly its tokens."""
    limits = np.random.default_rng(7).integers(4, 97, 8 * SLOTS).tolist()
    plans, done = _loop(limits, True)
    refills = [p for p in plans if not p.decode][2:]  # after the first wave's two prefills
    assert refills and all(p.decoding > 0 and len(p.input_ids) <= GRAPH_TOKENS for p in refills)
    assert [s.generated for s in done] == [[(s.seed + k) % 50 + 10 for k in range(n)] for s, n in zip(done, limits)]


def test_counters_count_every_step_once_under_the_engine_metric_names():
    """Ragged refills: each launched step is counted once by kind (every fake step is a graph step), and
    the counters come out under the names the engine has always logged."""
    limits = np.random.default_rng(3).integers(4, 40, 3 * SLOTS).tolist()
    runner = _FakeGraphs()
    max_pages = pages_for(PROMPT + max(limits), PAGE)
    sched = Scheduler(PagePool(SLOTS * max_pages + 8), PAGE, SLOTS, BUDGET, max_pages, set(), mixed=True)
    for i, n in enumerate(limits):
        sched.add_group([Sequence(i, i, [1 + i % 7] * PROMPT, seed=i, max_new=n)])
    m = StepLoop(sched, runner).run().metrics()
    decodes = [p for p in runner.plans if p.decode]
    prefills = [p for p in runner.plans if not p.decode]
    assert set(m) == {f"rollout/{k}" for k in ("prefill_steps", "decode_steps", "prefill_tokens", "graph_steps",
                                                "planned_ahead_steps", "prefill_graph_steps",
                                                "planned_ahead_prefills", "mixed_steps")} | {
        f"timing/rollout_{k}" for k in ("prefill", "device_wait", "loop", "host", "host_plan", "host_launch")}
    assert m["rollout/decode_steps"] == m["rollout/graph_steps"] == len(decodes) > 0
    assert m["rollout/prefill_steps"] == m["rollout/prefill_graph_steps"] == len(prefills) > 0
    assert m["rollout/prefill_tokens"] == sum(len(p.input_ids) - p.decoding for p in prefills) == PROMPT * len(limits)
    assert m["rollout/mixed_steps"] == sum(p.decoding > 0 for p in prefills) > 0
    assert 0 < m["rollout/planned_ahead_steps"] < len(decodes) and m["rollout/planned_ahead_prefills"] > 0
