"""Named eval sets: the unbiased pass@k, mean@n, metrics by name or module:function, DP invariance.

A fake engine answers each request with a token fixed by its seed, so the
solved count of every prompt is known from the seeds alone; the test derives
the expected metrics by brute force (pass@k over every k-subset of the n
samples) rather than with the closed form. Not covered here: a real engine
(tests/test_eval_run.py runs one).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import replace
from types import SimpleNamespace

import pytest

from dist_helpers import spawn
from megarl.config import Config, EvalSet
from megarl.data.dataset import PromptDataset, PromptItem
from megarl.rollout.engine import GenerationResult, mix_seed
from megarl.trainer.eval_sets import evaluate_set, ks_of, pass_at_k

SEED = 11


def brute_pass_at_k(solved: list[bool], k: int) -> float:
    subsets = list(itertools.combinations(solved, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_is_the_subset_average(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            want = brute_pass_at_k([True] * c + [False] * (n - c), k)
            assert math.isclose(pass_at_k(n, c, k), want, rel_tol=1e-12, abs_tol=1e-15), (n, c, k)
    assert pass_at_k(4, 1, 2) == 0.5 and pass_at_k(10, 0, 10) == 0.0 and pass_at_k(3, 3, 1) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


class FakeEngine:
    """Answers '7' when the request's seed is even, else '8' (token id = the digit)."""

    def generate(self, requests, params):
        assert params.temperature == 0.7 and params.top_p == 0.9
        return [GenerationResult(list(r.prompt), [7 if r.seed % 2 == 0 else 8], [0.0], "stop", r.key)
                for r in reversed(requests)]  # any order: results carry their keys


class DigitTokenizer:
    def batch_decode(self, ids, skip_special_tokens=True):
        return ["".join(map(str, x)) for x in ids]


def dataset(num: int) -> PromptDataset:
    items = [PromptItem(i, [1, 2, i], f"p{i}", "7" if i % 3 else None, {"i": i}) for i in range(num)]
    return PromptDataset(items, {"kept": num})


def expected(spec, num: int) -> dict[str, float]:
    """Brute force from the seeds: prompt i's sample j is solved when mix_seed(mix_seed(SEED, i), j) is even
    (and the prompt has an answer: the 'math' metric raises without one, a failed sample scoring 0)."""
    passes = {k: 0.0 for k in ks_of(spec)}
    mean = failed = 0.0
    for i in range(num):
        solved = [i % 3 != 0 and mix_seed(mix_seed(SEED, i), j) % 2 == 0 for j in range(spec.n)]
        for k in passes:
            passes[k] += brute_pass_at_k(solved, k) / num
        mean += sum(solved) / spec.n / num
        failed += spec.n * (i % 3 == 0)
    out = {f"eval/{spec.name}/pass@{k}": v for k, v in passes.items()}
    out.update({f"eval/{spec.name}/mean@{spec.n}": mean, f"eval/{spec.name}/prompts": float(num),
                f"eval/{spec.name}/failed": failed})
    return out


SPEC = EvalSet(name="toy", path="unused", n=6, temperature=0.7, top_p=0.9, k=[1, 3, 6])


def test_metrics_on_one_rank_match_brute_force():
    groups = SimpleNamespace(dp_rank=0, dp_size=1)
    got = evaluate_set(FakeEngine(), dataset(10), DigitTokenizer(), groups, SPEC, 4, SEED)
    want = expected(SPEC, 10)
    assert sorted(got) == sorted(want)
    assert all(math.isclose(got[k], want[k], rel_tol=1e-12) for k in want), (got, want)
    assert 0 < got["eval/toy/pass@1"] < got["eval/toy/pass@3"] < got["eval/toy/pass@6"] < 1
    limited = evaluate_set(FakeEngine(), dataset(10), DigitTokenizer(), groups, replace(SPEC, limit=4), 4, SEED)
    assert limited == expected(SPEC, 4)


