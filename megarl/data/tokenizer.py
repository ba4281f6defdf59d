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

import json
import os

_GENERIC = ("PreTrainedTokenizerFast", "TokenizersBackend")


def load_tokenizer(path: str):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    cfg_file = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(cfg_file):
        with open(cfg_file) as f:
            if json.load(f).get("tokenizer_class") in _GENERIC:
                return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)
