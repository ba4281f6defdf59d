"""Tokenizer loading that honours the directory's own tokenizer class.

transformers 5's ``AutoTokenizer`` builds the model family's tokenizer class
(from config.json's ``model_type``) even when ``tokenizer_config.json`` names
``PreTrainedTokenizerFast``; for a custom ``tokenizer.json`` (the synthetic
benchmark tokenizers) that silently drops characters. A directory that names
the generic fast class gets exactly it. (The tiny task's tokenizer is written
in Qwen2's own byte-level format, so plain ``AutoTokenizer`` gives it the same
ids: megarl/assets/tiny/make_assets.py.)
"""
from __future__ import annotations

import glob
import json
import os

from megarl.errors import ConfigError

_GENERIC = ("PreTrainedTokenizerFast", "TokenizersBackend")
# files that hold a vocabulary (tokenizer_config.json alone gives transformers an empty tokenizer)
VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json",
               "vocab.txt", "*.tiktoken")


def check_tokenizer_dir(path: str, key: str) -> None:
    """``path`` (the value of config key ``key``) is a directory holding a vocabulary file."""
    if not os.path.isdir(path):
        raise ConfigError(f"{key}: tokenizer directory '{path}' does not exist; point {key} at a directory "
                             f"with tokenizer.json (or the model's own tokenizer files)")
    if not any(glob.glob(os.path.join(path, pattern)) for pattern in VOCAB_FILES):
        raise ConfigError(f"{key}: '{path}' has no tokenizer files ({', '.join(VOCAB_FILES)}); copy the model's "
                             f"tokenizer there, or set model.tokenizer to a directory that has one")


def max_token_id(path: str) -> int | None:
    """The largest id ``path``/tokenizer.json can produce (vocabulary and added tokens); None without one."""
    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
        return None
    try:
        with open(file) as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{file}: invalid JSON ({getattr(e, 'msg', e)}); copy the tokenizer again") from None
    vocab = (data.get("model") or {}).get("vocab") or {}
    ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))  # BPE/WordPiece | Unigram
    ids += [t["id"] for t in data.get("added_tokens") or [] if isinstance(t, dict) and "id" in t]
    return max(ids) if ids else None


def check_vocab_fits(tokenizer_dir: str, key: str, vocab_size: int, model_key: str = "model.path") -> None:
    """Every id the tokenizer can produce has a row in the model's embedding (``vocab_size``)."""
    top = max_token_id(tokenizer_dir)
    if top is not None and top >= vocab_size:
        raise ConfigError(f"{key}: the tokenizer in '{tokenizer_dir}' has ids up to {top}, but the model of "
                             f"{model_key} has vocab_size {vocab_size} (config.json); use the tokenizer the model was "
                             f"trained with")


def load_tokenizer(path: str):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    cfg_file = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(cfg_file):
        with open(cfg_file) as f:
            if json.load(f).get("tokenizer_class") in _GENERIC:
                return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)
