"""The tiny tool-use task (megarl/assets/tiny_tools/) as shipped: files, tokenizer, lengths, SFT model.

Checked: ``make_assets.py`` regenerates every shipped data and tokenizer file
byte-identically; ``<tool_call>`` / ``</tool_call>`` are single tokens for
megarl's loader and for ``AutoTokenizer``; every SFT row, prompt and response
fits ``yaml/tiny_tools_sft.yaml``'s ``sft.max_len``, ``yaml/tiny_tools.yaml``'s
``data.max_prompt_len`` / ``rollout.max_new_tokens`` and the model's positions;
an SFT row is exactly what the agent loop produces for the same conversation
(the call parses, the appended tool message is ``TurnRenderer``'s ids); the
SFT mix is 40% calls. Through the real agent loop on the native engine
(``build_engine`` on the yaml's config, real calculator) the shipped SFT model
calls the calculator on part of its sampled responses, and once a call is
started (first token forced) greedy decoding completes it with the prompt's
operands and answers with the tool's result.

Not covered: the RL run itself (``torchrun ... yaml/tiny_tools.yaml``, about a
minute; README.md gives its numbers) and regeneration of the SFT weights.
"""
from __future__ import annotations

import filecmp
import json
from pathlib import Path

import pytest

from dist_helpers import spawn
from megarl.assets import asset_path
from megarl.cli import load_config
from megarl.config import Config
from megarl.data.tokenizer import load_tokenizer
from megarl.rollout.turns import TurnRenderer, single_token_id
from megarl.tools import parse_hermes
from megarl.tools.calculator import calculate

ROOT = asset_path("tiny_tools")
GENERATED = ["train.jsonl", "test.jsonl", "sft.jsonl", "init/config.json", "init/tokenizer.json",
             "init/tokenizer_config.json", "sft/tokenizer.json", "sft/tokenizer_config.json"]
PROMPTS = 16  # held-out prompts the agent-loop test runs
REPO = Path(__file__).resolve().parents[1]  # the yaml files name their assets relative to it


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)


def rows(name):
    return [json.loads(line) for line in (ROOT / name).read_text().splitlines()]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(ROOT / "sft"))


def prompt_ids(tok, prompt):
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def test_assets_regenerate_byte_identically(tmp_path):
    from megarl.assets.tiny_tools.make_assets import main

    main(tmp_path)
    for name in GENERATED:
        assert filecmp.cmp(ROOT / name, tmp_path / name, shallow=False), name


def test_tool_markers_are_single_tokens(tok):
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(str(ROOT / "sft"))
    for t in (tok, auto):
        assert t.encode("<tool_call></tool_call>", add_special_tokens=False) == [5, 6]
        assert single_token_id(t, "</tool_call>", "rollout.multi_turn.tool_call_end") == 6
        assert (t.eos_token_id, t.pad_token_id) == (3, 0)
    sample = rows("sft.jsonl")[3]["response"]
    assert tok.encode(sample, add_special_tokens=False) == auto.encode(sample, add_special_tokens=False)


def test_lengths_fit_the_configs_and_positions(tok):
    rl = load_config(["yaml/tiny_tools.yaml"], Config)
    sft = load_config(["yaml/tiny_tools_sft.yaml"], Config)
    positions = json.loads((ROOT / "sft" / "config.json").read_text())["max_position_embeddings"]
    assert rl.data.max_prompt_len + rl.rollout.max_new_tokens <= positions and sft.sft.max_len <= positions
    for r in rows("test.jsonl") + rows("train.jsonl"):
        assert len(prompt_ids(tok, r["prompt"])) <= rl.data.max_prompt_len
    longest = 0
    for r in rows("sft.jsonl"):
        response = len(tok.encode(r["response"], add_special_tokens=False)) + 1  # + eos
        longest = max(longest, response)
        assert len(prompt_ids(tok, r["prompt"])) + response <= sft.sft.max_len
    assert longest <= rl.rollout.max_new_tokens


