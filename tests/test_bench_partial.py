"""benchmarks/bench_partial.py: the forced lengths both runs share, and the tiny run's JSON; bench_e2e.py's
rollout-correction cost (the update's median seconds with correction over without).

- ForcedLengths: a request's length is a function of its seed alone, inside [low, high], never
  above the request's own limit, spread log-uniformly (the median near sqrt(low * high)); a
  resumed request (same seed, a prefix) keeps its length.
- ``--tiny`` (slow: two 4-step launch/ppo.py runs on CPU) writes the JSON the GPU run writes:
  sync and partial with rollout_tokens_per_s, tokens_per_s, step_s, and the workload.
"""
import json
import os
import statistics
import subprocess
import sys
from dataclasses import replace

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from bench_partial import ForcedLengths  # noqa: E402
from megarl.rollout.engine import sample_requests  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Echo:
    stats = {"x": 1.0}

    def generate(self, requests, params):
        return [r.max_new_tokens for r in requests]

    def generate_until(self, requests, params, enough):
        return [r.max_new_tokens for r in requests], []


def test_forced_lengths_depend_on_the_seed_alone():
    engine = ForcedLengths(_Echo(), 64, 2048)
    requests = sample_requests([[1, 2]] * 250, 8, seed=5, max_new_tokens=2048)
    lengths = engine.generate(requests, None)
    assert all(64 <= n <= 2048 for n in lengths) and max(lengths) > 1500 and min(lengths) < 80
    assert 250 < statistics.median(lengths) < 480  # sqrt(64 * 2048) = 362: log-uniform, not uniform (1056)
    assert lengths == [engine.target(r.seed) for r in requests]
    resumed = [replace(r, prefix=(7,), prefix_logprobs=(-1.0,)) for r in requests]
    assert engine.generate_until(resumed, None, None)[0] == lengths
    assert engine.generate([replace(requests[0], max_new_tokens=10)], None) == [min(10, lengths[0])]
    assert engine.stats == {"x": 1.0}
    engine.stats = {}
    assert engine.engine.stats == {}


def test_help():
    out = subprocess.run([sys.executable, "benchmarks/bench_partial.py", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "--tiny" in out.stdout and "--merge" in out.stdout


@pytest.mark.slow
def test_tiny_run_writes_the_json(tmp_path):
    path = tmp_path / "partial_rollout.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, "benchmarks/bench_partial.py", "--tiny", "--out", str(path), "--work",
                          str(tmp_path / "work")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    result = json.load(open(path))
    for mode in ("sync", "partial"):
        assert all(result[mode][k] > 0 for k in ("rollout_tokens_per_s", "tokens_per_s", "step_s")), result[mode]
    assert result["workload"]["min_len"] == 2 and result["workload"]["max_len"] == 12
    assert result["partial"]["rollout_tokens_per_s_speedup_vs_sync"] > 0
    assert "stale_token_frac" in result["partial"] and "stale_token_frac" not in result["sync"]


def test_e2e_rollout_correction_cost_is_the_update_time_ratio():
    from bench_e2e import rc_cost

    result = {"megarl": {"actor_update_s": 2.0}, "megarl_rc": {"actor_update_s": 2.03}}
    rc_cost(result)
    assert abs(result["rollout_correction_cost_pct"] - 1.5) < 1e-9
    lone = {"megarl": {"actor_update_s": 2.0}, "trl": {}}
    rc_cost(lone)
    assert "rollout_correction_cost_pct" not in lone
