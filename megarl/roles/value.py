"""Critic and reward model: a value head on a transformer.

The model's output at position t is a scalar for the state after token t.
The critic's value of token t is the output at t - 1 (the state in which token
t was chosen), aligned like the log-probs; a reward model's score of a whole
response is its output at the last real token. Both read positions through
``mb.model_inputs``, so padded and packed micro-batches give the same numbers.
"""
from __future__ import annotations

import torch

from megarl.algos import Aggregation, value_loss
from megarl.config import CriticConfig
from megarl.roles.base import ModelRole, imbalance
from megarl.roles.batch import SampleBatch
from megarl.roles.inputs import ModelInputs


def token_values(out: torch.Tensor, inputs: ModelInputs) -> torch.Tensor:
    """(b, l, 1) | (1, T, 1) head output -> (b, l) fp32 value of the state before each token
    (the output at the previous token of the same sequence; column 0 = 0)."""
    return inputs.to_rows(out[..., 0].float())


class Critic(ModelRole):
    """Values and the clipped value update."""

    def values(self, batch: SampleBatch, micro_batch_size: int) -> torch.Tensor:
        def head(mb, out):
            return out.new_zeros(()), torch.tensor(1), {"values": token_values(out, mb.model_inputs)}

        return self.forward_collect(batch, micro_batch_size, head)["values"]

    def update(self, batch: SampleBatch, cfg: CriticConfig, mini_batches: list) -> list[dict[str, float]]:
        sums = Aggregation("token-mean", global_tokens=1.0)

        def head(mb: SampleBatch, out):
            mask = mb.response_mask
            v = token_values(out, mb.model_inputs)
            loss, m = value_loss(v, mb.values, mb.returns, mask, cfg.value_clip, sums)
            tokens = mask.sum()
            return loss, tokens.long(), {
                "critic/vf_loss": loss.detach(), "critic/tokens": tokens.detach(),
                "critic/vf_clip_frac": m["vf_clip_frac"] * tokens,
            }

        steps = []
        for index in mini_batches:
            dealt = self.deal(batch.select(index), keep_counts=True)
            def micro(mini=dealt.batch):  # re-split under the back-off budget after an OOM
                return [mini.select(i) for i in self.micro_batch_index(mini, cfg.micro_batch_size, 0)]
            steps.append({**self.train_step(micro, head), **imbalance(dealt)})
        return steps


class RewardModel(ModelRole):
    """Scores whole responses: the value head at the last real token."""

    @property
    def oom_group(self):
        """A model replica's ranks (TP x PP): scoring runs where samples are, not on every rank at once
        (DAPO's later rounds score only on the ranks still short), and its shapes are the same on every
        rank of a replica (CP ranks hold equal slices), so they run out of memory together."""
        return self.groups.collection.mp

    def scores(self, batch: SampleBatch, micro_batch_size: int) -> torch.Tensor:
        def head(mb: SampleBatch, out):
            score = mb.model_inputs.at_last_token(out[..., 0].float())  # (b,)
            return out.new_zeros(()), torch.tensor(1), {"scores": score}

        return self.forward_collect(batch, micro_batch_size, head)["scores"]
