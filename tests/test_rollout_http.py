"""The OpenAI endpoint on the native engine (``rollout.server``), called with the official ``openai`` client.

One spawned worker (gloo, CPU) builds the tiny tool task's SFT model and the engine through
``build_engine`` with ``yaml/tiny_agent_http.yaml`` and runs several rollouts whose agents (functions
of this module) call ``http://127.0.0.1:<free port>/samples/<id>/v1``. Checked:

* chat: the answer's ``prompt_token_ids`` are the dataset prompt's ids (the chat template), its
  ``token_ids`` and log-probs are exactly the ids and log-probs the trainer receives
  (``GenerationResult``), and greedy ids equal ``transformers``' greedy continuation;
* tool calls: the agent of ``megarl/agents/calculator_http.py`` gets OpenAI ``tool_calls`` (forced by
  a prompt that ends in ``<tool_call>``... not needed: the SFT model calls it on some prompts), and a
  two-turn sample's trained sequence is turn 1's prompt + sampled ids + the template's tool context +
  turn 2's sampled ids, loss mask 1 exactly at sampled ids;
* streaming: the SSE chunks rebuild the non-streamed message; logprobs per token;
* 64 concurrent sessions in one rollout, every one answered;
* bad requests (malformed JSON, unknown model, too many tokens, a changed temperature) get
  OpenAI-shaped 4xx errors and the rollout goes on; an agent that raises is a failed sample
  (loss mask 0, ``agent_http/failed_frac``).
Not covered: TP/PP (refused at config time), a GPU, the throughput of the endpoint.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from dist_helpers import spawn

openai = pytest.importorskip("openai")
MODEL = "megarl-policy"


def _client(base_url):
    return openai.OpenAI(base_url=base_url, api_key="local", max_retries=0, timeout=120)


def chat_agent(sample, base_url):
    """One greedy chat turn with logprobs; returns the reply as a dict."""
    reply = _client(base_url).chat.completions.create(model=MODEL, messages=sample["messages"], logprobs=True)
    choice = reply.choices[0]
    return {"reward": 0.5, "prompt_ids": reply.model_extra["prompt_token_ids"],
            "token_ids": choice.model_extra["token_ids"], "logprobs": [t.logprob for t in choice.logprobs.content],
            "message": choice.message.model_dump(exclude_none=True), "finish": choice.finish_reason}


def stream_agent(sample, base_url):
    """The same call streamed and not: the chunks must rebuild the message."""
    client = _client(base_url)
    plain = client.chat.completions.create(model=MODEL, messages=sample["messages"], logprobs=True)
    text, calls, finish = "", [], None
    for chunk in client.chat.completions.create(model=MODEL, messages=sample["messages"], logprobs=True,
                                                stream=True):
        for c in chunk.choices:
            text += c.delta.content or ""
            calls += [t.function.name for t in c.delta.tool_calls or []]
            finish = c.finish_reason or finish
    m = plain.choices[0].message
    return {"same": (text or None, calls, finish) == (m.content or (None if m.tool_calls else ""),
                                                     [t.function.name for t in m.tool_calls or []],
                                                     plain.choices[0].finish_reason) or (text == (m.content or "")
                                                                                         and finish == plain.choices[0].finish_reason)}


def _post(url, data: bytes):
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def bad_agent(sample, base_url):
    """Bad requests of each kind, then a good one: the errors are OpenAI-shaped, the sample goes on."""
    url = f"{base_url}/chat/completions"
    good = {"model": MODEL, "messages": sample["messages"]}
    out = {"json": _post(url, b"{not json"), "model": _post(url, json.dumps({**good, "model": "gpt-9"}).encode()),
           "tokens": _post(url, json.dumps({**good, "max_tokens": 10_000}).encode()),
           "temperature": _post(url, json.dumps({**good, "temperature": 0.3}).encode()),
           "n": _post(url, json.dumps({**good, "n": 0}).encode())}
    out["ok"] = _post(url, json.dumps({**good, "n": 2, "max_tokens": 4}).encode())
    if sample["key"] % 2:
        raise RuntimeError("agent bug")
    return out


def _run(rank):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.cli import load_config
    from megarl.config import Config
    from megarl.data import PromptBatch, PromptDataConfig, load_prompt_dataset
    from megarl.data.tokenizer import load_tokenizer
    from megarl.distributed import build_parallel_groups, init_distributed
    from megarl.roles.build import build_actor
    from megarl.rollout.engine import SamplingParams, sample_requests
    from megarl.rollout.factory import build_engine
    from megarl.trainer.rollout import bind_items

    init_distributed()
    groups = build_parallel_groups(1, 1)
    model_parallel_cuda_manual_seed(0)
    cfg = load_config(["yaml/tiny_agent_http.yaml", "rollout.kv_cache_gb=0.05",
                       "rollout.server.agent=test_rollout_http:chat_agent"], Config)
    actor = build_actor(cfg, groups, optimizer_steps=1)
    tok = load_tokenizer(cfg.model.path)
    data = load_prompt_dataset(PromptDataConfig.from_section(cfg.data, cfg.data.eval_path), tok)
    items = [data[i] for i in range(64)]
    engine = build_engine(cfg, actor, groups, tok, [tok.eos_token_id], tok.pad_token_id)

    def rollout(agent, k, n=1, temperature=0.0):
        engine.agent = agent
        bind_items(engine, {i * n + j: items[i] for i in range(k) for j in range(n)})
        res = engine.generate(sample_requests([it.prompt_ids for it in items[:k]], n, 3, cfg.rollout.max_new_tokens),
                              SamplingParams(temperature=temperature))
        return [(r.key, r.prompt_ids, r.response_ids, r.logprobs, r.loss_mask, r.finish_reason, r.extra) for r in res], \
            dict(engine.stats)

    from megarl.agents.calculator_http import solve
    out = {"prompts": [it.prompt_ids for it in items], "answers": [it.answer for it in items]}
    out["chat"] = rollout(chat_agent, 64)
    out["tools"] = rollout(solve, 16, n=4, temperature=1.0)
    out["stream"] = rollout(stream_agent, 4)
    out["bad"] = rollout(bad_agent, 4)
    engine.close()
    return out


@pytest.fixture(scope="module")
def run():
    (r,) = spawn(_run, 1)
    return r


def test_chat_ids_and_logprobs_are_what_the_trainer_gets(run):
    results, stats = run["chat"]
    assert len(results) == 64 and stats["agent_http/failed_frac"] == 0.0
    for key, prompt, response, logprobs, mask, finish, extra in results:
        got = extra["agent_result"]
        assert extra["agent_reward"] == 0.5
        assert got["prompt_ids"] == prompt == run["prompts"][key]  # the chat template gave the dataset's ids
        assert got["token_ids"] == response and mask == [1] * len(response)
        assert got["logprobs"] == pytest.approx(logprobs, abs=1e-6)
        assert all(lp <= 0.0 for lp in logprobs)
