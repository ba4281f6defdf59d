"""CompositeReward: weighted terms, shaping, fallbacks, the RM interface, the cache."""
import importlib
import math
import sys

import pytest
import torch

from megarl.rewards import CompositeReward, RewardCache, RewardModelTerm, RewardSample, RewardTerm, get_reward

USER_MODULE = '''
CALLS = []

def length_reward(prompt, response, ground_truth, extra, unit=1.0):
    CALLS.append(response)
    return len(response) * unit

def by_weight(prompt, response, ground_truth, extra):
    CALLS.append(response)
    return 3.0 * extra["weight"]

def flaky(prompt, response, ground_truth, extra):
    if response == "boom":
        raise RuntimeError("boom")
    return {"nan": float("nan"), "inf": float("inf"), "str": "high"}.get(response, 1.0)
'''


@pytest.fixture
def user(tmp_path, monkeypatch):
    """A user reward module written to tmp_path and imported by dotted path."""
    (tmp_path / "megarl_test_user_rewards.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "megarl_test_user_rewards"
    sys.modules.pop("megarl_test_user_rewards", None)


def samples(*responses, truth="5"):
    return [RewardSample("p", r, truth) for r in responses]


def test_format_plus_scaled_rm():
    """format (0/1, weight 1) + RM raw [-1, 0, 3] shaped by 2.5 x + 2.5 clipped to
    [0, 5] -> [0, 2.5, 5] (3 -> 10 -> 5), weight 1. Formats: 1, 0, 1.
    Totals [1, 2.5, 6]; means: format 2/3, rm 2.5, total 9.5/3."""
    rm = RewardModelTerm(scorer=lambda batch: torch.tensor([-1.0, 0.0, 3.0]), scale=2.5, shift=2.5, clip=(0, 5))
    out = CompositeReward([("format", 1.0)], rm=rm)(samples(r"\boxed{5}", "5", "#### 5"))
    assert out.total.tolist() == [1.0, 2.5, 6.0]
    assert out.terms["rm"].tolist() == [0.0, 2.5, 5.0]
    assert math.isclose(out.metrics["format/mean"], 2 / 3, rel_tol=1e-6)
    assert math.isclose(out.metrics["total/mean"], 9.5 / 3, rel_tol=1e-6)
    assert out.metrics["rm/failures"] == 0.0


def test_weights_and_kwargs(user):
    """math (weight 2) and the user's length_reward with unit 0.5 (weight 1):
    '#### 5' -> 2 * 1 + 0.5 * 6 = 5; '#### 4' -> 0 + 3 = 3."""
    terms = [("math", 2.0), (f"{user}:length_reward", 1.0, {"unit": 0.5})]
    out = CompositeReward(terms)(samples("#### 5", "#### 4"))
    assert out.total.tolist() == [5.0, 3.0]
    assert out.terms[f"{user}:length_reward"].tolist() == [3.0, 3.0]


def test_failures_fall_back_and_are_counted(user):
    """Raise, NaN, inf and a string each give the fallback -1 and one failure; 'ok' gives 1.
    Mean (4 * -1 + 1) / 5 = -0.6. A missing ground truth fails the math term."""
    term = RewardTerm(name=f"{user}:flaky", fallback=-1.0, label="flaky")
    out = CompositeReward([term])(samples("boom", "nan", "inf", "str", "ok"))
    assert out.total.tolist() == [-1.0, -1.0, -1.0, -1.0, 1.0]
    assert out.metrics["flaky/failures"] == 4.0
    assert math.isclose(out.metrics["flaky/mean"], -0.6, rel_tol=1e-6)
    out = CompositeReward([("math", 1.0)])([RewardSample("p", "#### 5", None)])
    assert out.metrics["math/failures"] == 1.0 and out.total.tolist() == [0.0]


def test_rm_failures():
    """Scorer raising: every sample gets the fallback 0.5; a NaN entry: that sample only;
    a wrong shape counts as a failure of all."""

    def boom(batch):
        raise RuntimeError("rm down")

    out = CompositeReward([], rm=RewardModelTerm(scorer=boom, fallback=0.5))(samples("a", "b"))
    assert out.total.tolist() == [0.5, 0.5] and out.metrics["rm/failures"] == 2.0
    rm = RewardModelTerm(scorer=lambda b: torch.tensor([1.0, float("nan")]), fallback=0.5)
    out = CompositeReward([], rm=rm)(samples("a", "b"))
    assert out.total.tolist() == [1.0, 0.5] and out.metrics["rm/failures"] == 1.0
    rm = RewardModelTerm(scorer=lambda b: torch.ones(3))
    assert CompositeReward([], rm=rm)(samples("a", "b")).metrics["rm/failures"] == 2.0


def test_rm_batch_is_passed_through():
    """With rm_batch given, the scorer sees it instead of the samples."""
    seen = []
    rm = RewardModelTerm(scorer=lambda b: (seen.append(b), torch.zeros(2))[1])
    CompositeReward([], rm=rm)(samples("a", "b"), rm_batch="token-ids")
    assert seen == ["token-ids"]


def test_cache_hits(user):
    """4 samples, 2 distinct. A miss is a distinct key whose value gets computed, every
    other lookup a hit. Rule term: runs twice (2 misses, 2 hits). RM term (cache=True):
    the 2 distinct samples are scored in one call (2 misses, 2 hits). Cache totals
    4 hits, 4 misses; a second call hits all 8."""
    mod = importlib.import_module(user)
    rm_seen = []
    rm = RewardModelTerm(scorer=lambda b: (rm_seen.append(len(b)), torch.ones(len(b)))[1], cache=True)
    term = RewardTerm(name=f"{user}:length_reward", weight=1.0, cache=True)  # a user function opts in
    reward = CompositeReward([term], rm=rm, cache=RewardCache(max_size=10))
    batch = samples("aa", "b", "aa", "b")
    out = reward(batch)
    assert out.total.tolist() == [3.0, 2.0, 3.0, 2.0]
    assert mod.CALLS == ["aa", "b"]
    assert (out.metrics["cache/hits"], out.metrics["cache/misses"]) == (4.0, 4.0)
    assert rm_seen == [2]
    out = reward(batch)
    assert (out.metrics["cache/hits"], out.metrics["cache/misses"]) == (8.0, 0.0)
    assert mod.CALLS == ["aa", "b"] and rm_seen == [2]


def test_cache_is_lru():
    """max_size 2: put a, b; touch a; put c -> b (least recently used) is evicted."""
    cache = RewardCache(max_size=2)
    ka, kb, kc = (RewardCache.key("t", "p", r, None) for r in "abc")
    cache.put(ka, 1.0)
    cache.put(kb, 2.0)
    assert cache.get(ka) == 1.0
    cache.put(kc, 3.0)
    assert cache.get(kb) is None and cache.get(kc) == 3.0 and len(cache) == 2
    assert cache.metrics()["hits"] == 2.0 and cache.metrics()["misses"] == 1.0
    assert RewardCache.key("t", "p", "r", None) != RewardCache.key("t", "p", "r", "")


def test_registry_errors():
    with pytest.raises(ValueError, match="unknown reward function 'nope'; available: format, math"):
        get_reward("nope")
    with pytest.raises(ValueError, match="unique"):
        CompositeReward([("format", 1.0), ("format", 2.0)])


def test_rows_differing_only_in_extra_get_their_own_rewards(user):
    """The duplicated-rows case: same prompt, response and answer, `extra` weight 1 or 0 ->
    rewards 3.0 and 0.0 (3 * weight), whether or not the term is cached; with the cache,
    the 2 distinct (row, extra) pairs are computed once each (2 misses, 2 hits)."""
    mod = importlib.import_module(user)
    rows = [RewardSample("p", "r", "5", {"weight": w, "tags": {"b", "a"}}) for w in (1, 0, 1, 0)]
    for cache_term in (True, None):
        mod.CALLS.clear()
        term = RewardTerm(name=f"{user}:by_weight", cache=cache_term)
        out = CompositeReward([term], cache=RewardCache(max_size=10))(rows)
        assert out.total.tolist() == [3.0, 0.0, 3.0, 0.0]
        if cache_term:
            assert (out.metrics["cache/hits"], out.metrics["cache/misses"]) == (2.0, 2.0) and len(mod.CALLS) == 2
        else:  # a user function is not cached unless it opts in: every row computed, no lookups
            assert (out.metrics["cache/hits"], out.metrics["cache/misses"]) == (0.0, 0.0) and len(mod.CALLS) == 4


def test_registered_rewards_are_cached_and_extra_keys_are_stable():
    """A registered term is cached by default; the key of `extra` does not depend on dict or
    set order, and tells 1 from 1.0 from "1" from a list [1] (a miss at worst, never a wrong hit)."""
    reward = CompositeReward([("format", 1.0)], cache=RewardCache(max_size=10))
    out = reward(samples("a", "a"))
    assert (out.metrics["cache/hits"], out.metrics["cache/misses"]) == (1.0, 1.0)
    key = lambda extra: RewardCache.key("t", "p", "r", "a", extra)  # noqa: E731
    assert key({"x": 1, "y": {"b", "a"}}) == key({"y": {"a", "b"}, "x": 1})
    assert len({key({"x": v}) for v in (1, 1.0, "1", [1], (1,), None)}) == 6
    assert key({}) != key(None) and key({1: "a", "1": "a"}) != key({"1": "a"})  # mixed key types sort too
