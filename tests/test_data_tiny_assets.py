"""The tiny task's tokenizer and dataset files as shipped."""
from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from megarl.assets import asset_path

SPECIALS = {"<|pad|>": 0, "<|endoftext|>": 1, "<|im_start|>": 2, "<|im_end|>": 3, "<|unk|>": 4}
CHARS = "0123456789abcdefghijklmnopqrstuvwxyz \n+-*/=?.,:#!'()"  # ids 5.., the README's table
TOKENIZER_DIRS = ("tokenizer", "init", "sft")  # init/ and sft/ have a qwen2 config.json beside


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(asset_path("tiny/tokenizer")))


def rows(name):
    return [json.loads(l) for l in asset_path(f"tiny/{name}.jsonl").read_text().splitlines()]


def test_round_trip_and_char_level(tok):
    text = "12+7=? #### 19\nthe sum is: 19, ok!"
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text) and tok.decode(ids) == text
    assert len(tok) < 64


def test_special_tokens_single_ids(tok):
    for s, i in SPECIALS.items():
        assert tok(s, add_special_tokens=False)["input_ids"] == [i]
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 3)
    assert (tok.pad_token, tok.pad_token_id) == ("<|pad|>", 0)
    assert tok.decode([2, 12, 3], skip_special_tokens=True) == tok.decode([12])


def test_chat_template(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "12+7=?"}],
                                   add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\n12+7=?<|im_end|>\n<|im_start|>assistant\n"


def test_dataset_files():
    test, train, sft = rows("test"), rows("train"), rows("sft")
    assert (len(test), len(train), len(sft)) == (200, 2000, 4000)
    prompts = [{r["prompt"] for r in x} for x in (test, train, sft)]
    assert not (prompts[0] & prompts[1]) and not (prompts[0] & prompts[2])
    for r in test + train:
        digits = r["prompt"].removeprefix("reverse ")
        assert r["answer"] == digits[::-1] and "0" not in digits and 3 <= len(digits) <= 5
    digits = [r["prompt"].removeprefix("reverse ") for r in sft]
    assert all(r["response"] in ("#### " + d, "#### " + d[::-1]) for r, d in zip(sft, digits))
    palindromes = sum(d == d[::-1] for d in digits)
    copies = sum(r["response"] == "#### " + d and d != d[::-1] for r, d in zip(sft, digits))
    assert 2400 - palindromes <= copies <= 2400  # 60% of rows were made wrong


def test_make_assets_reproduces_shipped_files(tmp_path):
    """make_assets.py is deterministic and the shipped files are its current output."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_assets", asset_path("tiny/make_assets.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(tmp_path)
    tokenizer_files = [f"{d}/{f}" for d in TOKENIZER_DIRS for f in ("tokenizer.json", "tokenizer_config.json")]
    for name in ["train.jsonl", "test.jsonl", "sft.jsonl"] + tokenizer_files:
        assert (tmp_path / name).read_bytes() == asset_path(f"tiny/{name}").read_bytes(), name
    data = [f for f in asset_path("tiny").rglob("*") if f.is_file() and "sft" not in f.parent.name]
    assert sum(f.stat().st_size for f in data) < 1_000_000  # the checkpoint in sft/ is ~4 MB


def task_strings(tok) -> list[str]:
    """Every string the tiny task tokenizes: templated prompts, answers, responses (+ eos), each char."""
    out = list(CHARS) + [CHARS, "  \n\n x \n", "12+7=? #### 19\nthe sum is: 19, ok!"]
    for r in rows("test") + rows("train") + rows("sft"):
        out.append(tok.apply_chat_template([{"role": "user", "content": r["prompt"]}],
                                           add_generation_prompt=True, tokenize=False))
        response = r.get("response") or "#### " + r["answer"]
        out += [r.get("answer") or r["response"], response, response + "<|im_end|>"]
    return out


@pytest.mark.parametrize("name", TOKENIZER_DIRS)
def test_auto_tokenizer_gives_megarl_ids(name):
    """AutoTokenizer on each shipped directory == megarl's loader, id for id, and decodes back.

    transformers 5 builds Qwen2Tokenizer for init/ and sft/ (their config.json
    says qwen2) whatever tokenizer_config.json names, keeping only the vocab of
    tokenizer.json; the file is written in Qwen2's byte-level format so that
    this rebuilt tokenizer and the file itself are the same tokenizer.
    Not covered: characters outside CHARS (megarl's loader gives <|unk|> per
    byte; transformers 5's Qwen2Tokenizer has no unk token and drops them).
    """
    from megarl.data.tokenizer import load_tokenizer

    path = str(asset_path(f"tiny/{name}"))
    auto, ours = AutoTokenizer.from_pretrained(path), load_tokenizer(path)
    for c in CHARS:
        assert ours(c, add_special_tokens=False)["input_ids"] == [5 + CHARS.index(c)], repr(c)
    for text in task_strings(ours):
        ids = ours(text, add_special_tokens=False)["input_ids"]
        assert auto(text, add_special_tokens=False)["input_ids"] == ids, repr(text)
        assert auto(text)["input_ids"] == ids and auto.decode(ids) == text, repr(text)
    messages = [{"role": "user", "content": "reverse 4831"}]
    assert auto.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == \
        ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    for attr in ("eos_token_id", "pad_token_id", "unk_token_id", "padding_side"):
        assert getattr(auto, attr) == getattr(ours, attr), attr
    assert len(auto) == len(ours) == 57
