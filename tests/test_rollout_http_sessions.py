"""How the endpoint's sessions find each call's prompt ids (megarl/rollout/http_sessions.py), on the
tiny tool task's tokenizer, without a model: a call that continues a recorded turn extends its ids as
recorded (whatever text the agent put back for the assistant), anything else is a new root."""
import pytest

from megarl.config import Config
from megarl.config_checks import check_server
from megarl.data.tokenizer import load_tokenizer
from megarl.errors import ConfigError
from megarl.rollout.engine import GenerationResult
from megarl.rollout.http_sessions import SampleSession
from megarl.rollout.turns import TurnRenderer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("megarl/assets/tiny_tools/sft")


def _root(tok):
    return lambda m: tok.encode(tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True),
                                add_special_tokens=False)


def _turn(s, prompt, ids, messages):
    s.record(prompt, [GenerationResult(prompt.ids, ids, [-0.5] * len(ids), "stop", 0)], messages)


def test_a_continued_conversation_extends_the_recorded_ids(tok):
    r, root = TurnRenderer(tok), _root(tok)
    s = SampleSession(0, 7, 112, [tok.eos_token_id])
    user = [{"role": "user", "content": "what is 62*917?"}]
    p0 = s.chat_prompt(user, r, root)
    assert p0.ids == root(user) and p0.context == []
    sampled = tok.encode('<tool_call>{"name": "calculator", "arguments": {"expression": "62*917"}}</tool_call>',
                         add_special_tokens=False)
    _turn(s, p0, sampled, user)
    # the agent re-serializes the call its own way: the recorded ids win
    again = user + [{"role": "assistant", "content": None, "tool_calls": [{"id": "x", "type": "function",
                     "function": {"name": "calculator", "arguments": "{\"expression\":\"62*917\"}"}}]},
                    {"role": "tool", "tool_call_id": "x", "content": "56854"}]
    p1 = s.chat_prompt(again, r, root)
    assert p1.base.ids == p0.ids + sampled
    assert tok.decode(p1.context) == "<|im_end|>\n<|im_start|>tool\n56854<|im_end|>\n<|im_start|>assistant\n"
    assert s.budget_left(p1) == 112 - len(sampled) - len(p1.context)
    answer = tok.encode("#### 56854", add_special_tokens=False) + [tok.eos_token_id]
    _turn(s, p1, answer, again)
    res = s.result(p0.ids, 0, False, {})
    assert res.prompt_ids == p0.ids and res.response_ids == sampled + p1.context + answer
    assert res.loss_mask == [1] * len(sampled) + [0] * len(p1.context) + [1] * len(answer)
    assert res.logprobs == [-0.5] * len(sampled) + [0.0] * len(p1.context) + [-0.5] * len(answer)
    assert res.extra["final_turn_ids"] == answer and s.chain_resets == 0
    # a turn that ended with eos: the template's close is not appended twice
    more = again + [{"role": "assistant", "content": "#### 56854"}, {"role": "user", "content": "sure?"}]
    p2 = s.chat_prompt(more, r, root)
    assert p2.context[0] != tok.eos_token_id and tok.decode(p2.context).startswith("\n<|im_start|>user\nsure?")


def test_a_rewritten_history_is_a_new_root_and_failures_train_nothing(tok):
    r, root = TurnRenderer(tok), _root(tok)
    s = SampleSession(3, 7, 112, [tok.eos_token_id])
    user = [{"role": "user", "content": "what is 62*917?"}]
    assert s.result(root(user), 0, False, {}).loss_mask == [0]  # no call made: a failed sample
    p0 = s.chat_prompt(user, r, root)
    _turn(s, p0, [5, 6], user)
    other = [{"role": "user", "content": "what is 2*3?"}, {"role": "assistant", "content": "x"},
             {"role": "tool", "content": "6"}]
    p1 = s.chat_prompt(other, r, root)
    assert p1.base.response_len == 0 and p1.ids == root(other) and s.chain_resets == 1
    assert s.token_prompt(p0.ids + [5, 6, 9]).context == [9]  # completions: a token prefix extends
    failed = s.result(p0.ids, 0, True, {})
    assert failed.finish_reason == "failed" and failed.loss_mask == [0, 0] and failed.response_ids == [5, 6]
    assert s.next_seed(0) != 7 and s.next_seed(0) != s.next_seed(1)


def test_server_config_is_checked():
    cfg = Config()
    cfg.rollout.server.enable = True
    with pytest.raises(ConfigError, match="exactly one of agent"):
        check_server(cfg)
    cfg.rollout.server.environment = "m:Env"
    check_server(cfg)
    cfg.rollout.server.environment = ""
    cfg.rollout.server.agent = "m:f"
    cfg.parallel.tp = 2
    with pytest.raises(ConfigError, match="parallel.tp=1"):
        check_server(cfg)
    cfg.parallel.tp = 1
    cfg.rollout.multi_turn.enable = True
    with pytest.raises(ConfigError, match="multi_turn"):
        check_server(cfg)
    cfg.rollout.multi_turn.enable = False
    check_server(cfg)


def test_agent_reward_term_reads_what_the_agent_returned():
    from megarl.rewards.registry import get_reward

    term = get_reward("agent")
    assert term("p", "r", None, {"agent_failed": False, "agent_reward": 0.25}) == 0.25
    assert term("p", "r", None, {"agent_failed": True}) == 0.0
    with pytest.raises(ValueError, match="rollout.server"):
        term("p", "r", None, {})