def test_a_user_metric_by_module_function(tmp_path, monkeypatch):
    (tmp_path / "my_metric.py").write_text(
        "def half(prompt, response, ground_truth, extra, bonus=0.0):\n"
        "    return 0.5 + bonus if response == '7' else 0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = replace(SPEC, metric="my_metric:half", metric_kwargs={"bonus": 0.25}, pass_threshold=0.75, k=[])
    got = evaluate_set(FakeEngine(), dataset(5), DigitTokenizer(), SimpleNamespace(dp_rank=0, dp_size=1),
                       spec, 4, SEED)
    sevens = [[mix_seed(mix_seed(SEED, i), j) % 2 == 0 for j in range(6)] for i in range(5)]
    assert ks_of(spec) == [1, 6]
    assert math.isclose(got["eval/toy/mean@6"], sum(0.75 * sum(s) / 6 for s in sevens) / 5, rel_tol=1e-12)
    assert math.isclose(got["eval/toy/pass@6"], sum(any(s) for s in sevens) / 5, rel_tol=1e-12)
    assert got["eval/toy/failed"] == 0.0


def _dp_worker(rank, world):
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    groups = SimpleNamespace(dp_rank=rank, dp_size=world, dp=dist.group.WORLD)
    return evaluate_set(FakeEngine(), dataset(7), DigitTokenizer(), groups, SPEC, 4, SEED)


def test_two_dp_ranks_give_the_one_rank_metrics():
    """Each rank takes every other prompt; seeds follow the prompt's index in the set, and the
    sums are all-reduced, so both ranks log the one-rank values."""
    results = spawn(_dp_worker, 2, 2)
    want = expected(SPEC, 7)
    for got in results:
        assert all(math.isclose(got[k], want[k], rel_tol=1e-12) for k in want), (got, want)


@pytest.mark.parametrize("entry, message", [
    ({"name": "a", "n": 2}, r"data.eval_sets\[0\]: n=2 with temperature=0 gives 2 equal greedy samples"),
    ({"name": "a", "n": 4, "temperature": 1.0, "k": [8]}, r"data.eval_sets\[0\].k=\[8\]: each k must be in 1..n=4"),
    ({"name": "a", "metric": "nope"}, r"data.eval_sets\[0\].metric='nope': unknown reward function"),
    ({"name": "a/b"}, r"data.eval_sets\[0\].name='a/b': give each eval set its own name"),
    ({"name": "a", "max_new_tokens": 17}, r"data.eval_sets\[0\].max_new_tokens=17 exceeds rollout.max_new_tokens=16"),
    ({"name": "a", "path": "missing.jsonl"}, r"data.eval_sets\[0\].path: 'missing.jsonl' not found"),
])
def test_eval_set_config_errors(entry, message):
    from megarl.cli import build
    from megarl.config_checks import check_data
    from megarl.errors import ConfigError

    from megarl.assets import asset_path

    entry = {"path": str(asset_path("tiny/test.jsonl")), **entry}
    cfg = build(Config, {"data": {"eval_sets": [entry]}})
    with pytest.raises(ConfigError, match=message):
        check_data(cfg)


def test_two_eval_sets_with_one_name_is_an_error():
    from megarl.cli import build
    from megarl.config_checks import check_data
    from megarl.errors import ConfigError
    from megarl.assets import asset_path

    path = str(asset_path("tiny/test.jsonl"))
    cfg = build(Config, {"data": {"eval_sets": [{"name": "a", "path": path}, {"name": "a", "path": path}]}})
    with pytest.raises(ConfigError, match=r"data.eval_sets\[1\].name='a'"):
        check_data(cfg)


def test_a_row_map_that_does_not_import_is_a_config_error():
    from megarl.cli import build
    from megarl.config_checks import check_data
    from megarl.errors import ConfigError

    cfg = build(Config, {"data": {"train_mix": [{"path": "yaml/tiny.yaml", "row_map": "no_such_mod:f"}]}})
    with pytest.raises(ConfigError, match=r"data.train_mix\[0\].row_map='no_such_mod:f': cannot import module"):
        check_data(cfg)
