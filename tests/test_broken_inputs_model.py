"""Broken model and tokenizer directories, and lengths past the model's positions: one-line errors.

Config checks (before any process group, so each rank fails alone at once):
a tokenizer directory that does not exist, one without vocabulary files
(tokenizer_config.json alone used to give transformers an empty tokenizer and
a reshape error deep in evaluation), a tokenizer with ids past the model's
vocab_size, rollout.max_new_tokens that leaves no position for the prompt,
and sft.max_len past the positions. Each is a ConfigError naming the key.

Weight loading (one process, the tiny task's model): a truncated, empty or
foreign (not safetensors) model.safetensors, an index naming a missing file,
a missing tensor, a tensor of the wrong shape, an embedding with fewer rows
than vocab_size (would be zero-padded silently). Each is a ModelConfigError
(a UserInputError: the entry scripts print it as one line and exit 2) naming
the directory or file. Not covered: sharded reads under TP > 1.
"""
import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dist_helpers import spawn
from test_trainer_runs import ROOT

TINY = os.path.join(ROOT, "megarl", "assets", "tiny", "sft")


def _validate(*overrides, sft: bool = False) -> str:
    from megarl.errors import ConfigError
    from megarl.cli import load_config
    from megarl.config import Config
    from megarl.config_checks import validate, validate_sft

    cfg = load_config([os.path.join(ROOT, "yaml", "tiny_sft.yaml" if sft else "tiny.yaml"), *overrides], Config)
    try:
        (validate_sft if sft else validate)(cfg, 1)
    except ConfigError as e:
        assert "\n" not in str(e)
        return str(e)
    return "no error"


def _copy_model(tmp_path, name: str, drop=()) -> str:
    out = tmp_path / name
    shutil.copytree(TINY, out, ignore=shutil.ignore_patterns(*drop))
    return str(out)


def test_missing_tokenizer_dir(tmp_path):
    assert _validate(f"model.tokenizer={tmp_path}/nope") == (
        f"model.tokenizer: tokenizer directory '{tmp_path}/nope' does not exist; point model.tokenizer at a "
        "directory with tokenizer.json (or the model's own tokenizer files)")


def test_no_tokenizer_files(tmp_path):
    path = _copy_model(tmp_path, "m", drop=("tokenizer.json",))  # tokenizer_config.json stays
    assert _validate(f"model.path={path}").startswith(f"model.path: '{path}' has no tokenizer files (tokenizer.json,")


def test_vocab_smaller_than_tokenizer_ids(tmp_path):
    path = _copy_model(tmp_path, "m")
    cfg = json.load(open(os.path.join(path, "config.json")))
    json.dump(dict(cfg, vocab_size=40), open(os.path.join(path, "config.json"), "w"))
    assert _validate(f"model.path={path}") == (
        f"model.path: the tokenizer in '{path}' has ids up to 56, but the model of model.path has vocab_size 40 "
        "(config.json); use the tokenizer the model was trained with")


@pytest.mark.parametrize("override, sft, expected", [
    ("rollout.max_new_tokens=64", False, "rollout.max_new_tokens=64: 64 + 1 prompt token exceed the 64 positions"),
    ("sft.max_len=65", True, "sft.max_len=65: 65 exceed the 64 positions"),
])
def test_lengths_past_max_positions(override, sft, expected):
    assert _validate(override, sft=sft).startswith(expected)
    assert _validate(override.split("=")[0] + "=63", sft=sft) == "no error"


def _break(path: str, how: str) -> None:
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    if how == "truncated":
        os.truncate(file, os.path.getsize(file) // 2)
    elif how == "empty":
        os.truncate(file, 0)
    elif how == "foreign":
        open(file, "wb").write(b"PK\x03\x04" + bytes(range(256)) * 8)  # a zip, say
    elif how == "index_names_missing_file":
        os.rename(file, os.path.join(path, "model-00001-of-00002.safetensors"))
        weight_map = {k: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, k in enumerate(sorted(tensors))}
        json.dump({"weight_map": weight_map}, open(os.path.join(path, "model.safetensors.index.json"), "w"))
    else:
        if how == "missing_tensor":
            del tensors["model.layers.1.mlp.up_proj.weight"]
        elif how == "misshaped_tensor":
            tensors["model.layers.0.mlp.down_proj.weight"] = torch.zeros(128, 256)
        elif how == "short_embedding":
            tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"][:50]
        save_file(tensors, file, metadata={"format": "pt"})


CASES = {
    "truncated": r"'?{p}/model.safetensors is not a readable safetensors file \(.*\): truncated or another format",
    "empty": r"'?{p}/model.safetensors is not a readable safetensors file",
    "foreign": r"'?{p}/model.safetensors is not a readable safetensors file",
    "index_names_missing_file": r"{p}/model-00002-of-00002.safetensors is missing \(model.safetensors.index.json",
    "missing_tensor": r"'{p}' lacks tensors the Qwen2ForCausalLM of its config.json needs: "
                      r"model.layers.1.mlp.up_proj.weight \(for decoder.layers.1.mlp.linear_fc1.weight\); ",
    "misshaped_tensor": r"'{p}': model.layers.0.mlp.down_proj.weight \(128, 256\) do not fit its config.json "
                        r"\(hidden_size=128, vocab_size=57, heads=4/2 kv, intermediate_size=512\)",
    "short_embedding": r"'{p}': model.embed_tokens.weight \(50, 128\) do not fit its config.json",
}


def _load_broken(rank, paths):
    from megarl.distributed import build_parallel_groups, init_distributed
    from megarl.models.builder import build_gpt_model
    from megarl.models.hf_config import ModelConfigError, read_hf_config
    from megarl.models.loader import load_hf_checkpoint

    init_distributed()
    groups = build_parallel_groups()
    info = read_hf_config(TINY)
    model = build_gpt_model(info, groups)
    load_hf_checkpoint(model, TINY, info, groups)  # the intact one loads
    errors = {}
    for case, path in paths.items():
        try:
            load_hf_checkpoint(model, path, info, groups)
            errors[case] = "no error"
        except ModelConfigError as e:
            errors[case] = str(e)
    return errors


def test_broken_model_dirs_are_one_line_model_errors(tmp_path):
    paths = {}
    for case in CASES:
        paths[case] = _copy_model(tmp_path, case)
        _break(paths[case], case)
    (errors,) = spawn(_load_broken, 1, paths)
    for case, pattern in CASES.items():
        assert "\n" not in errors[case]
        assert re.match(pattern.format(p=re.escape(paths[case])), errors[case]), (case, errors[case])
