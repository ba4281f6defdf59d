"""Gym-style environments in the agent loop (``rollout.multi_turn.environment``), over a scripted engine.

The guessing game of ``megarl/agents/guess_env.py`` with the secret 7 and the BPE test tokenizer of
``test_rollout_agent.py`` (the engine samples ``a`` ``b`` where encoding the text gives the merged
``ab``). The scripted engine answers turn k (k = user turns in its prompt - 1) with ``script[k]``:
``ab 5</s>``, ``ab 9</s>``, ``ab 7</s>`` — told "higher", then "lower", then right. Checked exactly, by
both schedules (turn by turn, and overlapped through a scripted ``serve``):

* the prompt is the reset's messages under the chat template; the response is the sampled ids, the
  template's context ids of each observation (its leading ``</s>`` dropped: the turn already ended
  with it) and the next sampled ids — what decoding and re-encoding would not give; loss mask 1
  exactly at sampled ids, log-prob 0 at context ids; each turn's engine prompt is the ids so far;
* the reward is the environment's (``agent_reward``, read by the reward term ``agent``), the
  conversation ``step`` sees is OpenAI-shaped (assistant content without ``</s>``);
* limits: ``max_turns`` ends the episode (reward 0 so far), a small budget ends it at "length";
* errors: a reset or step that raises, returns the wrong shape or runs past its time limit, or an
  opening past ``data.max_prompt_len``, fails its sample only (loss mask 0 everywhere, ``agent_failed``, ``agent/env_failed_frac``).
The native engine and the factory are covered by ``test_rollout_env_native.py``.
"""
import time

import pytest

from megarl.agents.guess_env import GuessNumberEnv
from megarl.rollout.agent import AgentLoop, AgentOptions
from megarl.rollout.engine import GenerationResult, Request, SamplingParams
from megarl.rollout.environments import EnvironmentRunner
from megarl.tools import parse_hermes
from test_rollout_agent import make_tokenizer


class GuessEngine:
    """Turn k of a sample: script[k]; k = user turns in the prompt - 1. Has ``serve`` (follow-ups
    answered at once) for the overlapped schedule."""

    def __init__(self, tok, script=("ab 5", "ab 9", "ab 7")):
        a, b = tok.convert_tokens_to_ids(["a", "b"])
        self.tok, self.prompts = tok, []
        self.script = [[a, b] + tok.encode(s[2:], add_special_tokens=False) + [tok.eos_token_id] for s in script]
        self.marker = tok.encode("user:", add_special_tokens=False)

    def _answer(self, r: Request, params) -> GenerationResult:
        self.prompts.append(list(r.prompt))
        p, m = r.prompt, self.marker
        turn = sum(p[j:j + len(m)] == m for j in range(len(p))) - 1
        ids = self.script[min(turn, len(self.script) - 1)][: r.max_new_tokens]
        stop = bool(ids) and ids[-1] == self.tok.eos_token_id
        return GenerationResult(list(p), ids, [-0.25] * len(ids), "stop" if stop else "length", r.key)

    def generate(self, requests, params):
        return [self._answer(r, params) for r in requests]

    def serve(self, requests, params, feed):
        while requests:
            for r in requests:
                feed.finished(r.key, self._answer(r, params))
            requests = feed.poll(idle=True)


def _loop(tok, make_env=lambda: GuessNumberEnv(), overlap=False, max_turns=4, timeout_s=5.0, max_prompt_len=0):
    engine = GuessEngine(tok)
    options = AgentOptions(tok.convert_tokens_to_ids("</tool_call>"), max_turns, 64, overlap_tools=overlap,
                           max_prompt_len=max_prompt_len)
    runner = EnvironmentRunner(make_env, tok, parse_hermes, workers=4, timeout_s=timeout_s)
    return AgentLoop(engine, tok, None, parse_hermes, options, environment=runner), engine


def _generate(loop, keys, budget=90, answer="7"):
    loop.bind_items({k: {"answer": answer, "messages": [], "extra": {}} for k in keys})
    requests = [Request(k, [0, 1], k, budget) for k in keys]  # the dataset prompt: replaced by reset's
    return loop.generate(requests, SamplingParams())


