"""Partial rollouts (rollout.partial): megarl/trainer/partial.py over the native engine's generate_until.

- The native engine (tiny Llama, fp32, one process): a generation stopped early and resumed
  from its prefixes under the same weights gives the uninterrupted tokens and log-probs
  (finished ones exactly; the unfinished ones' tokens are a prefix of them); resumed across
  a weight update, a response keeps exactly the tokens it had, their log-probs are the old
  policy's (the training forward under the old weights, 1e-5) and the new tokens' are the
  new policy's.
- PartialRollouts over a scripted engine (a token per step and request, a response ends
  at a length drawn from its seed, log-probs naming the engine's version): every step
  trains exactly the quota of groups, each whole and the oldest complete first; per-token
  versions and log-probs are those of the engine version that sampled each token; resumed
  tokens are kept exactly; what is carried over survives state_dict / load_state_dict and
  the steps after equal those of the uninterrupted run; the metrics count it.
- A resume on another layout (no file of this rank's) starts with nothing in flight, rank 0
  counting every saved DP rank's responses once (TP copies aside) as dropped.
- Config mistakes: one line each. End-to-end runs (tiny task learns, resume with carried
  responses) are in test_partial_runs.py.
Not covered: GPU graphs with an early stop (the GPU benchmark runs them), TP/PP > 1.
"""
from __future__ import annotations

import pytest
import torch

from megarl.cli import load_config
from megarl.config import Config
from megarl.config_checks import validate
from megarl.data.dataset import PromptBatch, PromptItem
from megarl.errors import ConfigError
from megarl.rollout.engine import GenerationResult, SamplingParams
from megarl.trainer.partial import PartialRollouts, group_results, local_sums

N, QUOTA = 3, 2


class ScriptedEngine:
    """``generate_until`` as the native engine behaves: each step every running request samples one token
    (token = (seed + index) % 97, log-prob = -(version + index / 1000)), a request ends at its length
    (1 + seed % 9); after each step ``enough`` hears the keys that finished."""

    def __init__(self):
        self.version, self.calls = 0, []

    def generate_until(self, requests, params, enough):
        self.calls.append(len(requests))
        state = {r.key: (r, list(r.prefix), list(r.prefix_logprobs)) for r in requests}
        done: dict[int, GenerationResult] = {}
        while len(done) < len(state):
            ended = []
            for key, (r, toks, lps) in state.items():
                if key in done:
                    continue
                i = len(toks)
                toks.append((r.seed + i) % 97)
                lps.append(-(self.version + i / 1000))
                if len(toks) == 1 + r.seed % 9:
                    done[key] = GenerationResult(list(r.prompt), toks, lps, "stop", key)
                    ended.append(key)
            if enough(ended):
                break
        finished = [done[r.key] for r in requests if r.key in done]
        unfinished = [GenerationResult(list(r.prompt), state[r.key][1], state[r.key][2], "unfinished", r.key)
                      for r in requests if r.key not in done]
        return finished, unfinished


def _draw(counter: list[int]):
    def draw() -> PromptBatch:
        items = [PromptItem(counter[0] + i, [5, counter[0] + i], f"p{counter[0] + i}", "a") for i in range(QUOTA)]
        counter[0] += QUOTA
        return PromptBatch(items)
    return draw


def _step(p: PartialRollouts, engine: ScriptedEngine, draw, step: int):
    engine.version = step
    p.top_up(draw, seed=1000 * step)
    before = {id(g): [list(s.tokens) for s in g.samples] for g in p.groups}
    p.generate(engine, SamplingParams(), step)
    return p.take(), before


def test_steps_train_whole_oldest_groups_with_the_versions_that_sampled_each_token():
    p, engine, counter = PartialRollouts(QUOTA, N, batches=3, max_new_tokens=16), ScriptedEngine(), [0]
    draw = _draw(counter)
    resumed = 0
    for step in range(6):
        taken, before = _step(p, engine, draw, step)
        assert len(taken) == QUOTA and all(g.complete for g in taken)  # the batch fills, with whole groups
        flight_orders = [g.order for g in p.groups if g.complete]
        assert all(g.order < o for g in taken for o in flight_orders)  # the oldest complete groups first
        assert len(p.groups) + QUOTA <= 3 * QUOTA
        for g in taken:
            for j, s in enumerate(g.samples):
                assert len(s.tokens) == len(s.logprobs) == len(s.versions) == 1 + s.seed % 9
                assert s.tokens == [(s.seed + i) % 97 for i in range(len(s.tokens))]
                # each token's log-prob names the version that sampled it, and that is its recorded version
                assert s.logprobs == [-(v + i / 1000) for i, v in enumerate(s.versions)]
                assert s.versions == sorted(s.versions) and s.versions[-1] <= step
                kept = before.get(id(g), [[]] * N)[j]
                assert s.tokens[:len(kept)] == kept  # a resumed response keeps exactly its tokens
                resumed += s.versions[0] < step
        sums = local_sums(taken, p.groups, step)
        assert sums["responses"] == QUOTA * N
        assert sums["carried_over"] == sum(len(g.samples) for g in p.groups)
        assert sums["stale_tokens"] == sum(v < step for g in taken for s in g.samples for v in s.versions)
    assert resumed > 0  # some response did continue across a version


