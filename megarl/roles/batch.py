"""The batch every role reads: prompt + response tokens and typed per-token tensors.

Layout: ``input_ids`` (B, L) holds prompt then response, right-padded;
``response_mask`` (B, L) is the loss mask: 1 at response tokens the model
sampled, 0 at the prompt, padding, and context appended inside a multi-turn
response (tool results, user turns). Every per-token field is (B, L) aligned
with ``input_ids``: entry t belongs to token t (the log-prob of token t given
tokens < t; the value of the state before token t). Entry 0 of a log-prob is 0:
nothing predicts the first token. A field is None until the phase that fills it
has run (rollout -> ref / values / old log-probs -> advantages).
``model_inputs`` is set on a micro-batch by the role that runs it: the token
ids, positions and next-token targets the model reads, padded or packed
(:mod:`megarl.roles.inputs`).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from megarl.roles.inputs import ModelInputs

PER_TOKEN = ("rollout_logprobs", "old_logprobs", "ref_logprobs", "values", "advantages", "returns", "token_versions")
PER_SEQUENCE = ("greedy_scores",)
PER_POSITION = ("expert_ids",)  # (B, L, ...) beside the token fields, kept in their compact dtype


@dataclass
class SampleBatch:
    """B sequences of one DP rank."""

    input_ids: torch.Tensor  # (B, L) long tokens
    response_mask: torch.Tensor  # (B, L) float loss mask
    lengths: torch.Tensor  # (B,) real tokens (prompt + response)
    rollout_logprobs: Optional[torch.Tensor] = None  # (B, L) the engine's, under the sampling temperature
    old_logprobs: Optional[torch.Tensor] = None  # (B, L) training forward with the weights that sampled
    ref_logprobs: Optional[torch.Tensor] = None  # (B, L) reference model
    values: Optional[torch.Tensor] = None  # (B, L) critic, before the update
    advantages: Optional[torch.Tensor] = None  # (B, L)
    returns: Optional[torch.Tensor] = None  # (B, L) value targets
    greedy_scores: Optional[torch.Tensor] = None  # (B,) score of the prompt's greedy response (remax)
    # MoE, recorded by the engine: (B, L, layers, k) uint8 | int16 expert ids that routed input token t at
    # every MoE layer in the rollout; unrecorded positions marked (megarl/models/router_replay.py)
    expert_ids: Optional[torch.Tensor] = None
    token_versions: Optional[torch.Tensor] = None  # (B, L) long policy version that sampled each response token
    #                                                (rollout.partial; 0 off the response), None: all policy_version
    policy_version: int = 0  # trainer steps of the weights that sampled (how stale a replayed batch is);
    #                          with partial rollouts the oldest token's
    model_inputs: Optional["ModelInputs"] = None  # a micro-batch's model view, set by ModelRole.run

    def __len__(self) -> int:
        return self.input_ids.size(0)

    @property
    def width(self) -> int:
        return self.input_ids.size(1)

    def select(self, index) -> "SampleBatch":
        """Rows ``index`` (tensor or list), cut to their own longest sequence."""
        index = torch.as_tensor(index, dtype=torch.long, device=self.input_ids.device)
        lengths = self.lengths[index]
        width = int(lengths.max()) if len(index) else 1
        rows = {f.name: _rows(getattr(self, f.name), index, width) for f in fields(self)
                if f.name in PER_TOKEN + PER_SEQUENCE + PER_POSITION or f.name in ("input_ids", "response_mask")}
        return replace(self, lengths=lengths, model_inputs=None, **rows)

    def micro_batch_index(self, micro_batch_size: int, max_tokens: int = 0, min_bins: int = 1) -> list[list[int]]:
        """Row indices of each micro-batch: fixed ``micro_batch_size`` rows, or
        (``max_tokens`` > 0) first-fit-decreasing bins of at most ``max_tokens`` tokens,
        at least ``min(min_bins, rows)`` of them."""
        if max_tokens > 0:
            from megarl.data.packing import pack_sequences

            bins = pack_sequences(self.lengths.tolist(), max_tokens, min(min_bins, len(self)))
            return [sorted(b) for b in bins]
        n = len(self)
        return [list(range(i, min(i + micro_batch_size, n))) for i in range(0, n, micro_batch_size)]


def _rows(t: Optional[torch.Tensor], index: torch.Tensor, width: int) -> Optional[torch.Tensor]:
    if t is None:
        return None
    return t[index, :width] if t.dim() >= 2 else t[index]


def pad_to(t: torch.Tensor, width: int, value: float = 0.0) -> torch.Tensor:
    """Right-pads dim 1 of ``t`` (B, W) to ``width``."""
    if t.size(1) >= width:
        return t[:, :width]
    return torch.nn.functional.pad(t, (0, width - t.size(1)), value=value)


def cat_rows(parts: list[torch.Tensor], width: int) -> torch.Tensor:
    """Concatenates (b_i, w_i) pieces into (sum b_i, width)."""
    return torch.cat([pad_to(p, width) for p in parts], dim=0)
