"""The agent loop on the native engine: every sampled turn is the model's greedy continuation of the
exact ids before it, and a conversation's earlier pages come from the prefix cache.

A random tiny Llama with the BPE test tokenizer of ``test_rollout_agent.py``
(its vocabulary); the tool-call end is a token the model's greedy decoding
emits early, so the loop calls a (fake) tool, appends the template's context
ids and goes on, for three turns. Checked: each sampled chunk equals
``transformers`` greedy decoding of prompt + all response ids before it (fp32,
token-in/token-out on a real engine); with ``prefix_cache`` the later turns
take cached pages (``rollout/prefix_cached_tokens`` > 0) and the responses are
the same as without it.
"""
import torch

from dist_helpers import spawn, worker_actor
from megarl.models.tiny import make_tiny_checkpoint
from test_rollout_agent import Executor, make_tokenizer

MAX_NEW = 48


def _greedy(model, ids, n):
    """n argmax steps of the HF model (no generation config: its eos and pad rules stay out)."""
    ids = list(ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(ids) - n:]


def _run(rank, ckpt, end_id):
    from megarl.rollout.agent import AgentLoop, AgentOptions
    from megarl.rollout.engine import SamplingParams, sample_requests
    from megarl.rollout.native import EngineOptions, NativeEngine

    actor, groups = worker_actor(ckpt)
    tok = make_tokenizer()
    prompts = [tok.encode("<s>user:mul 6 7</s><s>assistant:"), tok.encode("<s>user:ab</s><s>assistant:")]
    out = {}
    for cached in (False, True):
        engine = NativeEngine(actor.module, groups, actor.info.vocab_size, [tok.eos_token_id], 0,
                              EngineOptions(max_batch=4, page_size=8, prefix_cache=cached, kv_cache_gb=0.01))
        loop = AgentLoop(engine, tok, Executor(), lambda text: ([_Call()], []), AgentOptions(end_id, max_turns=3))
        results = loop.generate(sample_requests(prompts, 1, 0, MAX_NEW), SamplingParams(temperature=0.0))
        out[cached] = {"results": [(r.prompt_ids, r.response_ids, r.loss_mask, r.finish_reason) for r in results],
                       "cached_tokens": engine.stats["rollout/prefix_cached_tokens"], "turns": loop.stats["agent/turns_mean"]}
    return out


class _Call:
    name, arguments = "mul", {"a": 6, "b": 7}


def test_agent_turns_are_greedy_continuations_and_reuse_cached_pages(tmp_path):
    tok = make_tokenizer()
    model = make_tiny_checkpoint(str(tmp_path), "LlamaForCausalLM", seed=5, vocab_size=len(tok),
                                 max_position_embeddings=256)
    first = _greedy(model, tok.encode("<s>user:mul 6 7</s><s>assistant:"), 6)
    end_id = first[2]  # the model reaches it in its first turn: a tool call
    (r,) = spawn(_run, 1, str(tmp_path), end_id)
    assert r[True]["results"] == r[False]["results"]
    assert r[True]["cached_tokens"] > 0 and r[False]["cached_tokens"] == 0
    assert r[False]["turns"] > 1
    for prompt, response, mask, _ in r[False]["results"]:
        start = 0
        while start < len(response):  # each sampled chunk: greedy from everything before it
            stop = start
            while stop < len(response) and mask[stop] == 1:
                stop += 1
            chunk = response[start:stop]
            assert chunk == _greedy(model, prompt + response[:start], len(chunk))
            start = stop
            while start < len(response) and mask[start] == 0:
                start += 1