def test_carried_responses_survive_a_checkpoint():
    """4 steps straight equal 2 steps, state_dict -> a fresh PartialRollouts, 2 more: same batches."""
    def run(split: bool):
        p, engine, counter = PartialRollouts(QUOTA, N, 2, 16), ScriptedEngine(), [0]
        draw, batches = _draw(counter), []
        for step in range(4):
            if split and step == 2:
                assert p.groups  # something is carried over
                q = PartialRollouts(QUOTA, N, 2, 16)
                q.load_state_dict(torch.load(_saved(p.state_dict()), weights_only=False))
                p = q
            taken, _ = _step(p, engine, draw, step)
            batches.append([(r.response_ids, r.logprobs, r.versions) for r in group_results(taken)])
        return batches

    assert run(False) == run(True)
    p = PartialRollouts(QUOTA, N, 2, 16)
    p.load_state_dict({"drawn": 3, "shape": [QUOTA + 1, N, 16], "groups": [{"samples": [{}] * N}]})
    assert p.groups == [] and p.dropped == N  # another batch shape: dropped, counted
    p.load_state_dict(None)
    assert p.groups == [] and p.dropped == 0


def _saved(state):
    """``state`` through torch.save, as a checkpoint holds it."""
    import io

    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return buf


RP = "rollout.partial"


@pytest.mark.parametrize("overrides,start", [
    ([f"{RP}=true", "rollout.engine=sglang"], f"{RP}=true does not work with rollout.engine=sglang"),
    ([f"{RP}=true", "rollout.multi_turn.enable=true"], f"{RP}=true does not work with rollout.multi_turn"),
    ([f"{RP}=true", "algorithm.dapo.dynamic_sampling=true"], f"{RP}=true does not work with algorithm.dapo"),
    ([f"{RP}=true", f"{RP}_batches=1"], f"{RP}_batches=1 must be >= 2"),
    ([f"{RP}_batches=3"], f"{RP}_batches is read only with {RP}=true"),
])
def test_config_mistakes_are_one_line(overrides, start):
    with pytest.raises(ConfigError) as e:
        validate(load_config(["yaml/tiny_grpo.yaml", *overrides], Config), 2)
    assert str(e.value).startswith(start) and "\n" not in str(e.value), str(e.value)


PROMPTS = [[7, 8, 9, 10, 11, 12], [13, 14], list(range(20, 33)), [30], [5, 6, 7, 8, 9]]
MAX_NEW, TEMP = 12, 0.8


def _resume(requests, unfinished):
    """Requests continuing ``unfinished`` results from their tokens."""
    from dataclasses import replace

    by_key = {r.key: r for r in requests}
    return [replace(by_key[u.key], prefix=tuple(u.response_ids), prefix_logprobs=tuple(u.logprobs))
            for u in unfinished]


def _native_partial(rank, ckpt):
    from dist_helpers import worker_actor
    from megarl.rollout.engine import sample_requests
    from megarl.rollout.native import EngineOptions, NativeEngine
    from megarl.trainer.rollout import to_sample_batch

    actor, groups = worker_actor(ckpt)
    engine = NativeEngine(actor.module, groups, actor.info.vocab_size, [3], 0,
                          EngineOptions(max_batch=3, page_size=8, max_num_batched_tokens=8, kv_cache_gb=0.01))
    params = SamplingParams(temperature=TEMP)
    requests = sample_requests(PROMPTS, 2, 11, MAX_NEW)
    full = {r.key: r for r in engine.generate(requests, params)}
    heard = []

    def enough(keys):
        heard.extend(keys)
        return len(heard) >= 3

    held_after_generate = int((engine.cache.pool.refs > 0).sum())
    finished, unfinished = engine.generate_until(requests, params, enough)
    held = (held_after_generate, int((engine.cache.pool.refs > 0).sum()))  # stopped sequences gave pages back
    same = engine.generate(_resume(requests, unfinished), params)  # the same weights

    def logprobs(results):  # the training forward under the actor's current weights, (B, L)
        return actor.logprobs(to_sample_batch(results, 0, "cpu"), 4, TEMP)["logprobs"].tolist()

    old_forward = logprobs(unfinished) if unfinished else None
    torch.manual_seed(0)
    with torch.no_grad():  # a "weight update": the engine reads the actor's weights in place
        for p in actor.module.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine.update_weights()
    moved = engine.generate(_resume(requests, unfinished), params)
    return {"held": held, "full": full, "finished": finished, "unfinished": unfinished, "heard": heard, "same": same,
            "moved": moved, "old_forward": old_forward, "new_forward": logprobs(moved)}


