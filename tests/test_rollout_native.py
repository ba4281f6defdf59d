"""Native rollout: greedy equals ``transformers`` greedy; sampled log-probs equal training's.

A random Llama-shaped checkpoint (GQA, 57-token vocab padded to 128 per TP rank)
is loaded into the actor at TP1, TP2 and PP2. Greedy decoding of prompts of
different lengths (left-padded into one batch) must give, token for token, what
``transformers`` ``generate`` gives for each prompt alone — this checks the KV
cache, the left-padding masks and the vocabulary-padding mask. Sampled
responses (temperature 0.7, top-k/top-p on) carry the engine's log-prob of each
token under logits / 0.7; the actor's training forward over the same tokens
must give the same numbers (fp32, 1e-5). Not covered: SGLang, bf16.
"""
import pytest
import torch

from dist_helpers import spawn
from megarl.models.tiny import make_tiny_checkpoint

PROMPTS = [[7, 8, 9, 10, 11, 12], [13, 14], [20, 21, 22, 23], [30]]
MAX_NEW = 8


def _rollout(rank, ckpt, tp, pp):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.config import Config
    from megarl.distributed import build_parallel_groups, init_distributed
    from megarl.roles.build import build_actor
    from megarl.rollout.engine import SamplingParams
    from megarl.rollout.native import NativeEngine
    from megarl.trainer.rollout import to_sample_batch

    init_distributed()
    groups = build_parallel_groups(tp, pp)
    model_parallel_cuda_manual_seed(0)
    cfg = Config()
    cfg.model.path = ckpt
    actor = build_actor(cfg, groups, optimizer_steps=1)
    engine = NativeEngine(actor.module, groups, actor.info.vocab_size, [3], 0, max_batch=3)
    greedy = engine.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0))
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.7, top_k=20, top_p=0.9, n=2, seed=3)
    sampled = engine.generate(PROMPTS, params)
    batch = to_sample_batch(sampled, 0, "cpu")
    train = actor.logprobs(batch, micro_batch_size=3, temperature=0.7)["logprobs"]
    diff = ((train - batch.tensors["rollout_logprobs"]).abs() * batch.response_mask).max()
    return [r.response_ids for r in greedy], float(diff), [r.response_ids for r in sampled]


@pytest.fixture(scope="module")
def ckpt_and_hf(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    model = make_tiny_checkpoint(str(path), "LlamaForCausalLM", seed=1, vocab_size=57, eos_token_id=3)
    expected = []
    for p in PROMPTS:
        out = model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False,
                             eos_token_id=3, pad_token_id=0)
        expected.append(out[0, len(p):].tolist())
    return str(path), expected


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_greedy_matches_transformers_and_logprobs_match_training(ckpt_and_hf, tp, pp):
    ckpt, expected = ckpt_and_hf
    results = spawn(_rollout, tp * pp, ckpt, tp, pp)
    greedy, diff, sampled = results[0]
    assert greedy == expected
    assert diff < 1e-5
    for other in results[1:]:  # every rank of the replica decodes the same tokens
        assert other[0] == greedy and other[2] == sampled
