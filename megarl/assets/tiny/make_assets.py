"""Regenerate the tiny CPU task: a char-level tokenizer and a digit-reversal dataset.

    python megarl/assets/tiny/make_assets.py          # writes next to this file
    python megarl/assets/tiny/make_assets.py --out D  # writes into D

Deterministic: the same seed gives byte-identical files. See README.md for
the task design (the SFT warm start is deliberately wrong 60% of the time).
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

SEED = 1234
NUM_TEST = 200
NUM_TRAIN = 2000
NUM_SFT = 4000
SFT_WRONG = 0.6  # fraction of SFT rows answering the digits unreversed
DIGITS = "123456789"  # no 0: a reversed answer never has a leading zero
LENGTHS = (3, 4, 5)

PAD, EOT, IM_START, IM_END, UNK = (
    "<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|unk|>")
SPECIAL_TOKENS = [PAD, EOT, IM_START, IM_END, UNK]  # ids 0..4, in this order
CHARS = ("0123456789" + "abcdefghijklmnopqrstuvwxyz"
         + " \n" + "+-*/=?.,:#!'()")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# Qwen2's pre-tokenizer split, as transformers' Qwen2Tokenizer builds it. For a
# BPE without merges it changes no id (every byte is its own token); it is here
# so the file and the tokenizer transformers rebuilds from it are the same.
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
               r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
TOKENIZER_DIRS = ("tokenizer", "init", "sft")  # every asset directory that holds the tokenizer


def byte_level(text: str) -> str:
    """``text`` in the byte-level alphabet of GPT-2 / Qwen2 vocabularies (space -> 'Ġ', newline -> 'Ċ')."""
    bl = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return "".join(piece for piece, _ in bl.pre_tokenize_str(text))


def build_tokenizer(chars: str = CHARS, specials: list[str] = SPECIAL_TOKENS) -> Tokenizer:
    """Char-level tokenizer in Qwen2's own format: byte-level BPE without merges.

    The model is ``Qwen2ForCausalLM``, and transformers 5 loads any qwen2
    directory's tokenizer as ``Qwen2Tokenizer``, which keeps only the vocab and
    merges of tokenizer.json and rebuilds the rest (NFC, Qwen2's split, byte-level
    pre-tokenizer and decoder). Written in that format, the file means the same
    to every loader; a vocab with raw ' ' and '\n' keys would lose those ids.
    Specials are matched before splitting.
    """
    ids = {byte_level(c): i for i, c in enumerate(chars, start=len(specials))}
    vocab = {**{tok: i for i, tok in enumerate(specials)}, **ids}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    return tok


def save_tokenizer(out_dir: Path, chars: str = CHARS, specials: list[str] = SPECIAL_TOKENS,
                   extra_specials: tuple[str, ...] = ()) -> None:
    """Save as a PreTrainedTokenizerFast directory that AutoTokenizer loads offline
    (``extra_specials``: special tokens beyond this task's, e.g. tiny_tools' tool-call markers)."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(chars, specials), eos_token=IM_END, pad_token=PAD,
        unk_token=UNK, additional_special_tokens=[IM_START, EOT, *extra_specials],
        model_max_length=512, padding_side="left", clean_up_tokenization_spaces=False)
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(str(out_dir))
    _pin_tokenizer_config(out_dir)


def _pin_tokenizer_config(out_dir: Path) -> None:
    """Make tokenizer_config.json loadable by transformers 4.50+ and 5.x alike."""
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    # transformers 5 writes a list under extra_special_tokens; 4.x expects a dict
    # there, and both read a list under additional_special_tokens.
    extra = cfg.pop("extra_special_tokens", None)
    if isinstance(extra, list):
        cfg["additional_special_tokens"] = extra
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    jinja = out_dir / "chat_template.jinja"
    if jinja.exists():
        jinja.unlink()  # one source of truth: tokenizer_config.json


def split_strings(rng: random.Random) -> tuple[list, list, list]:
    """Disjoint digit strings for test, RL train and SFT."""
    seen: set[str] = set()
    picked: list[str] = []
    while len(picked) < NUM_TEST + NUM_TRAIN + NUM_SFT:
        s = "".join(rng.choice(DIGITS) for _ in range(rng.choice(LENGTHS)))
        if s not in seen:
            seen.add(s)
            picked.append(s)
    return picked[:NUM_TEST], picked[NUM_TEST:NUM_TEST + NUM_TRAIN], picked[NUM_TEST + NUM_TRAIN:]


def prompt_of(digits: str) -> str:
    return f"reverse {digits}"


def sft_rows(strings: list, rng: random.Random) -> list[dict]:
    """Exactly round(SFT_WRONG * n) rows answer the digits unreversed; the rest reversed."""
    n_wrong = round(SFT_WRONG * len(strings))
    wrong = set(rng.sample(range(len(strings)), n_wrong))
    return [{"prompt": prompt_of(d), "response": f"#### {d if i in wrong else d[::-1]}"}
            for i, d in enumerate(strings)]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows))


def main(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for sub in TOKENIZER_DIRS:  # init/ and sft/ keep their config.json and weights
        save_tokenizer(out_dir / sub)
    rng = random.Random(SEED)
    test, train, sft = split_strings(rng)
    rl = lambda strings: [{"prompt": prompt_of(d), "answer": d[::-1]} for d in strings]
    write_jsonl(out_dir / "test.jsonl", rl(test))
    write_jsonl(out_dir / "train.jsonl", rl(train))
    write_jsonl(out_dir / "sft.jsonl", sft_rows(sft, rng))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    main(parser.parse_args().out)
