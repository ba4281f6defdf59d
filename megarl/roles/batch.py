"""The batch every role reads: prompt + response tokens and per-token tensors.

Layout: ``input_ids`` (B, L) holds prompt then response, right-padded;
``response_mask`` (B, L) is 1 at response tokens. Per-token tensors in
``tensors`` are (B, L) aligned with ``input_ids``: entry t belongs to token t
(the log-prob of token t given tokens < t; the value of the state before
token t). Entry 0 of a log-prob is 0: nothing predicts the first token.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SampleBatch:
    """B sequences of one DP rank."""

    input_ids: torch.Tensor  # (B, L) long
    response_mask: torch.Tensor  # (B, L) float
    lengths: torch.Tensor  # (B,) real tokens (prompt + response)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # (B, L) or (B,)

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
        return SampleBatch(
            self.input_ids[index, :width],
            self.response_mask[index, :width],
            lengths,
            {k: (v[index, :width] if v.dim() == 2 else v[index]) for k, v in self.tensors.items()},
        )

    def micro_batch_index(self, micro_batch_size: int, max_tokens: int = 0) -> list[list[int]]:
        """Row indices of each micro-batch: fixed ``micro_batch_size`` rows, or
        (``max_tokens`` > 0) first-fit-decreasing bins of at most ``max_tokens`` tokens."""
        if max_tokens > 0:
            from megarl.data.packing import pack_sequences

            return [sorted(b) for b in pack_sequences(self.lengths.tolist(), max_tokens)]
        n = len(self)
        return [list(range(i, min(i + micro_batch_size, n))) for i in range(0, n, micro_batch_size)]

    def position_ids(self) -> torch.Tensor:
        return torch.arange(self.width, device=self.input_ids.device).expand(len(self), -1)


def pad_to(t: torch.Tensor, width: int, value: float = 0.0) -> torch.Tensor:
    """Right-pads dim 1 of ``t`` (B, W) to ``width``."""
    if t.size(1) >= width:
        return t[:, :width]
    return torch.nn.functional.pad(t, (0, width - t.size(1)), value=value)


def cat_rows(parts: list[torch.Tensor], width: int) -> torch.Tensor:
    """Concatenates (b_i, w_i) pieces into (sum b_i, width)."""
    return torch.cat([pad_to(p, width) for p in parts], dim=0)
