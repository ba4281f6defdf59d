"""Multi-turn agent loop over a scripted engine: token-in/token-out, loss masks, limits, seeds, TP.

The tokenizer is a small BPE one whose merges make re-tokenization differ from
what is sampled: the engine samples ``a`` ``b`` as two tokens where encoding
the text gives the merged ``ab``; its chat template renders user, assistant
and tool turns. The scripted engine answers a prompt by how many tool results
it already holds: turn 0 a call ``<tool_call>mul 6 7</tool_call>``, turn 1
``ab`` and EOS. Checked exactly: the response is the sampled ids followed by
the template's context ids followed by the next sampled ids (decoding and
re-encoding the whole conversation would give other ids), the loss mask is 1
on sampled ids and 0 on context, context log-probs are 0, the trajectory
reaches the rewards, and ``to_sample_batch`` turns the mask into the batch's
response mask; the turn, token and tool-output limits; per-sample seeds (turn 0
one engine call over every request with its own seed, later turns
``mix_seed(mix_seed(seed, k), 0)``) and results under the requests' keys; with
TP2 only TP rank 0 runs tools and both ranks build identical sequences.
"""
import re
from dataclasses import dataclass

import pytest

from megarl.rollout.agent import AgentLoop, AgentOptions
from megarl.rollout.engine import GenerationResult, Request, SamplingParams, mix_seed, sample_requests