@pytest.mark.parametrize("overlap", [False, True])
def test_episode_is_token_in_token_out_with_masks_and_the_env_reward(overlap):
    tok = make_tokenizer()
    loop, engine = _loop(tok, overlap=overlap)
    (r,) = _generate(loop, [3])
    prompt = tok.encode("<s>user:guess a number from 1 to 16 answer with the number only</s><s>assistant:",
                        add_special_tokens=False)
    higher, lower = (tok.encode(f"<s>user:{w}</s><s>assistant:", add_special_tokens=False)
                     for w in ("higher", "lower"))
    s0, s1, s2 = engine.script
    assert r.prompt_ids == prompt
    assert r.response_ids == s0 + higher + s1 + lower + s2
    assert r.loss_mask == [1] * len(s0) + [0] * len(higher) + [1] * len(s1) + [0] * len(lower) + [1] * len(s2)
    assert [lp for lp, m in zip(r.logprobs, r.loss_mask) if m == 0] == [0.0] * (len(higher) + len(lower))
    assert all(lp == -0.25 for lp, m in zip(r.logprobs, r.loss_mask) if m == 1)
    assert engine.prompts == [prompt, prompt + s0 + higher, prompt + s0 + higher + s1 + lower]
    whole = r.prompt_ids + r.response_ids
    assert tok.encode(tok.decode(whole), add_special_tokens=False) != whole  # re-encoding would change the ids
    assert r.finish_reason == "stop" and r.extra["turns"] == 3
    assert r.extra["agent_reward"] == 1.0 and r.extra["agent_failed"] is False
    assert r.extra["final_turn_ids"] == s2
    assert loop.stats["agent/env_reward_mean"] == 1.0 and loop.stats["agent/env_failed_frac"] == 0.0
    conversation = loop.environment.conversations[3]
    assert [m["role"] for m in conversation] == ["user", "assistant", "user", "assistant", "user", "assistant"]
    assert conversation[1] == {"role": "assistant", "content": "ab 5"} and conversation[2]["content"] == "higher"


def test_reward_term_agent_reads_the_env_reward():
    from megarl.rewards.registry import agent_term

    tok = make_tokenizer()
    missed = _generate(_loop(tok, max_turns=2)[0], [0])  # guesses 5 and 9 of 7: max_turns, reward 0
    found = _generate(_loop(tok, max_turns=2)[0], [0], answer="9")  # 9 is right on the second turn
    assert missed[0].finish_reason == "max_turns" and agent_term("", "", None, missed[0].extra) == 0.0
    assert found[0].finish_reason == "stop" and agent_term("", "", None, found[0].extra) == 1.0


def test_turn_and_token_limits():
    tok = make_tokenizer()
    loop, engine = _loop(tok, max_turns=2)
    (r,) = _generate(loop, [0])
    assert r.finish_reason == "max_turns" and r.extra["turns"] == 2 and r.extra["agent_reward"] == 0.0
    s0 = engine.script[0]
    loop, engine = _loop(tok)
    (r,) = _generate(loop, [0], budget=len(s0) + 3)  # no room to sample after the first observation
    assert r.finish_reason == "length" and r.response_ids == s0 and r.loss_mask == [1] * len(s0)
    loop, engine = _loop(tok)
    (r,) = _generate(loop, [0], budget=2)
    assert r.finish_reason == "length" and r.response_ids == s0[:2] and r.extra["agent_failed"] is False


class Broken(GuessNumberEnv):
    """Key 1: reset raises; key 2: step raises; key 3: step returns two values; key 4: step hangs."""

    def reset(self, sample):
        self.key = sample["key"]
        if self.key == 1:
            raise KeyError("no such level")
        return super().reset(sample)

    def step(self, messages):
        if self.key == 2:
            raise ValueError("bad move")
        if self.key == 3:
            return [], 1.0
        if self.key == 4:
            time.sleep(2.0)
        return super().step(messages)