def test_native_generation_stopped_and_resumed_across_a_weight_update(tmp_path):
    """Stopped after 3 requests finished (3 decoding slots: others still run, some never started):
    the finished ones equal the uninterrupted generation; resumed under the same weights every
    request ends as uninterrupted; resumed after the weights moved, each keeps its tokens and their
    log-probs (the old policy's: the old training forward, 1e-5), and its new tokens carry the new
    policy's log-probs (the new training forward, 1e-5), which differ from the old ones."""
    from dist_helpers import spawn
    from megarl.models.tiny import make_tiny_checkpoint

    make_tiny_checkpoint(str(tmp_path), "LlamaForCausalLM", seed=1, vocab_size=57, eos_token_id=3)
    out = spawn(_native_partial, 1, str(tmp_path))[0]
    full, finished, unfinished = out["full"], out["finished"], out["unfinished"]
    out["old_forward"], out["new_forward"] = torch.tensor(out["old_forward"]), torch.tensor(out["new_forward"])
    assert out["held"][0] == out["held"][1]
    assert len(finished) >= 3 and [r.key for r in finished][:3] == out["heard"][:3]
    assert len(finished) + len(unfinished) == len(PROMPTS) * 2
    assert any(u.response_ids for u in unfinished) and any(not u.response_ids for u in unfinished)
    for r in finished:
        assert r.response_ids == full[r.key].response_ids and r.logprobs == full[r.key].logprobs
    for u, s in zip(unfinished, out["same"]):
        assert u.finish_reason == "unfinished" and u.key == s.key
        assert full[u.key].response_ids[:len(u.response_ids)] == u.response_ids
        assert s.response_ids == full[u.key].response_ids, u.key
        assert torch.allclose(torch.tensor(s.logprobs), torch.tensor(full[u.key].logprobs), atol=1e-5)
    new_differs = False
    for i, (u, m) in enumerate(zip(unfinished, out["moved"])):
        k, p = len(u.response_ids), len(u.prompt_ids)
        assert m.response_ids[:k] == u.response_ids and m.logprobs[:k] == u.logprobs  # kept exactly
        old = out["old_forward"][i, p:p + k]
        assert torch.allclose(torch.tensor(u.logprobs), old, atol=1e-5)  # sampled by the old policy
        new = out["new_forward"][i, p + k:p + len(m.response_ids)]
        assert torch.allclose(torch.tensor(m.logprobs[k:]), new, atol=1e-5)  # the new policy's tokens
        new_differs |= bool((out["new_forward"][i, p:p + k] - old).abs().max() > 1e-3) if k else False
    assert new_differs  # the update did move the policy under the kept tokens


class _Checkpoints:
    """read_rank_file / read_rank_files of a checkpoint saved by 2 DP ranks x 2 TP ranks."""

    def __init__(self, states, same_layout: bool):
        self.states, self.same = states, same_layout

    def read_rank_file(self, step, name):
        return self.states[0] if self.same else None

    def read_rank_files(self, step, name):
        return [s for s in self.states for _ in range(2)]  # each DP rank's file twice (its TP ranks)


def test_resume_on_another_layout_drops_what_was_in_flight_and_counts_it():
    engine, states = ScriptedEngine(), []
    for dp_rank in range(2):
        p = PartialRollouts(QUOTA, N, 2, 16, dp_rank=dp_rank)
        _step(p, engine, _draw([100 * dp_rank]), 0)
        states.append(p.state_dict())
    in_flight = [sum(len(g["samples"]) for g in s["groups"]) for s in states]
    assert min(in_flight) > 0
    from megarl.trainer.partial import restore

    same = PartialRollouts(QUOTA, N, 2, 16)
    restore(same, _Checkpoints(states, True), 2, rank0=True)
    assert same.dropped == 0 and sum(len(g.samples) for g in same.groups) == in_flight[0]
    for rank0, dropped in ((True, sum(in_flight)), (False, 0)):
        moved = PartialRollouts(QUOTA, N, 2, 16)
        restore(moved, _Checkpoints(states, False), 2, rank0=rank0)
        assert moved.groups == [] and moved.dropped == dropped
