"""An export of the tiny SFT model scores the same in plain ``transformers`` as in megarl.

Setup: the shipped fp32 SFT checkpoint (``megarl/assets/tiny/sft``), copied
with its files made read-only (as an installed package may ship them), is
loaded into the actor on one CPU process and exported with ``export_hf``, as
``launch/ppo.py`` writes ``runs/<name>/hf``. In the same process megarl runs
its own held-out evaluation (``held_out_accuracy``: the native engine, greedy,
``yaml/tiny.yaml``'s 10-token limit, the math-answer reward) on the first
``N_EVAL`` prompts of ``test.jsonl``, tokenized by megarl's loader.

Expected: a user who loads the export with only ``AutoTokenizer`` and
``AutoModelForCausalLM``, renders each prompt with the tokenizer's chat
template (one user message, generation prompt) and decodes greedily gets the
same prompt ids, the same greedy tokens (same fp32 weights, same function; no
near-ties are expected at this scale) and so the same accuracy. Before the tiny
tokenizer was written in Qwen2's byte-level format, transformers 5 loaded it as
``Qwen2Tokenizer`` and dropped every space and newline (27 prompt tokens instead
of 31), and the exported models scored ~0 through ``transformers``.

Files: under umask 022 every exported file is 0644 and the directory 0755,
although safetensors writes 0600 and the source's tokenizer files are 0444.

Not covered: TP / PP exports (test_models_parity.py), bf16, sampled decoding.
"""
import json
import os
import shutil
import stat

import pytest
import torch

from dist_helpers import spawn
from megarl.assets import asset_path

N_EVAL = 50
MAX_NEW = 10  # yaml/tiny.yaml rollout.max_new_tokens


def _export_and_evaluate(rank, src, out_dir, sharded_dir):
    """megarl's side: export (also sharded, over stale read-only files), then greedy eval."""
    os.umask(0o022)
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.config import Config
    from megarl.data import PromptDataConfig, load_prompt_dataset
    from megarl.data.tokenizer import load_tokenizer
    from megarl.distributed import build_parallel_groups, init_distributed
    from megarl.models import export_hf
    from megarl.roles.build import build_actor
    from megarl.rollout.engine import SamplingParams, sample_requests
    from megarl.rollout.native import NativeEngine
    from megarl.trainer.evaluate import held_out_accuracy
    from megarl.rollout.factory import engine_options

    init_distributed()
    groups = build_parallel_groups(1, 1)
    model_parallel_cuda_manual_seed(0)
    cfg = Config()
    cfg.model.path, cfg.rollout.max_new_tokens = src, MAX_NEW
    actor = build_actor(cfg, groups, optimizer_steps=1)
    export_hf(actor.module, actor.info, groups, out_dir, copy_from=src)
    os.makedirs(sharded_dir)
    for name in ("config.json", "tokenizer.json", "model-00001-of-00004.safetensors"):
        with open(os.path.join(sharded_dir, name), "w") as f:  # stale files of an earlier export
            f.write("{}")
        os.chmod(os.path.join(sharded_dir, name), 0o444)
    export_hf(actor.module, actor.info, groups, sharded_dir, copy_from=src, max_shard_bytes=2**20)
    tokenizer = load_tokenizer(src)
    data = load_prompt_dataset(PromptDataConfig.from_section(cfg.data, cfg.data.eval_path), tokenizer)
    engine = NativeEngine(actor.module, groups, actor.info.vocab_size, [tokenizer.eos_token_id],
                          tokenizer.pad_token_id, engine_options(cfg))
    accuracy = held_out_accuracy(engine, data, tokenizer, groups, MAX_NEW, limit=N_EVAL)
    prompts = [data[i].prompt_ids for i in range(N_EVAL)]
    greedy = engine.generate(sample_requests(prompts, 1, 0, MAX_NEW), SamplingParams(temperature=0.0))
    return {"accuracy": accuracy, "prompts": prompts, "greedy": [r.response_ids for r in greedy]}


def _transformers_eval(hf_dir):
    """The user's side: plain transformers on the export; prompt ids, greedy ids, accuracy."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megarl.rewards import math_answer_reward

    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    rows = [json.loads(line) for line in asset_path("tiny/test.jsonl").read_text().splitlines()][:N_EVAL]
    prompts, greedy, correct = [], [], 0.0
    for row in rows:
        text = tok.apply_chat_template([{"role": "user", "content": row["prompt"]}],
                                       add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        response = out[0, len(ids):].tolist()
        prompts.append(ids)
        greedy.append(response)
        correct += math_answer_reward(tok.decode(response, skip_special_tokens=True), row["answer"])
    return {"accuracy": correct / len(rows), "prompts": prompts, "greedy": greedy}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    src, out, sharded = root / "sft_readonly", root / "run" / "hf", root / "sharded"
    shutil.copytree(asset_path("tiny/sft"), src)
    for f in src.iterdir():
        f.chmod(0o444)
    (megarl,) = spawn(_export_and_evaluate, 1, str(src), str(out), str(sharded))
    return src, out, sharded, megarl


def test_transformers_reproduces_megarl_accuracy(exported):
    src, out, _, megarl = exported
    user = _transformers_eval(str(out))
    assert user["prompts"] == megarl["prompts"]
    assert all(p.count(41) == 1 and p.count(42) == 3 for p in user["prompts"])  # the space, 3 newlines
    assert user["greedy"] == megarl["greedy"]
    assert user["accuracy"] == megarl["accuracy"] > 0  # 4 of the 50 with the shipped checkpoint


def modes(path) -> dict[str, int]:
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in path.iterdir()}


def test_export_copies_tokenizer_and_has_normal_modes(exported):
    src, out, sharded, _ = exported
    names = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert modes(out) == dict.fromkeys(names, 0o644)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes() == (sharded / name).read_bytes(), name
    assert stat.S_IMODE(out.stat().st_mode) == 0o755 == stat.S_IMODE(out.parent.stat().st_mode)
    shards = modes(sharded)  # 4 MB in 1 MiB files (+ index), written over read-only stale files
    assert "model.safetensors.index.json" in shards and len([n for n in shards if n.startswith("model-")]) >= 4
    assert set(shards.values()) == {0o644}
