"""The OpenAI endpoint on the native engine (``rollout.server``), called with the official ``openai`` client.

One spawned worker (gloo, CPU) builds the tiny tool task's SFT model and the engine through
``build_engine`` with ``yaml/tiny_agent_http.yaml`` and runs several rollouts whose agents (functions
of this module) call ``http://127.0.0.1:<free port>/samples/<id>/v1``. Checked:

* chat: the answer's ``prompt_token_ids`` are the dataset prompt's ids (the chat template), its
  ``token_ids`` and log-probs are exactly the ids and log-probs the trainer receives
  (``GenerationResult``), 64 sessions at once;
* tool calls: the agent of ``megarl/agents/calculator_http.py`` gets OpenAI ``tool_calls`` (the SFT
  model calls the calculator on some samples), runs them and sends the results back; a two-turn sample's trained sequence is turn 1's prompt + sampled ids + the template's tool context +
  turn 2's sampled ids, loss mask 1 exactly at sampled ids; with the agents on 2 worker processes
  (``rollout.server.agent_processes``) every sample is the same as on threads (log-probs to 1e-5:
  calls arrive in another order, so other batches);
* streaming: the SSE chunks rebuild the non-streamed message (with ``n`` and ``stop`` too); logprobs
  per token; chunks go out while the engine decodes (a request cannot finish before its client has
  received tokens), over several steps;
* bad requests (malformed JSON, unknown model, too many tokens, a changed temperature) get
  OpenAI-shaped 4xx errors and the rollout goes on; an agent that raises is a failed sample
  (loss mask 0, ``agent_http/failed_frac``), and so is one past ``rollout.server.timeout_s``.
Not covered: TP/PP (refused at config time), a GPU, the throughput of the endpoint.
"""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from dist_helpers import spawn

openai = pytest.importorskip("openai")
MODEL = "megarl-policy"
TIMEOUT_S, SLOW_S = 8.0, 16.0  # the bad-request rollout's agent time limit, and the slow agent's sleep


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
    """The same greedy call streamed and not: the chunks must rebuild the message."""
    client = _client(base_url)
    plain = client.chat.completions.create(model=MODEL, messages=sample["messages"], logprobs=True)
    text, calls, finish, logprobs = "", [], None, []
    for chunk in client.chat.completions.create(model=MODEL, messages=sample["messages"], logprobs=True,
                                                stream=True):
        for c in chunk.choices:
            text += c.delta.content or ""
            calls += [(t.function.name, t.function.arguments) for t in c.delta.tool_calls or []]
            logprobs += [t.logprob for t in (c.logprobs.content if c.logprobs else None) or []]
            finish = c.finish_reason or finish
    m, choice = plain.choices[0].message, plain.choices[0]
    want_calls = [(t.function.name, t.function.arguments) for t in m.tool_calls or []]
    return {"stream": [text, calls, finish], "plain": [m.content or "", want_calls, choice.finish_reason],
            "logprobs": [logprobs, [t.logprob for t in choice.logprobs.content]] if not m.tool_calls else None}


def stop_stream_agent(sample, base_url):
    """n=2 with a stop string, streamed and not (greedy: the same tokens): the same texts per choice."""
    client = _client(base_url)
    kwargs = dict(model=MODEL, messages=sample["messages"], n=2, stop=["*"])
    plain = client.chat.completions.create(**kwargs)
    texts, ids = ["", ""], [None, None]
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            ids[c.index] = (c.model_extra or {}).get("token_ids") or ids[c.index]
    return {"stream": [texts, ids], "plain": [[c.message.content or "" for c in plain.choices],
                                              [c.model_extra["token_ids"] for c in plain.choices]]}


FIRST_TOKENS = threading.Event()  # set by live_agent when a chunk with tokens arrives


def live_agent(sample, base_url):
    """A streamed call with log-probs: per chunk the number of tokens it carries (its log-prob entries)."""
    chunks = []
    for chunk in _client(base_url).chat.completions.create(model=MODEL, messages=sample["messages"], logprobs=True,
                                                           stream=True):
        for c in chunk.choices:
            tokens = len((c.logprobs.content if c.logprobs else None) or [])
            if tokens:
                FIRST_TOKENS.set()
            chunks.append({"tokens": tokens, "finish": c.finish_reason, "token_ids": (c.model_extra or {}).get("token_ids")})
    return {"chunks": chunks}


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
    try:
        _client(base_url).chat.completions.create(model=MODEL, messages=sample["messages"], max_tokens=10_000)
    except openai.BadRequestError as e:
        out["client_error"] = [e.status_code, e.code]
    out["ok"] = _post(url, json.dumps({**good, "n": 2, "max_tokens": 4}).encode())
    if sample["key"] % 2:
        raise RuntimeError("agent bug")
    if sample["key"] == 2:
        time.sleep(SLOW_S)  # past rollout.server.timeout_s
    return out


