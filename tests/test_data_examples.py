"""The GSM8K / MATH example: yaml/qwen2.5-0.5b_gsm8k_math.yaml read with its hub sets swapped for
the shipped rows of the same shapes (megarl/assets/examples/), and the math reward on them."""
from __future__ import annotations

import dataclasses

from transformers import AutoTokenizer

from megarl.assets import asset_path
from megarl.cli import load_config
from megarl.config import Config
from megarl.data.build import build_eval_sets, build_train_data
from megarl.rewards.math_answer import ground_truth_answer, math_answer_reward

LOCAL = {"openai/gsm8k": "examples/gsm8k_sample.jsonl", "DigitalLearningGmbH/MATH-lighteval":
         "examples/math_sample.jsonl", "HuggingFaceH4/MATH-500": "examples/math_sample.jsonl"}


def local_copy(entry):
    return dataclasses.replace(entry, path=str(asset_path(LOCAL[entry.path])))


def test_example_yaml_reads_both_shapes():
    cfg = load_config(["yaml/qwen2.5-0.5b_gsm8k_math.yaml"], Config)
    assert cfg.model.path == "Qwen/Qwen2.5-0.5B-Instruct"
    assert [(s.weight, s.prompt_key, s.answer_key) for s in cfg.data.train_mix] == [
        (0.7, "question", "answer"), (0.3, "problem", "solution")]
    data = dataclasses.replace(cfg.data, batch_size=10, train_mix=[local_copy(s) for s in cfg.data.train_mix],
                               eval_sets=[local_copy(s) for s in cfg.data.eval_sets])
    tok = AutoTokenizer.from_pretrained(str(asset_path("tiny/tokenizer")))
    train, sampler = build_train_data(data, tok, 0, 1)
    assert len(train) == 12 and sampler.sizes == [6, 6]
    answers = [ground_truth_answer(it.answer) for it in train.items]
    assert answers == ["31", "190", "55", "900", "22", "150",
                       "\\frac{5}{6}", "6", "8", "5", "\\frac{1}{3}", "\\{-2, 2\\}"]
    assert train[6].extra == {"level": "Level 1", "type": "Prealgebra"}
    batch = sampler.next_batch(train)
    assert sum(i < 6 for i in batch.indices) == 7  # 70 / 30 of ten samples
    sets = build_eval_sets(data, tok)
    assert sorted(sets) == ["gsm8k", "math500"] and len(sets["math500"]) == 6
    responses = ["So 48 - 17 leaves #### 31", "The total is \\boxed{\\dfrac{5}{6}}."]
    assert math_answer_reward(responses[0], sets["gsm8k"][0].answer) == 1.0
    assert math_answer_reward(responses[1], sets["math500"][0].answer) == 1.0
    assert math_answer_reward("\\boxed{\\{-2,2\\}}", sets["math500"][5].answer) == 1.0