@pytest.mark.parametrize("overlap", [False, True])
def test_environment_errors_fail_their_samples_only(overlap):
    tok = make_tokenizer()
    loop, engine = _loop(tok, make_env=Broken, overlap=overlap, timeout_s=0.5)
    results = _generate(loop, [0, 1, 2, 3, 4])
    by_key = {r.key: r for r in results}
    assert [r.key for r in results] == [0, 1, 2, 3, 4]
    assert by_key[0].extra["agent_failed"] is False and by_key[0].extra["agent_reward"] == 1.0
    assert any(by_key[0].loss_mask)
    errors = {k: by_key[k].extra["agent_error"] for k in (1, 2, 3, 4)}
    assert "reset: KeyError" in errors[1] and "no such level" in errors[1]
    assert "step: ValueError: bad move" in errors[2]
    assert "step must return (observation messages, reward, done)" in errors[3]
    assert "timed out after 0.5s" in errors[4]
    for k in (1, 2, 3, 4):
        r = by_key[k]
        assert r.finish_reason == "failed" and r.extra["agent_failed"] is True and not any(r.loss_mask)
        assert len(r.response_ids) == len(r.loss_mask) == len(r.logprobs) >= 1
    assert by_key[1].response_ids == [tok.pad_token_id] and by_key[1].prompt_ids == [0, 1]  # nothing sampled
    assert by_key[2].response_ids == engine.script[0]  # what it sampled is kept, masked
    assert loop.stats["agent/env_failed_frac"] == 4 / 5
    loop, engine = _loop(tok, make_env=Broken, overlap=overlap)
    (r,) = _generate(loop, [1])  # no reset succeeded: the engine is not called
    assert r.finish_reason == "failed" and engine.prompts == [] and loop.stats["agent/env_failed_frac"] == 1.0
    (r,) = _generate(_loop(tok, overlap=overlap, max_prompt_len=20)[0], [0])  # the opening is 73 tokens
    assert r.extra["agent_error"] == "reset: the opening messages are 73 tokens; data.max_prompt_len is 20"
    assert r.finish_reason == "failed" and not any(r.loss_mask)


def test_environment_config_is_checked():
    from megarl.cli import load_config
    from megarl.config import Config
    from megarl.config_checks import check_multi_turn
    from megarl.errors import ConfigError

    base = ["yaml/tiny_tools.yaml", "rollout.multi_turn.environment=megarl.agents.guess_env:GuessNumberEnv"]
    check_multi_turn(load_config(base, Config))
    check_multi_turn(load_config(base + ["rollout.multi_turn.tools=[]"], Config))
    for extra, match in [(["rollout.multi_turn.interaction=m:f"], "both set"),
                         (["rollout.multi_turn.tools=[python]"], "runs the tool calls it receives itself"),
                         (["rollout.multi_turn.environment=nodots"], "must be module:function")]:
        with pytest.raises(ConfigError, match=match):
            check_multi_turn(load_config(base + extra, Config))


class RankZeroOnly(GuessNumberEnv):
    """Raises anywhere but on global rank 0 (the replica's first rank)."""

    def reset(self, sample):
        import torch.distributed as dist

        assert dist.get_rank() == 0, "an environment ran on a rank other than the replica's first"
        return super().reset(sample)


def _tp_rank(rank, overlap):
    from megarl.distributed import build_parallel_groups, init_distributed

    init_distributed()
    groups = build_parallel_groups(2, 1)
    tok = make_tokenizer()
    options = AgentOptions(tok.convert_tokens_to_ids("</tool_call>"), 4, 64, overlap_tools=overlap)
    runner = EnvironmentRunner(RankZeroOnly, tok, parse_hermes, workers=2, timeout_s=5.0)
    loop = AgentLoop(GuessEngine(tok), tok, None, parse_hermes, options, groups, environment=runner)
    loop.bind_items({k: {"answer": str(5 + 2 * k)} for k in range(2)})  # secrets 5 and 7
    results = loop.generate([Request(k, [0, 1], k, 90) for k in range(2)], SamplingParams())
    return [(r.prompt_ids, r.response_ids, r.loss_mask, r.extra["agent_reward"], r.extra["turns"]) for r in results]


def test_environments_run_on_tp_rank_zero_and_reach_every_rank():
    """TP2, both schedules: rank 1's environments would raise; both ranks get the same samples (the
    first guess is right for secret 5, the third for 7)."""
    from dist_helpers import spawn

    for overlap in (False, True):
        a, b = spawn(_tp_rank, 2, overlap)
        assert a == b and [s[3:] for s in a] == [(1.0, 1), (1.0, 3)]