def _run(rank):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.cli import load_config
    from megarl.config import Config
    from megarl.data import PromptBatch, PromptDataConfig, load_prompt_dataset
    from megarl.data.tokenizer import load_tokenizer
    from megarl.tools import parse_hermes
    from megarl.tools.calculator import calculate
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
    from megarl.rollout.agent_workers import AgentProcesses

    threads, engine.workers = engine.workers, AgentProcesses(workers=8, processes=2)
    out["tools_processes"] = rollout(solve, 16, n=4, temperature=1.0)  # rollout.server.agent_processes=2
    engine.workers.close()
    engine.workers = threads
    from functools import partial

    from megarl.agents.calculator_env import CalculatorEnv
    from megarl.agents.environment import run_episode
    out["env"] = rollout(partial(run_episode, CalculatorEnv, max_turns=2, model=MODEL), 16, n=2, temperature=1.0)
    out["stream"] = rollout(stream_agent, 4)
    out["stop_stream"] = rollout(stop_stream_agent, 4)
    queue, plain_finished, gate = engine.state.queue, engine.state.queue.finished, []

    def gated(key, result):  # the request cannot finish before its client holds a chunk with tokens
        gate.append(FIRST_TOKENS.wait(timeout=30))
        plain_finished(key, result)

    queue.finished = gated
    out["live"], out["gate"] = rollout(live_agent, 1), gate
    queue.finished = plain_finished
    engine.timeout_s = TIMEOUT_S
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