def test_sft_row_is_what_the_agent_loop_appends(tok):
    """prompt + response of a calling row == prompt + the sampled call + TurnRenderer's tool context
    + the answer, as ids; the call parses and the calculator returns the answer."""
    row = next(r for r in rows("sft.jsonl") if r["response"].startswith("<tool_call>"))
    a, b = map(int, row["prompt"].removeprefix("what is ").removesuffix("?").split("*"))
    call, rest = row["response"].split("</tool_call>")
    call += "</tool_call>"
    (parsed,), problems = parse_hermes(call)
    assert not problems and parsed.name == "calculator" and parsed.arguments == {"expression": f"{a}*{b}"}
    result = calculate(parsed.arguments["expression"])
    assert result == str(a * b)
    context = TurnRenderer(tok).ids_after_assistant([{"role": "tool", "name": "calculator", "content": result}])
    answer = tok.encode(f"#### {result}", add_special_tokens=False)
    ids = tok.encode(row["response"], add_special_tokens=False)
    assert ids == tok.encode(call, add_special_tokens=False) + context + answer
    assert tok.decode(prompt_ids(tok, row["prompt"]) + ids, skip_special_tokens=False) == \
        tok.apply_chat_template([{"role": "user", "content": row["prompt"]}], add_generation_prompt=True,
                                tokenize=False) + row["response"]


def test_data_splits_and_sft_mix():
    test, train, sft = rows("test.jsonl"), rows("train.jsonl"), rows("sft.jsonl")
    assert (len(test), len(train), len(sft)) == (200, 2000, 4000)
    key = lambda p: frozenset(p.removeprefix("what is ").removesuffix("?").split("*"))
    keys = [{key(r["prompt"]) for r in x} for x in (test, train, sft)]
    assert not keys[0] & keys[1] and not keys[0] & keys[2] and not keys[1] & keys[2]
    for r in test + train:
        a, b = map(int, r["prompt"].removeprefix("what is ").removesuffix("?").split("*"))
        assert r["answer"] == str(a * b) and len(r["answer"]) == 5
    calls = [r for r in sft if r["response"].startswith("<tool_call>")]
    assert len(calls) == 1600  # SFT_CALLS = 0.4 of 4000
    for r in sft:
        a, b = map(int, r["prompt"].removeprefix("what is ").removesuffix("?").split("*"))
        assert r["response"].endswith(f"#### {a * b}")


def _agent_run(rank):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.data import PromptDataConfig, load_prompt_dataset
    from megarl.distributed import build_parallel_groups, init_distributed
    from megarl.roles.build import build_actor
    from megarl.rollout.engine import SamplingParams, sample_requests
    from megarl.rollout.factory import build_engine

    init_distributed()
    groups = build_parallel_groups(1, 1)
    model_parallel_cuda_manual_seed(0)
    cfg = load_config(["yaml/tiny_tools.yaml", "rollout.kv_cache_gb=0.05"], Config)
    actor = build_actor(cfg, groups, optimizer_steps=1)
    tok = load_tokenizer(cfg.model.path)
    data = load_prompt_dataset(PromptDataConfig.from_section(cfg.data, cfg.data.eval_path), tok)
    items = [data[i] for i in range(PROMPTS)]
    loop = build_engine(cfg, actor, groups, tok, [tok.eos_token_id], tok.pad_token_id)
    sampled = loop.generate(sample_requests([it.prompt_ids for it in items], 4, 7, cfg.rollout.max_new_tokens),
                            SamplingParams(temperature=1.0))
    loop.parser = lambda text: parse_hermes("<tool_call>" + text)  # the call's first token is in the prompt
    start = tok.convert_tokens_to_ids("<tool_call>")
    forced = loop.generate(sample_requests([it.prompt_ids + [start] for it in items], 1, 0,
                                           cfg.rollout.max_new_tokens - 1), SamplingParams(temperature=0.0))
    show = lambda rs, n: [(r.key // n, r.extra["trajectory"], tok.decode(r.extra["final_turn_ids"],
                                                                         skip_special_tokens=True)) for r in rs]
    return {"answers": [it.answer for it in items], "sampled": show(sampled, 4), "forced": show(forced, 1)}


def test_shipped_sft_model_calls_the_calculator_through_the_agent_loop():
    """Sampled (temperature 1, n=4): some but not all conversations call the calculator (SFT: 40%), and
    most of those calls run and answer right. Forced to start a call: greedy completes it with the
    prompt's expression, and the answer turn copies the tool's result (the product)."""
    from megarl.rewards import math_answer_reward

    (r,) = spawn(_agent_run, 1)
    answers = r["answers"]
    called = [(i, final) for i, traj, final in r["sampled"] if any(m["role"] == "tool" for m in traj)]
    assert 0.15 <= len(called) / len(r["sampled"]) <= 0.7
    assert sum(math_answer_reward(final, answers[i]) for i, final in called) >= 0.6 * len(called)
    right = 0
    for i, traj, final in r["forced"]:
        tool = [m for m in traj if m["role"] == "tool"]
        assert len(tool) == 1 and tool[0]["content"] == answers[i]  # the call ran with the prompt's operands
        right += math_answer_reward(final, answers[i])
    assert right >= 0.8 * PROMPTS
