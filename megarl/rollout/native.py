"""megarl's native rollout engine: decoding on the actor's own Megatron modules.

The engine holds a reference to this rank's GPTModel stage (the very module
the optimizer updates), so taking new weights costs nothing when rollout and
training layouts match. Prompts are left-padded into one static batch; RoPE
depends only on relative positions, so a left-padded prompt whose pad keys
are masked attends exactly as the unpadded one. A megatron-core
``StaticInferenceContext`` holds the KV cache.

TP ranks gather the last-position logits and sample with one seeded
generator; with PP, hidden states go stage to stage and the last stage
broadcasts the sampled tokens to its pipeline group.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.inference.contexts import StaticInferenceContext

from megarl.distributed import ParallelGroups
from megarl.rollout.engine import GenerationResult, SamplingParams
from megarl.rollout.sampling import sample


def left_pad(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, P) token ids padded on the left and (B, P) bool "is a real token"."""
    width = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    real = torch.zeros((len(prompts), width), dtype=torch.bool, device=device)
    for i, p in enumerate(prompts):
        tokens[i, width - len(p):] = torch.tensor(p, dtype=torch.long, device=device)
        real[i, width - len(p):] = True
    return tokens, real


def prefill_mask(real: torch.Tensor) -> torch.Tensor:
    """(B, 1, P, P) megatron mask (True = blocked): causal, pad keys blocked.

    A pad query may still see itself, so no softmax row is empty (NaN-free).
    """
    width = real.size(1)
    causal = torch.ones(width, width, dtype=torch.bool, device=real.device).triu(1)  # (P, P)
    blocked = causal[None] | ~real[:, None, :]  # (B, P, P)
    blocked &= ~torch.eye(width, dtype=torch.bool, device=real.device)[None]
    return blocked[:, None]


class NativeEngine:
    """Rollout on the actor's Megatron stage, all TP/PP peers decoding together."""

    def __init__(self, module, groups: ParallelGroups, vocab_size: int, eos_ids: list[int],
                 pad_id: int, max_batch: int = 256):
        self.module = module  # the unwrapped GPTModel stage this rank trains
        self.groups = groups
        self.vocab_size = vocab_size  # real vocabulary; padded rows are never sampled
        self.eos_ids = list(eos_ids)
        self.pad_id = pad_id
        self.max_batch = max_batch
        self.device = next(module.parameters()).device

    # -- RolloutEngine -------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[GenerationResult]:
        requests = [(i, p) for i, p in enumerate(prompts) for _ in range(params.n)]
        generator = torch.Generator(device=self.device).manual_seed(params.seed)
        results = []
        was_training = self.module.training
        self.module.eval()
        try:
            with torch.no_grad():
                for start in range(0, len(requests), self.max_batch):
                    chunk = requests[start:start + self.max_batch]
                    results += self._generate_batch(chunk, params, generator)
        finally:
            self.module.train(was_training)
        return results

    def update_weights(self) -> dict:
        """The engine reads the training weights in place: nothing to move."""
        return {"weight_sync/bytes": 0.0, "weight_sync/zero_copy": 1.0}

    def release_memory(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # KV caches live only inside generate()

    def resume_memory(self) -> None:
        pass

    # -- decoding ------------------------------------------------------------
    def _generate_batch(self, chunk, params: SamplingParams, generator) -> list[GenerationResult]:
        prompts = [p for _, p in chunk]
        tokens, real = left_pad(prompts, self.pad_id, self.device)  # (B, P)
        batch, width = tokens.shape
        total = width + params.max_new_tokens
        context = StaticInferenceContext(batch, total)
        keys_real = torch.ones(batch, total, dtype=torch.bool, device=self.device)
        keys_real[:, :width] = real
        stops = torch.tensor(self.eos_ids + list(params.stop_token_ids), device=self.device)
        done = torch.zeros(batch, dtype=torch.bool, device=self.device)
        out_tokens, out_logprobs = [], []
        logits = self._step(tokens, prefill_mask(real), context)
        for t in range(params.max_new_tokens):
            next_tokens, logprobs = self._sample_and_share(logits, params, generator, batch)
            next_tokens = torch.where(done, self.pad_id, next_tokens)
            out_tokens.append(next_tokens)
            out_logprobs.append(logprobs)
            keys_real[:, width + t] = ~done
            done |= torch.isin(next_tokens, stops)
            if bool(done.all()) or t == params.max_new_tokens - 1:
                break
            decode_mask = ~keys_real[:, None, None, : width + t + 1]  # (B, 1, 1, K)
            logits = self._step(next_tokens[:, None], decode_mask, context)
        return self._results(chunk, torch.stack(out_tokens, 1), torch.stack(out_logprobs, 1), stops)

    def _step(self, input_ids: torch.Tensor, mask: torch.Tensor, context) -> torch.Tensor | None:
        """One forward of this stage; (B, V) fp32 last-position logits on the last stage."""
        g = self.groups
        batch, seq = input_ids.shape
        if not g.is_first_stage:
            hidden = torch.empty(seq, batch, self.module.config.hidden_size,
                                 dtype=self.module.config.params_dtype, device=self.device)
            dist.recv(hidden, group=g.pp, group_src=g.pp_rank - 1)
            self.module.set_input_tensor(hidden)
        offset = context.sequence_len_offset
        positions = torch.arange(offset, offset + seq, device=self.device).expand(batch, seq)
        out = self.module(input_ids, positions, mask, inference_context=context,
                          runtime_gather_output=True)
        context.sequence_len_offset += seq
        if not g.is_last_stage:
            dist.send(out.contiguous(), group=g.pp, group_dst=g.pp_rank + 1)
            return None
        return out[:, -1, : self.vocab_size].float()  # (B, V)

    def _sample_and_share(self, logits, params, generator, batch: int):
        """Last stage samples; the pipeline group receives tokens and log-probs."""
        g = self.groups
        if g.is_last_stage:
            tokens, logprobs = sample(logits, params, generator)
            packed = torch.stack([tokens.double(), logprobs.double()])  # (2, B)
        else:
            packed = torch.empty(2, batch, dtype=torch.float64, device=self.device)
        if g.pp_size > 1:
            dist.broadcast(packed, group=g.pp, group_src=g.pp_size - 1)
        return packed[0].long(), packed[1].float()

    def _results(self, chunk, tokens, logprobs, stops) -> list[GenerationResult]:
        results, stop_set = [], set(stops.tolist())
        for row, (prompt_index, prompt) in enumerate(chunk):
            ids, lps = tokens[row].tolist(), logprobs[row].tolist()
            end = next((i + 1 for i, tok in enumerate(ids) if tok in stop_set), None)
            finish = "stop" if end is not None else "length"
            end = end or len(ids)
            results.append(GenerationResult(prompt, ids[:end], lps[:end], finish, prompt_index))
        return results
