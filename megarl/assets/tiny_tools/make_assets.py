"""Regenerate the tiny tool-use task: multiplication a tiny model can only do with the calculator.

    python megarl/assets/tiny_tools/make_assets.py          # writes next to this file
    python megarl/assets/tiny_tools/make_assets.py --out D  # writes into D

Deterministic: the same seed gives byte-identical files. Writes the data, the
tokenizer files of ``init/`` and ``sft/`` and ``init/config.json``; ``sft/``
keeps its config.json and weights (launch/sft.py makes them). See README.md
for the task design (the SFT warm start calls the tool only 40% of the time).
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from megarl.assets.tiny.make_assets import save_tokenizer as save_tiny_tokenizer
from megarl.assets.tiny.make_assets import write_jsonl

SEED = 4321
NUM_TEST = 200
NUM_TRAIN = 2000
NUM_SFT = 4000
SFT_CALLS = 0.4  # fraction of SFT rows that call the calculator; the rest answer in their head
SMALL, LARGE = (10, 99), (100, 999)  # a 2-digit times a 3-digit operand ...
MIN_PRODUCT = 10000  # ... with a 5-digit product: the answer sits a fixed distance after the tool result

PAD, EOT, IM_START, IM_END, UNK = (
    "<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|unk|>")
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
SPECIAL_TOKENS = [PAD, EOT, IM_START, IM_END, UNK, CALL_START, CALL_END]  # ids 0..6, in this order
CHARS = ("0123456789" + "abcdefghijklmnopqrstuvwxyz"
         + " \n" + "+-*/=?.,:#!'()" + '{}"_[]')  # the tiny task's set + JSON punctuation
TOKENIZER_DIRS = ("init", "sft")  # every asset directory that holds the tokenizer
MODEL_CONFIG = {  # init/: 4 layers, 128 wide, 256 positions; fp32 weights under 2 MB
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
    "hidden_size": 128, "intermediate_size": 192, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
    "vocab_size": len(SPECIAL_TOKENS) + len(CHARS), "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
    "tie_word_embeddings": True, "hidden_act": "silu", "initializer_range": 0.02,
    "attention_dropout": 0.0, "use_sliding_window": False, "bos_token_id": None,
    "eos_token_id": 3, "pad_token_id": 0, "torch_dtype": "float32",
}


def save_tokenizer(out_dir: Path) -> None:
    """The tiny task's char-level tokenizer format (megarl/assets/tiny) with this task's characters,
    plus the tool-call markers as single special tokens (the engine stops on the id of ``</tool_call>``)."""
    save_tiny_tokenizer(out_dir, CHARS, SPECIAL_TOKENS, (CALL_START, CALL_END))


def split_problems(rng: random.Random) -> tuple[list, list, list]:
    """Disjoint (a, b) problems with 5-digit products for test, RL train and SFT; disjoint also up
    to operand order (the 2-digit operand comes first or second at random)."""
    seen: set[tuple[int, int]] = set()
    picked: list[tuple[int, int]] = []
    while len(picked) < NUM_TEST + NUM_TRAIN + NUM_SFT:
        small, large = rng.randint(*SMALL), rng.randint(*LARGE)
        if (small, large) in seen or small * large < MIN_PRODUCT:
            continue
        seen.add((small, large))
        picked.append((small, large) if rng.random() < 0.5 else (large, small))
    return picked[:NUM_TEST], picked[NUM_TEST:NUM_TEST + NUM_TRAIN], picked[NUM_TEST + NUM_TRAIN:]


def prompt_of(a: int, b: int) -> str:
    return f"what is {a}*{b}?"


def tool_call_text(a: int, b: int) -> str:
    """The call the SFT rows teach, in Hermes syntax (megarl.tools.parse_hermes)."""
    call = {"name": "calculator", "arguments": {"expression": f"{a}*{b}"}}
    return f"{CALL_START}{json.dumps(call)}{CALL_END}"


def conversation(a: int, b: int, calls: bool) -> list[dict]:
    """The messages of one solved problem: with a calculator call, or answered directly."""
    answer = {"role": "assistant", "content": f"#### {a * b}"}
    user = {"role": "user", "content": prompt_of(a, b)}
    if not calls:
        return [user, answer]
    return [user, {"role": "assistant", "content": tool_call_text(a, b)},
            {"role": "tool", "name": "calculator", "content": str(a * b)}, answer]


def sft_response(tokenizer, messages: list[dict]) -> str:
    """Everything the chat template renders after the prompt, without the final end of turn (the
    SFT trainer appends eos): the tool turn, the template's tool message, the answer turn."""
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    assert full.startswith(prompt) and full.endswith(IM_END + "\n")
    return full[len(prompt):-len(IM_END + "\n")]


def sft_rows(tokenizer, problems: list, rng: random.Random) -> list[dict]:
    """Exactly round(SFT_CALLS * n) rows call the calculator; the rest answer directly (correctly)."""
    calls = set(rng.sample(range(len(problems)), round(SFT_CALLS * len(problems))))
    return [{"prompt": prompt_of(a, b), "response": sft_response(tokenizer, conversation(a, b, i in calls))}
            for i, (a, b) in enumerate(problems)]


def main(out_dir: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    for sub in TOKENIZER_DIRS:
        (out_dir / sub).mkdir(parents=True, exist_ok=True)
        save_tokenizer(out_dir / sub)
    (out_dir / "init" / "config.json").write_text(json.dumps(MODEL_CONFIG, indent=2) + "\n")
    rng = random.Random(SEED)
    test, train, sft = split_problems(rng)
    rl = lambda problems: [{"prompt": prompt_of(a, b), "answer": str(a * b)} for a, b in problems]
    write_jsonl(out_dir / "test.jsonl", rl(test))
    write_jsonl(out_dir / "train.jsonl", rl(train))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(out_dir / "init"))
    write_jsonl(out_dir / "sft.jsonl", sft_rows(tokenizer, sft, rng))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    main(parser.parse_args().out)
