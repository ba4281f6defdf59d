"""``serve`` at expert parallelism across DP: a rank waiting for follow-ups keeps serving its EP group.

A tiny random fp32 Qwen3-MoE (4 experts, top-2) at EP2 across DP2 (2 processes, each rank 2 experts
and its own requests; every MoE layer exchanges rows, so the ranks step in lockstep). Rank 0 serves
one short request whose follow-up (an agent's next turn, a tool's result) only becomes ready once
rank 1 has finished its own long requests; rank 1's feed writes that flag when its last request is
done. Rank 0 is idle meanwhile: were it to block in ``poll(idle=True)``, rank 1 could not take a
step (its MoE layers need rank 0's experts) and neither would ever finish. With the feed's
``pending()`` rank 0 agrees along with rank 1's steps while it waits (idle steps: its experts serve
rank 1's rows), rank 1 finishes, rank 0's follow-up runs (now rank 1 serves it), and both end. Checked,
with and without the decode graphs' buffers (uncaptured): every result as ``generate`` gives it for
the same requests (a request's tokens depend on its prompt, seed and the weights only), and rank 0
had run idle group steps while it waited. A stalled rank fails in ``poll`` after 60 s.
"""
import os
import time

import pytest

from dist_helpers import spawn

MAX_NEW = {0: 2, 1: 12}
FOLLOW_UP_KEY = 10


class LateFollowUp:
    """Rank 0's caller: one follow-up request, ready once ``flag`` exists."""

    def __init__(self, flag: str, follow_up):
        self.flag, self.follow_up, self.sent, self.results = flag, follow_up, False, {}

    def finished(self, key, result):
        self.results[key] = result

    def pending(self) -> bool:
        return not self.sent

    def poll(self, idle):
        deadline = time.monotonic() + 60
        while not self.sent and not os.path.exists(self.flag):
            if not idle:
                return []
            if time.monotonic() > deadline:
                raise TimeoutError("rank 0 waited 60 s for a follow-up that rank 1 could not unblock")
            time.sleep(0.01)
        if self.sent:
            return []
        self.sent = True
        return [self.follow_up]


class FlagWhenDone:
    """Rank 1's caller: no follow-ups; writes ``flag`` when its ``count`` requests are done."""

    def __init__(self, flag: str, count: int):
        self.flag, self.count, self.results = flag, count, {}

    def finished(self, key, result):
        self.results[key] = result
        if len(self.results) == self.count:
            open(self.flag, "w").close()

    def pending(self) -> bool:
        return False

    def poll(self, idle):
        return []


def _job(rank, ckpt, flag_dir):
    from megarl.distributed import init_distributed
    from megarl.rollout.engine import Request, SamplingParams, sample_requests
    from test_rollout_moe_ep_graphs import _engine
    from test_rollout_moe_tp import _actor

    init_distributed()
    actor, groups = _actor(ckpt, 1, 2, 1)
    dp = groups.dp_rank
    params = SamplingParams(temperature=0.8)
    prompts = [[7, 8, 9, 10]] if dp == 0 else [[40, 41, 42], list(range(20, 29))]
    requests = sample_requests(prompts, 1, 5, MAX_NEW[dp])
    follow_up = Request(FOLLOW_UP_KEY, [7, 8, 9, 10, 11, 12], 77, 6)
    out = {"dp": dp}
    for name in ("eager", "graphs"):
        flag = os.path.join(flag_dir, f"{name}_rank1_done")
        engine = _engine(actor, groups, graphs=name == "graphs")
        idle_steps = []
        if dp == 0:
            step = engine.serve_group_step
            engine.serve_group_step = lambda waiting: idle_steps.append(waiting) or step(waiting)
        feed = LateFollowUp(flag, follow_up) if dp == 0 else FlagWhenDone(flag, len(requests))
        engine.serve(requests, params, feed, reserve=(1, 16))  # room for the follow-up
        served = {k: (r.response_ids, r.logprobs) for k, r in feed.results.items()}
        wanted = requests + ([follow_up] if dp == 0 else [])
        alone = {r.key: (r.response_ids, r.logprobs) for r in engine.generate(wanted, params)}
        out[name] = {"served": served, "alone": alone, "waiting_steps": sum(idle_steps)}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from megarl.models.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("ep_serve")
    make_tiny_checkpoint(str(root / "qwen3moe"), "Qwen3MoeForCausalLM", seed=41)
    return spawn(_job, 2, str(root / "qwen3moe"), str(root))


@pytest.mark.parametrize("path", ["eager", "graphs"])
def test_a_rank_waiting_for_follow_ups_serves_the_group(runs, path):
    for r in runs:
        got = r[path]
        assert set(got["served"]) == set(got["alone"])
        for key, (ids, logprobs) in got["served"].items():
            want_ids, want_logprobs = got["alone"][key]
            assert ids == want_ids
            assert logprobs == pytest.approx(want_logprobs, abs=1e-5)  # other batches: other GEMM row counts
        if r["dp"] == 0:
            assert FOLLOW_UP_KEY in got["served"] and len(got["served"][FOLLOW_UP_KEY][0]) == 6
            assert got["waiting_steps"] > 0  # idle group steps while it waited