TEMPLATE = ("{% for m in messages %}{{ '<s>' + m['role'] + ':' + m['content'] + '</s>' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<s>assistant:' }}{% endif %}")


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = list("abcdefghijklmnopqrstuvwxyz0123456789 :*\n[](){}\",_")
    vocab = {c: i for i, c in enumerate(chars)}
    vocab["ab"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")]))
    tok.decoder = decoders.Fuse()  # tokens joined as they are
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>")
    fast.add_special_tokens({"additional_special_tokens": ["<s>", "<tool_call>", "</tool_call>"]})
    fast.chat_template = TEMPLATE
    return fast


@dataclass
class Out:  # what the tool executor returns per call
    text: str
    ok: bool = True
    truncated: bool = False


@dataclass
class Call:
    name: str
    arguments: dict


def parse(text: str):
    calls = [Call("mul", {"a": int(a), "b": int(b)}) for a, b in re.findall(r"<tool_call>mul (\d+) (\d+)</tool_call>", text)]
    return calls, []


class Executor:
    def __init__(self, allowed=True):
        self.calls, self.allowed = [], allowed

    def run(self, calls):
        assert self.allowed, "tools ran on a rank other than the replica's first"
        self.calls += calls
        return [Out(str(c.arguments["a"] * c.arguments["b"]) * 3) for c in calls]


class ScriptedEngine:
    """Turn k of a sample: script[k] (cut at max_new_tokens); k = tool results already in the prompt."""

    def __init__(self, tok):
        self.tok, self.calls = tok, []
        end, a, b = (tok.convert_tokens_to_ids(t) for t in ("</tool_call>", "a", "b"))
        self.script = [tok.encode("<tool_call>mul 6 7", add_special_tokens=False) + [end], [a, b, tok.eos_token_id]]
        self.marker = tok.encode("tool:", add_special_tokens=False)
        self.stats = {"rollout/decode_steps": 1.0}

    def generate(self, requests, params):
        self.calls.append({"prompts": [r.prompt for r in requests], "seeds": [r.seed for r in requests],
                           "limits": [r.max_new_tokens for r in requests], "stops": tuple(params.stop_token_ids)})
        out = []
        for r in requests:
            p = r.prompt
            turn = sum(p[j:j + len(self.marker)] == self.marker for j in range(len(p)))
            ids = self.script[min(turn, 1)][: r.max_new_tokens]
            stop = bool(ids) and ids[-1] in params.stop_token_ids + (self.tok.eos_token_id,)
            out.append(GenerationResult(list(p), ids, [-0.5] * len(ids), "stop" if stop else "length", r.key))
        return out


def _one(prompt, max_new_tokens):
    """A single request (key 0, seed 0) for ``prompt``."""
    return [Request(0, prompt, 0, max_new_tokens)]


def _loop(tok, engine, executor=None, max_turns=4, max_tool_output_tokens=64, groups=None, interaction=None):
    options = AgentOptions(tok.convert_tokens_to_ids("</tool_call>"), max_turns, max_tool_output_tokens)
    return AgentLoop(engine, tok, executor or Executor(), parse, options, groups, interaction)


def test_response_is_sampled_ids_plus_context_ids_with_a_loss_mask():
    tok = make_tokenizer()
    engine = ScriptedEngine(tok)
    prompts = [tok.encode("<s>user:mul</s><s>assistant:"), tok.encode("<s>user:again</s><s>assistant:")]
    requests = sample_requests(prompts, 2, 3, 60)
    results = _loop(tok, engine).generate(requests[::-1], SamplingParams())  # results follow the request order
    context = tok.encode("</s><s>tool:424242</s><s>assistant:", add_special_tokens=False)
    first, second = engine.script
    assert [r.key for r in results] == [3, 2, 1, 0]
    for r in results:
        assert r.response_ids == first + context + second
        assert r.loss_mask == [1] * len(first) + [0] * len(context) + [1] * len(second)
        assert r.logprobs == [-0.5] * len(first) + [0.0] * len(context) + [-0.5] * len(second)
        assert r.finish_reason == "stop"
        assert r.extra["final_turn_ids"] == second and r.extra["turns"] == 2 and r.extra["tool_calls"] == 1
        assert [m["role"] for m in r.extra["trajectory"]] == ["assistant", "tool", "assistant"]
        assert r.extra["trajectory"][1]["content"] == "424242"
        whole = r.prompt_ids + r.response_ids  # what decode-then-retokenize would have trained on
        assert tok.encode(tok.decode(whole), add_special_tokens=False) != whole
    # turn 0: one call over every request, its own seed as is; turn 1: each sample's turn seed
    seeds = [mix_seed(mix_seed(3, i), j) for i in range(2) for j in range(2)][::-1]
    assert engine.calls[0]["seeds"] == seeds and engine.calls[0]["prompts"] == [r.prompt for r in requests[::-1]]
    assert engine.calls[0]["stops"][-1] == tok.convert_tokens_to_ids("</tool_call>")
    assert engine.calls[1]["seeds"] == [mix_seed(mix_seed(s, 1), 0) for s in seeds]
    assert engine.calls[1]["limits"] == [60 - len(first) - len(context)] * 4


def test_loss_mask_becomes_the_batch_response_mask():
    from megarl.trainer.rollout import to_sample_batch

    tok = make_tokenizer()
    prompt = tok.encode("<s>user:mul</s><s>assistant:")
    (r,) = _loop(tok, ScriptedEngine(tok)).generate(_one(prompt, 60), SamplingParams())
    batch = to_sample_batch([r], 0, "cpu")
    p = len(prompt)
    assert batch.response_mask[0, :p].sum() == 0
    assert batch.response_mask[0, p:p + len(r.response_ids)].tolist() == [float(m) for m in r.loss_mask]
    assert batch.rollout_logprobs[0, p:p + len(r.response_ids)].tolist() == r.logprobs


def test_turn_budget_and_tool_output_limits():
    tok = make_tokenizer()
    prompt = tok.encode("<s>user:mul</s><s>assistant:")
    first = ScriptedEngine(tok).script[0]
    (r,) = _loop(tok, ScriptedEngine(tok), max_turns=1).generate(_one(prompt, 60), SamplingParams())
    assert r.finish_reason == "max_turns" and r.response_ids == first and r.loss_mask == [1] * len(first)
    (r,) = _loop(tok, ScriptedEngine(tok)).generate(_one(prompt, len(first) + 5), SamplingParams())
    assert r.finish_reason == "length" and r.response_ids == first  # no room to sample after the tool result
    (r,) = _loop(tok, ScriptedEngine(tok)).generate(_one(prompt, 8), SamplingParams())
    assert r.finish_reason == "length" and len(r.response_ids) == 8
    (r,) = _loop(tok, ScriptedEngine(tok), max_tool_output_tokens=2).generate(_one(prompt, 90), SamplingParams())
    tool = r.extra["trajectory"][1]["content"]
    assert tool.startswith("42\n") and "4 of 6 tokens dropped" in tool


class FailingExecutor(Executor):
    def run(self, calls):
        self.calls += calls
        return [Out("error: mul timed out", ok=False) for c in calls]


def test_tool_metrics_count_calls_errors_and_truncations():
    """Two samples, one call each, a turn after it: per sample 2 turns, 1 call; a cut output
    (max_tool_output_tokens=2 of 6 tokens) counts as a truncation, a failed call as an error."""
    tok = make_tokenizer()
    prompt = tok.encode("<s>user:mul</s><s>assistant:")
    two = [Request(k, prompt, k, 90) for k in range(2)]
    loop = _loop(tok, ScriptedEngine(tok), max_tool_output_tokens=2)
    loop.generate(two, SamplingParams())
    stats = {k: v for k, v in loop.stats.items() if k.startswith("agent/tool") or k == "agent/turns_mean"}
    assert stats == {"agent/turns_mean": 2.0, "agent/tool_calls_mean": 1.0, "agent/tool_errors_mean": 0.0,
                     "agent/tool_truncations_mean": 1.0}
    loop = _loop(tok, ScriptedEngine(tok), executor=FailingExecutor())
    loop.generate(two, SamplingParams())
    assert (loop.stats["agent/tool_errors_mean"], loop.stats["agent/tool_truncations_mean"]) == (1.0, 0.0)


def test_interaction_adds_user_turns_until_it_returns_none():
    tok = make_tokenizer()
    seen = []

    def user(messages):
        seen.append(len(messages))
        return "more" if len(seen) == 1 else None

    prompt = tok.encode("<s>user:mul</s><s>assistant:")
    (r,) = _loop(tok, ScriptedEngine(tok), interaction=user).generate(_one(prompt, 90), SamplingParams())
    roles = [m["role"] for m in r.extra["trajectory"]]
    assert roles == ["assistant", "tool", "assistant", "user", "assistant"] and seen == [3, 5]
    assert r.finish_reason == "stop"


def _tp_rank(rank):
    from megarl.distributed import build_parallel_groups, init_distributed

    init_distributed()
    groups = build_parallel_groups(2, 1)
    tok = make_tokenizer()
    executor = Executor(allowed=groups.tp_rank == 0)
    requests = sample_requests([tok.encode("<s>user:mul</s><s>assistant:")], 2, 0, 60)
    results = _loop(tok, ScriptedEngine(tok), executor, groups=groups).generate(requests, SamplingParams())
    return {"ids": [r.response_ids for r in results], "tool_runs": len(executor.calls)}


def test_real_tools_through_the_factory_pieces():
    """Hermes JSON parsed, the calculator run in the executor, its result in the conversation."""
    from megarl.tools import ToolExecutor, parse_hermes, resolve_tools

    tok = make_tokenizer()
    engine = ScriptedEngine(tok)
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}'
    engine.script[0] = tok.encode(call, add_special_tokens=False) + [tok.convert_tokens_to_ids("</tool_call>")]
    options = AgentOptions(tok.convert_tokens_to_ids("</tool_call>"))
    with ToolExecutor(resolve_tools(["calculator"])) as executor:
        loop = AgentLoop(engine, tok, executor, parse_hermes, options)
        (r,) = loop.generate(_one(tok.encode("<s>user:mul</s><s>assistant:"), 120), SamplingParams())
    assert r.extra["trajectory"][1] == {"role": "tool", "name": "calculator", "content": "42"}
    assert r.finish_reason == "stop" and r.extra["final_turn_ids"] == engine.script[1]


def test_a_multi_token_tool_call_end_is_a_config_error():
    from transformers import AutoTokenizer

    from megarl.assets import TINY_DIR
    from megarl.errors import ConfigError
    from megarl.rollout.turns import single_token_id

    tiny = AutoTokenizer.from_pretrained(str(TINY_DIR / "tokenizer"))
    with pytest.raises(ConfigError, match=r"rollout.multi_turn.tool_call_end='</tool_call>' is \d+ tokens"):
        single_token_id(tiny, "</tool_call>", "rollout.multi_turn.tool_call_end")


def test_tools_run_on_tp_rank_zero_and_reach_every_rank():
    from dist_helpers import spawn

    a, b = spawn(_tp_rank, 2)
    assert a["ids"] == b["ids"] and a["tool_runs"] == 2 and b["tool_runs"] == 0
