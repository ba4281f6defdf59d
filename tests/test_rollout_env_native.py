"""An environment in the agent loop on the native engine, built by the factory from a config.

One spawned worker (gloo, CPU): ``yaml/tiny_tools.yaml`` with
``rollout.multi_turn.environment=megarl.agents.calculator_env:CalculatorEnv`` (the tiny tool task as
reset/step: the calculator runs inside ``step``, the episode ends with the math reward of the answer
turn), 16 prompts x 2 samples at temperature 1, the rows bound as the trainer binds them. Checked:

* the reset's messages (the row's) give the dataset prompt's ids under the chat template;
* samples that called the calculator (counted as tool calls) have two turns: sampled ids ending in ``</tool_call>`` (mask 1),
  the template's tool context with the calculator's result (mask 0, log-prob 0), the answer turn
  (mask 1); the others one turn;
* each sample's ``agent_reward`` is the math reward of its last turn when the episode ended there
  (0 at ``max_turns``), and the reward term ``agent`` reads it;
* the overlapped schedule (steps run while other samples decode) gives the turn-by-turn samples:
  the same ids, masks and rewards, log-probs to 1e-5.
Not covered: TP/PP (the environment runs on the first rank as tools do; ``test_rollout_agent.py``
covers that broadcast), a GPU.
"""
from __future__ import annotations

import json

import pytest

from dist_helpers import spawn

ENV = "megarl.agents.calculator_env:CalculatorEnv"


def _run(rank):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.cli import load_config
    from megarl.config import Config
    from megarl.data import PromptDataConfig, load_prompt_dataset
    from megarl.data.tokenizer import load_tokenizer
    from megarl.distributed import build_parallel_groups, init_distributed
    from megarl.roles.build import build_actor
    from megarl.rollout.engine import SamplingParams, sample_requests
    from megarl.rollout.factory import build_engine
    from megarl.trainer.rollout import bind_items

    init_distributed()
    groups = build_parallel_groups(1, 1)
    model_parallel_cuda_manual_seed(0)
    out = {}
    for overlap in (False, True):
        cfg = load_config(["yaml/tiny_tools.yaml", "rollout.kv_cache_gb=0.05", f"rollout.multi_turn.environment={ENV}",
                           f"rollout.multi_turn.overlap_tools={str(overlap).lower()}"], Config)
        actor = build_actor(cfg, groups, optimizer_steps=1)
        tok = load_tokenizer(cfg.model.path)
        data = load_prompt_dataset(PromptDataConfig.from_section(cfg.data, cfg.data.eval_path), tok)
        items = [data[i] for i in range(16)]
        engine = build_engine(cfg, actor, groups, tok, [tok.eos_token_id], tok.pad_token_id)
        bind_items(engine, {k: items[k // 2] for k in range(32)})
        results = engine.generate(sample_requests([it.prompt_ids for it in items], 2, 5, cfg.rollout.max_new_tokens),
                                  SamplingParams(temperature=1.0))
        out[overlap] = [(r.key, r.prompt_ids, r.response_ids, r.logprobs, r.loss_mask, r.finish_reason, r.extra)
                        for r in results]
        out["stats", overlap] = dict(engine.stats)
    out["prompts"], out["answers"] = [it.prompt_ids for it in items], [it.answer for it in items]
    return out


@pytest.fixture(scope="module")
def run():
    (r,) = spawn(_run, 1)
    return r


def test_calculator_env_episodes_on_the_native_engine(run):
    from megarl.data.tokenizer import load_tokenizer
    from megarl.rewards import math_answer_reward
    from megarl.rewards.registry import agent_term
    from megarl.tools import parse_hermes
    from megarl.agents.calculator_http import run_tool

    tok = load_tokenizer("megarl/assets/tiny_tools/sft")
    end = tok.convert_tokens_to_ids("</tool_call>")
    results = run[False]
    assert run["stats", False]["agent/env_failed_frac"] == 0.0
    turns = [r[6]["turns"] for r in results]
    assert 1 in turns and 2 in turns  # the SFT model calls the calculator on some samples only
    for key, prompt, response, logprobs, mask, finish, extra in results:
        assert prompt == run["prompts"][key // 2] and extra["agent_failed"] is False
        final = tok.decode(extra["final_turn_ids"], skip_special_tokens=True)
        want = math_answer_reward(final, run["answers"][key // 2]) if finish != "max_turns" else 0.0
        assert extra["agent_reward"] == want == agent_term("", final, None, extra)
        if extra["turns"] == 1:
            assert mask == [1] * len(response) and extra["tool_calls"] == 0  # the answer ended the episode
            continue
        assert extra["tool_calls"] >= 1  # the calls of turn 1 (as OpenAI tool_calls), counted in agent/tool_calls
        first = mask.index(0)
        context_end = first + mask[first:].index(1)
        assert response[first - 1] == end and all(mask[:first]) and all(mask[context_end:])
        assert all(lp == 0.0 for lp in logprobs[first:context_end])
        context = tok.decode(response[first:context_end])
        assert context.startswith("<|im_end|>\n<|im_start|>tool\n") and context.endswith("<|im_start|>assistant\n")
        (call,), _ = parse_hermes(tok.decode(response[:first]))
        tool = run_tool(call.name, json.dumps(call.arguments))  # what CalculatorEnv.step answers
        assert context.split("\n")[2].removesuffix("<|im_end|>") == tool
    assert sum(r[6]["agent_reward"] for r in results) > 0


def test_overlapped_env_steps_give_the_turn_by_turn_samples(run):
    for a, b in zip(run[False], run[True]):
        assert a[:3] == b[:3] and a[4:6] == b[4:6]
        assert a[3] == pytest.approx(b[3], abs=1e-5)
        assert (a[6]["agent_reward"], a[6]["turns"]) == (b[6]["agent_reward"], b[6]["turns"])