def test_tool_calls_train_the_sampled_ids_and_the_template_context(run):
    """The calculator agent: samples that called the tool have two turns; the trained response is
    turn 1's sampled ids (ending in </tool_call>), the tool context (mask 0), turn 2's sampled ids."""
    results, stats = run["tools"]
    assert stats["agent_http/failed_frac"] == 0.0 and stats["agent_http/chain_resets_mean"] == 0.0
    two = [r for r in results if r[6]["calls"] == 2]
    assert 0 < len(two) < len(results)  # the SFT model calls the calculator on some samples only
    right = 0
    from megarl.rewards import math_answer_reward
    from megarl.data.tokenizer import load_tokenizer
    from megarl.tools import parse_hermes
    from megarl.tools.calculator import calculate

    tok = load_tokenizer("megarl/assets/tiny_tools/sft")
    end = tok.convert_tokens_to_ids("</tool_call>")
    for key, prompt, response, logprobs, mask, finish, extra in two:
        first = mask.index(0)
        assert response[first - 1] == end and all(mask[:first])
        context_end = first + mask[first:].index(1)
        context = tok.decode(response[first:context_end])
        assert context.startswith("<|im_end|>\n<|im_start|>tool\n") and context.endswith("<|im_start|>assistant\n")
        assert all(mask[context_end:]) and extra["final_turn_ids"] == response[context_end:]
        assert all(lp == 0.0 for lp in logprobs[first:context_end])
        a = run["answers"][key // 4]
        right += math_answer_reward(tok.decode(extra["final_turn_ids"], skip_special_tokens=True), a)
        (call,), _ = parse_hermes(tok.decode(response[:first]))
        assert context.split("\n")[2].removesuffix("<|im_end|>") == calculate(call.arguments["expression"])
    assert right >= 0.6 * len(two)


def test_agents_in_worker_processes_give_the_same_samples(run):
    """The calculator agent on 2 worker processes: each sample's ids, log-probs and reward as on threads."""
    (threads, _), (processes, stats) = run["tools"], run["tools_processes"]
    assert stats["agent_http/failed_frac"] == 0.0 and len(processes) == len(threads) == 64
    for got, want in zip(processes, threads):  # log-probs: requests arrive in other orders, other batches
        assert got[:3] == want[:3] and got[4:6] == want[4:6] and got[6]["agent_reward"] == want[6]["agent_reward"]
        assert got[3] == pytest.approx(want[3], abs=1e-5)


def test_streaming_rebuilds_the_message(run):
    results, stats = run["stream"]
    assert stats["agent_http/failed_frac"] == 0.0
    for r in results:
        got = r[6]["agent_result"]
        assert got["stream"] == got["plain"] and got["plain"][0] or got["plain"][1]
        if got["logprobs"] is not None:
            # two calls of one prompt: the same tokens; log-probs to float32 rounding (the second call
            # reads the first's K/V pages from the prefix cache)
            assert got["logprobs"][0] == pytest.approx(got["logprobs"][1], abs=1e-4) and got["logprobs"][0]


def test_streamed_stop_strings_cut_as_the_plain_call(run):
    results, stats = run["stop_stream"]
    assert stats["agent_http/failed_frac"] == 0.0
    for r in results:
        got = r[6]["agent_result"]
        assert got["stream"] == got["plain"] and all(got["plain"][1])


def test_streaming_is_live_chunks_arrive_while_the_engine_decodes(run):
    """The request's ``finished`` is held until its client has received a chunk with tokens (30 s at
    most): a stream that only sent the finished turn would time out there. Tokens come over several
    chunks (engine steps), and add up to the trained response."""
    results, stats = run["live"]
    (key, prompt, response, logprobs, mask, finish, extra) = results[0]
    chunks = extra["agent_result"]["chunks"]
    assert run["gate"] == [True]
    assert sum(c["tokens"] > 0 for c in chunks) >= 2 and len(response) >= 2
    assert sum(c["tokens"] for c in chunks) == len(response)
    assert chunks[-1]["finish"] in ("stop", "length", "tool_calls") and chunks[-1]["token_ids"] == response


def test_bad_requests_get_openai_errors_and_failing_agents_are_failed_samples(run):
    results, stats = run["bad"]
    assert stats["agent_http/failed_frac"] == 0.75 and stats["agent_http/bad_requests"] == 4 * 6
    for key, prompt, response, logprobs, mask, finish, extra in results:
        if key % 2:
            assert finish == "failed" and not any(mask) and "agent bug" in extra["agent_error"]
            continue
        if key == 2:  # timed out: its calls were answered, but the sample trains nothing
            assert finish == "failed" and not any(mask) and extra["agent_error"] == "timed out"
            assert extra["calls"] == 1 and len(response) <= 4
            continue
        got = extra["agent_result"]
        codes = {k: got[k][0] for k in ("json", "model", "tokens", "temperature", "n")}
        assert codes == {"json": 400, "model": 404, "tokens": 400, "temperature": 400, "n": 400}
        assert got["model"][1]["error"]["code"] == "model_not_found"
        assert got["tokens"][1]["error"]["code"] == "context_length_exceeded"
        assert got["client_error"] == [400, "context_length_exceeded"]  # what the openai client raises
        status, body = got["ok"]
        assert status == 200 and len(body["choices"]) == 2
        assert all(len(c["token_ids"]) <= 4 for c in body["choices"])
        assert response == body["choices"][0]["token_ids"] and all(mask)  # choice 0 is the trajectory


def test_environment_episodes_reward_the_final_turn_token_in_token_out(run):
    """rollout.server.environment: the calculator task as reset/step; the episode's reward is the math
    reward of its last assistant turn, and the trained ids are sampled (mask 1) + observations (mask 0)."""
    from megarl.data.tokenizer import load_tokenizer
    from megarl.rewards import math_answer_reward

    tok = load_tokenizer("megarl/assets/tiny_tools/sft")
    results, stats = run["env"]
    assert stats["agent_http/failed_frac"] == 0.0
    turns = [r[6]["agent_result"]["turns"] for r in results]
    assert 1 in turns and 2 in turns
    for key, prompt, response, logprobs, mask, finish, extra in results:
        final = tok.decode(extra["final_turn_ids"], skip_special_tokens=True)
        done = extra["agent_result"]["done"]
        assert extra["agent_reward"] == (math_answer_reward(final, run["answers"][key // 2]) if done else 0.0)
        assert prompt == run["prompts"][key // 2]
        assert (0 in mask) == (extra["calls"] == 2)  # a second turn follows the tool observation's context
        assert all(lp == 0.0 for lp, m in zip(logprobs, mask) if m == 0)
