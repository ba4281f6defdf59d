"""DAPO (megarl/algos/dapo.py, megarl/trainer/dapo.py) and the off-policy config checks.

- Overlong shaping: the penalty at the buffer's edges (0 at L_max - L_cache, -1 at
  L_max and beyond) and inside it, scaled by the factor; lengths read off the batch.
- Dynamic sampling on rounds where half the groups have equal scores: the batch is
  filled with informative groups only, each with exactly its source rows; a rank
  that is full while another is short draws prompts without generating; after
  max_rounds the batch is topped up with dropped groups.
- Config mistakes in algorithm.rollout_correction / algorithm.dapo: one line each,
  exit 2 from the entry script.
- The shipped yaml/tiny_dapo.yaml runs 2 steps on 2 ranks with full batches and logs
  the dapo/* and rollout_correction/* metrics.
Not covered: multi-turn responses under dynamic sampling, GPU.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megarl.algos.dapo import informative_groups, overlong_penalty
from megarl.cli import load_config
from megarl.config import Config, DapoConfig
from megarl.config_checks import validate
from megarl.errors import ConfigError
from megarl.roles.batch import SampleBatch
from megarl.trainer.dapo import fill_batch, mask_truncated, response_lengths, shape_scores
from megarl.trainer.rollout import Rollout, concat_rollouts, select_rollout
from test_trainer_runs import _comparable, metrics, ppo

ROOT = Path(__file__).resolve().parents[1]
N = 2  # samples per prompt


def test_overlong_penalty_at_the_buffer_edges():
    """L_max 14, L_cache 3: start 11. |y| 11 -> 0 (edge), 12 -> -1/3, 13 -> -2/3, 14 -> -1
    (edge), 15 -> -1; factor 0.5 halves it; a buffer of 0 gives zeros."""
    lengths = torch.tensor([0, 10, 11, 12, 13, 14, 15])
    expected = [0, 0, 0, -1 / 3, -2 / 3, -1, -1]
    got = overlong_penalty(lengths, 14, 3).tolist()
    assert all(math.isclose(g, e, abs_tol=1e-15) for g, e in zip(got, expected)), got
    half = overlong_penalty(lengths, 14, 3, factor=0.5).tolist()
    assert all(math.isclose(g, e / 2, abs_tol=1e-15) for g, e in zip(half, expected))
    assert overlong_penalty(lengths, 14, 0).tolist() == [0.0] * 7
    assert overlong_penalty(torch.tensor([0, 1, 4]), 4, 4).tolist() == [0.0, -0.25, -1.0]  # buffer = L_max


def _rollout(scores: list[list[float]], first_group: int, prompt_len: int = 3, finish=None) -> Rollout:
    """Groups of N rows; row j of group g has response length 1 + (j + g) % 4 and token ids
    that name the group and sample (g * 100 + j), so rows can be traced through selection."""
    rows = [(first_group + g, j, s) for g, group in enumerate(scores) for j, s in enumerate(group)]
    lengths = [prompt_len + 1 + (j + g) % 4 for g, j, _ in rows]
    width = max(lengths)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width)
    for i, ((g, j, _), n) in enumerate(zip(rows, lengths)):
        ids[i, :n] = g * 100 + j
        mask[i, prompt_len:n] = 1.0
    batch = SampleBatch(ids, mask, torch.tensor(lengths), rollout_logprobs=-mask * 0.5)
    texts = [f"g{g}s{j}" for g, j, _ in rows]
    return Rollout(batch=batch, prompts=texts, responses=texts, answers=texts, extras=[{}] * len(rows),
                   group_ids=torch.tensor([g for g, _, _ in rows]),
                   finish_reasons=finish or ["stop"] * len(rows), scores=torch.tensor([s for _, _, s in rows]))


def _half_equal_round(k: int, quota: int = 4) -> Rollout:
    """Round k: quota groups; even ones informative ([0, 1]), odd ones all equal ([1, 1] or [0, 0])."""
    scores = [[0.0, 1.0] if g % 2 == 0 else [float(g % 4 == 1)] * N for g in range(quota)]
    return _rollout(scores, first_group=k * quota)


def _draws(log: list, make=_half_equal_round):
    def draw(k, wanted):
        log.append((k, wanted))
        return make(k) if wanted else None
    return draw


def test_dynamic_sampling_fills_the_batch_with_informative_groups_only():
    """Quota 4 groups; each round brings 2 informative (groups 0, 2 of it) and 2 equal ones.
    Round 0 keeps groups 0, 2; round 1 keeps 4, 6 and stops: 2 rounds, 8 generated, 4 kept,
    4 dropped. Every kept row equals its source row (ids, mask, rollout log-probs, texts)."""
    log = []
    batch, counts = fill_batch(_draws(log), quota=4, max_rounds=5)
    assert log == [(0, True), (1, True)]
    assert batch.group_ids.tolist() == [0, 0, 2, 2, 4, 4, 6, 6]
    for rows, informative in informative_groups(batch.scores, batch.group_ids):
        assert informative, rows
    sources = {g: _half_equal_round(g // 4) for g in (0, 2, 4, 6)}
    for i, g in enumerate(batch.group_ids.tolist()):
        src = sources[g]
        j = (src.group_ids == g).nonzero().flatten()[i % N].item()
        n = int(src.batch.lengths[j])
        assert torch.equal(batch.batch.input_ids[i, :n], src.batch.input_ids[j, :n])
        assert torch.equal(batch.batch.response_mask[i], torch.nn.functional.pad(
            src.batch.response_mask[j], (0, batch.batch.width - src.batch.width)))
        assert torch.equal(batch.batch.rollout_logprobs[i, :n], src.batch.rollout_logprobs[j, :n])
        assert batch.prompts[i] == src.prompts[j] and batch.scores[i] == src.scores[j]
    assert counts == {"groups_generated": 8, "groups_informative": 4, "groups_kept": 4, "groups_filled": 0,
                      "groups_dropped": 4, "rounds": 2}


def test_a_full_rank_draws_without_generating_and_short_batches_are_filled():
    """With another rank still short (any_short True), a full rank keeps drawing rounds'
    prompts (its sampler stays in step) but generates nothing. With max_rounds 1 the batch
    is topped up with the dropped equal groups, in order: groups 0, 2 kept, 1, 3 filled."""
    log = []
    batch, counts = fill_batch(_draws(log), quota=2, max_rounds=3, any_short=lambda short: True)
    assert log == [(0, True), (1, False), (2, False)] and counts["rounds"] == 3
    assert batch.group_ids.tolist() == [0, 0, 2, 2] and counts["groups_dropped"] == 2
    batch, counts = fill_batch(_draws([]), quota=4, max_rounds=1)
    assert batch.group_ids.tolist() == [0, 0, 2, 2, 1, 1, 3, 3]
    assert (counts["groups_kept"], counts["groups_filled"], counts["groups_dropped"]) == (2, 2, 0)


def test_all_informative_round_is_the_plain_batch():
    """A first round whose groups all differ is the batch as generated: one round, every field equal."""
    source = _rollout([[0.0, 1.0], [2.0, 1.0], [0.5, 0.0]], first_group=0)
    batch, counts = fill_batch(lambda k, wanted: source, quota=3, max_rounds=4)
    assert counts["rounds"] == 1 and counts["groups_dropped"] == 0
    b, s = batch.batch, source.batch
    assert all(torch.equal(getattr(b, k), getattr(s, k)) for k in ("input_ids", "response_mask", "lengths",
                                                                     "rollout_logprobs"))
    assert torch.equal(batch.scores, source.scores) and torch.equal(batch.group_ids, source.group_ids)
    assert batch.prompts == source.prompts and batch.finish_reasons == source.finish_reasons


def test_shaping_lengths_and_truncation_mask():
    """Response lengths (1 + (j + g) % 4 here) come off the batch; the penalty lands on the
    scores (L_max 4, L_cache 2: length 3 loses 0.5); truncated rows lose their mask."""
    r = _rollout([[1.0, 1.0], [0.0, 0.0]], first_group=0, finish=["stop", "length", "stop", "stop"])
    assert response_lengths(r).tolist() == [1, 2, 2, 3]
    m = shape_scores(r, DapoConfig(overlong_buffer=2), max_new_tokens=4)
    assert r.scores.tolist() == [1.0, 1.0, 0.0, -0.5] and m == {"reward/overlong_sum": -0.5}
    mask_truncated(r)
    assert r.batch.response_mask.sum(-1).tolist() == [1, 0, 2, 3]
    both = concat_rollouts([select_rollout(r, [3]), select_rollout(r, [0, 1])])
    assert both.prompts == ["g1s1", "g0s0", "g0s1"] and both.batch.lengths.tolist() == [6, 4, 5]


def _error(*overrides) -> str:
    cfg = load_config([str(ROOT / "yaml" / "tiny_grpo.yaml"), *overrides], Config)
    with pytest.raises(ConfigError) as e:
        validate(cfg, 2)
    assert "\n" not in str(e.value)
    return str(e.value)


RC = "algorithm.rollout_correction"


@pytest.mark.parametrize("overrides, start", [
    ([f"{RC}.mode=tis", f"{RC}.cap=0.5"], f"{RC}.cap=0.5 must be a finite number >= 1"),
    ([f"{RC}.mode=seq_is", f"{RC}.cap=nan"], f"{RC}.cap=nan must be a finite number >= 1"),
    ([f"{RC}.mode=mis", f"{RC}.low=0"], f"{RC}.low=0.0 must be in (0, 1)"),
    ([f"{RC}.mode=icepop", f"{RC}.low=1.0"], f"{RC}.low=1.0 must be in (0, 1)"),
    ([f"{RC}.mode=icepop", f"{RC}.high=1.0"], f"{RC}.high=1.0 must be a finite number > 1"),
    ([f"{RC}.mode=mis", f"{RC}.high=inf"], f"{RC}.high=inf must be a finite number > 1"),
    ([f"{RC}.preset=sglang", f"{RC}.mode=mis"], f"{RC}.preset=sglang sets the mode"),
    ([f"{RC}.preset=async", f"{RC}.cap=3"], f"{RC}.preset=async sets the mode"),
    ([f"{RC}.mode=tis", f"{RC}.low=0.2"], f"{RC}.low=0.2 is not read by {RC}.mode=tis"),
    ([f"{RC}.cap=3"], f"{RC}.cap=3.0 is not read by {RC}.mode=none"),
    ([f"{RC}.mode=icepop", f"{RC}.level=sequence"], f"{RC}.level=sequence is not read by {RC}.mode=icepop"),
    (["algorithm.dapo.max_rounds=0", "algorithm.dapo.dynamic_sampling=true"],
     "algorithm.dapo.max_rounds=0 must be >= 1"),
    (["algorithm.dapo.overlong_buffer=11"], "algorithm.dapo.overlong_buffer=11 must be <= rollout.max_new_tokens=10"),
    (["algorithm.dapo.overlong_buffer=-1"], "algorithm.dapo.overlong_buffer=-1 must be >= 0"),
    (["algorithm.dapo.overlong_buffer=2", "algorithm.dapo.overlong_penalty=nan"],
     "algorithm.dapo.overlong_penalty=nan must be a finite number >= 0"),
    (["algorithm.dapo.overlong_penalty=0.5"], "algorithm.dapo.overlong_penalty is read only with"),
    (["algorithm.dapo.max_rounds=2"], "algorithm.dapo.max_rounds is read only with"),
    (["algorithm.dapo.dynamic_sampling=true", "algorithm.advantage=gae"],
     "algorithm.dapo.dynamic_sampling=true keeps groups whose scores differ"),
])
def test_config_mistakes_are_one_line(overrides, start):
    assert _error(*overrides).startswith(start)


def test_presets_and_shipped_yaml_validate():
    for extra in ([f"{RC}.preset=sglang"], [f"{RC}.preset=async"], [f"{RC}.mode=mis", f"{RC}.level=sequence",
                                                                     f"{RC}.seq_ratio=product", f"{RC}.high=3"]):
        validate(load_config([str(ROOT / "yaml" / "tiny_grpo.yaml"), *extra], Config), 2)
    validate(load_config([str(ROOT / "yaml" / "tiny_dapo.yaml")], Config), 2)


def test_entry_script_exits_2_with_one_line():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    p = subprocess.run([sys.executable, "launch/ppo.py", "yaml/tiny_dapo.yaml", f"{RC}.cap=0.9"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, env={**env, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 2, p.stderr
    assert p.stderr.splitlines() == [f"config error: {RC}.cap=0.9 must be a finite number >= 1 (a cap below 1 "
                                     "would down-weight tokens on which both policies agree)"]


def test_tiny_dapo_runs_with_full_batches(tmp_path):
    """Two steps of yaml/tiny_dapo.yaml on 2 ranks (8 prompts x 4): every step trains on 8
    groups (kept + filled), none of the kept ones uninformative, and the rollout-correction
    metrics are logged (fp32 native engine: ratio 1 within 1e-4)."""
    ppo("yaml/tiny_dapo.yaml", tmp_path, "data.batch_size=8", "rollout.n=4", "actor.mini_batch_size=16",
        "actor.micro_batch_size=8", "trainer.eval_samples=8", "trainer.tensorboard=false",
        "trainer.export_hf=false", "trainer.save_last=false", steps=2)
    rows = metrics(tmp_path)
    for step in (1, 2):
        m = rows[step]
        assert m["dapo/groups_kept"] + m["dapo/groups_filled"] == 8, m
        assert m["dapo/groups_kept"] <= m["dapo/groups_informative"] <= m["dapo/groups_generated"]
        assert m["dapo/groups_generated"] <= 8 * m["dapo/rounds"]  # a full rank skips a round
        assert abs(m["rollout_correction/ratio_mean"] - 1) < 1e-4 and m["rollout_correction/truncated_frac"] == 0
        assert "reward/overlong/mean" in m


def test_dapo_resume_equals_uninterrupted(tmp_path):
    """Dynamic sampling draws a varying number of prompt batches per step and a full rank
    draws without generating; the sampler's position is in the checkpoint and the rounds'
    seeds are functions of (step, round, rank), so 2 steps + a resumed 2 equal 4 straight
    steps: steps 3 and 4 log the same metrics bitwise (wall-clock ones aside)."""
    small = ["data.batch_size=8", "rollout.n=4", "actor.mini_batch_size=16", "actor.micro_batch_size=8",
             "trainer.eval_samples=8", "trainer.tensorboard=false", "trainer.export_hf=false", "trainer.save_every=2"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    ppo("yaml/tiny_dapo.yaml", straight, *small, steps=4)
    ppo("yaml/tiny_dapo.yaml", resumed, *small, steps=2)
    assert "resumed from step 2" in ppo("yaml/tiny_dapo.yaml", resumed, *small, steps=4)
    a, b = metrics(straight), metrics(resumed)
    for step in (3, 4):
        assert _comparable(a[step]) == _comparable(b[step]), step
    assert sum(a[s]["dapo/rounds"] for s in (1, 2, 3, 4)) > 4  # some step needed a second round
