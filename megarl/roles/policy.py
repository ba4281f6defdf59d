"""Actor and reference: token log-probs and entropy from vocab-parallel logits; the policy update.

Log-probs never gather the vocabulary: ``megarl_kernels.logprob_entropy``
reduces max and sum-exp over the TP group. Vocabulary padding rows (zeros in
the output layer) are masked out, so the distribution is the checkpoint's.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from megarl.algos import Aggregation, PolicyLossConfig, entropy_loss, get_policy_loss, kl_loss, masked_sum
from megarl.algos.rollout_correction import RolloutCorrection, correct
from megarl.config import ActorConfig
from megarl_kernels import logprob_entropy
from megarl.roles.base import ModelRole, imbalance
from megarl.roles.batch import SampleBatch
from megarl.roles.inputs import ModelInputs

PADDED_VOCAB_LOGIT = -1e4  # exp(-1e4 - max) is exactly 0 in fp32 and bf16


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int, tp_rank: int) -> torch.Tensor:
    """Pushes this shard's vocabulary-padding columns to -1e4. logits: (..., V/tp)."""
    v_local = logits.size(-1)
    real_here = vocab_size - tp_rank * v_local  # real ids in this shard (may be <= 0)
    if real_here >= v_local:
        return logits
    keep = torch.arange(v_local, device=logits.device) < real_here
    return logits.masked_fill(~keep, PADDED_VOCAB_LOGIT)


def token_logprobs(logits: torch.Tensor, inputs: ModelInputs, groups, vocab_size: int,
                   temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(b, l, V/tp) | (1, T, V/tp) logits -> log-prob of each token given the previous ones
    of its sequence and the entropy of that prediction, both (b, l) fp32 with column 0 = 0.

    Each position scores its precomputed next-token target, so a packed row never
    predicts across a sequence boundary."""
    logits = mask_padded_vocab(logits, vocab_size, groups.tp_rank)  # (b|1, l|T, V/tp)
    tp_group = groups.tp if groups.tp_size > 1 else None
    lp, ent = logprob_entropy(logits, inputs.targets, tp_group, temperature)  # (b|1, l|T)
    return inputs.to_rows(lp), inputs.to_rows(ent)


def policy_loss_config(cfg: ActorConfig) -> PolicyLossConfig:
    """The policy losses' clip ranges from the actor section."""
    return PolicyLossConfig(clip_low=cfg.clip_low, clip_high=cfg.clip_high, clip_c=cfg.dual_clip,
                            gspo_clip_low=cfg.gspo_clip_low, gspo_clip_high=cfg.gspo_clip_high)


class Policy(ModelRole):
    """The actor (with ``trainable``) or the frozen reference policy.

    ``correction`` (algorithm.rollout_correction) weights and masks the policy-gradient
    term of the update's loss by the ratio of the old log-probs to the rollout's."""

    def __init__(self, *args, correction: RolloutCorrection = RolloutCorrection(), **kwargs):
        super().__init__(*args, **kwargs)
        self.correction = correction

    def logprobs(self, batch: SampleBatch, micro_batch_size: int, temperature: float,
                 max_tokens: int = 0) -> dict[str, torch.Tensor]:
        """{"logprobs", "entropy"}: (B, L) each."""

        def head(mb: SampleBatch, logits):
            lp, ent = token_logprobs(logits, mb.model_inputs, self.groups, self.info.vocab_size, temperature)
            return logits.new_zeros(()), torch.tensor(1), {"logprobs": lp, "entropy": ent}

        return self.forward_collect(batch, micro_batch_size, head, max_tokens)

    def update(self, batch: SampleBatch, cfg: ActorConfig, temperature: float, mini_batches: list,
               norm_len: int) -> list[dict[str, float]]:
        """One optimizer step per mini-batch (index lists into ``batch``, which holds old_logprobs)."""
        if batch.old_logprobs is None:
            raise ValueError("Policy.update needs old_logprobs in the batch; an on-policy step uses update_on_policy")
        head = self._loss_head(cfg, temperature, norm_len)
        steps = []
        for idx in mini_batches:
            dealt = self._deal(batch.select(idx), cfg)
            make = lambda mini=dealt.batch: self._micro_batches(mini, cfg)  # noqa: E731  (re-split after an OOM)
            steps.append({**self.train_step(make, head), **imbalance(dealt)})
        return steps

    def update_on_policy(self, batch: SampleBatch, cfg: ActorConfig, temperature: float, index,
                         norm_len: int) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
        """The one optimizer step of an exactly on-policy update, on rows ``index`` (all of ``batch``).

        The batch has no old_logprobs: the loss takes this forward's own log-probs,
        detached, as the old ones (ratio exactly 1), which is what a separate forward
        with the same weights would give. Returns the step's metrics and
        {"logprobs", "entropy"} (B, L) of this forward in ``batch`` order, on every stage.
        """
        if batch.old_logprobs is not None or len(index) != len(batch):
            raise ValueError("update_on_policy takes a batch without old_logprobs and one mini-batch of all its rows")
        index = torch.as_tensor(index)
        dealt = self._deal(batch.select(index), cfg)
        mine = dealt.batch
        head = self._loss_head(cfg, temperature, norm_len)

        def attempt():  # re-split under the back-off budget after an OOM
            rows = self.micro_batch_index(mine, cfg.micro_batch_size, cfg.max_tokens_per_micro)
            return rows, self.train_run([mine.select(r) for r in rows], head)

        rows, results = self.backoff.retrying("update", attempt)
        per_token = {k: [r.pop(k) for r in results] for k in ("logprobs", "entropy")}  # (b_i, l_i) each
        step = {**self.finish_step(results), **imbalance(dealt)}
        out = {}
        for k, parts in per_token.items():
            in_mini = dealt.back(_scatter_rows(parts, [torch.as_tensor(r) for r in rows], len(mine), mine.width))
            out[k] = _scatter_rows([in_mini], [index], len(batch), batch.width)  # mini row j is batch row index[j]
        return step, out

    def _deal(self, mini: SampleBatch, cfg: ActorConfig):
        return self.deal(mini, keep_counts=cfg.max_tokens_per_micro <= 0)

    def _loss_head(self, cfg: ActorConfig, temperature: float, norm_len: int):
        """The update's head: (loss sum, count, token-weighted metric sums); without
        old_logprobs in the micro-batch, old = this forward's log-probs (detached),
        and the per-token "logprobs" and "entropy" come back beside the metrics."""
        loss_fn = get_policy_loss(cfg.policy_loss)
        loss_cfg = policy_loss_config(cfg)
        sums = Aggregation(cfg.loss_agg, global_tokens=1.0, global_seqs=1.0, norm_len=norm_len)
        by_tokens = cfg.loss_agg == "token-mean"

        def head(mb: SampleBatch, logits):
            mask = mb.response_mask
            lp, ent = token_logprobs(logits, mb.model_inputs, self.groups, self.info.vocab_size, temperature)
            on_policy = mb.old_logprobs is None
            old = lp.detach() if on_policy else mb.old_logprobs
            pg_mask, pg_agg = self._corrected(mb, old, sums)
            pg, m = loss_fn(lp, old, mb.advantages, pg_mask, loss_cfg, pg_agg)
            loss = pg
            if cfg.entropy_coef:
                loss = loss + entropy_loss(ent, mask, cfg.entropy_coef, sums)[0]
            if cfg.kl_loss_coef:
                kl, kl_m = kl_loss(lp, mb.ref_logprobs, mask, cfg.kl_loss_estimator, sums)
                loss = loss + cfg.kl_loss_coef * kl
                m["kl_loss"] = kl_m["kl"]
            count = mask.sum() if by_tokens else (mask.sum(-1) > 0).sum()
            tokens = mask.sum()
            metrics = {f"actor/{k}": v * tokens for k, v in m.items()}  # token-weighted sums
            metrics.update({"actor/pg_loss": pg.detach(), "actor/entropy": masked_sum(ent, mask).detach(),
                            "actor/count": count.detach().float(), "actor/tokens": tokens.detach()})
            if on_policy:
                metrics.update(logprobs=lp.detach(), entropy=ent.detach())  # (b, l)
            return loss, count.long(), metrics

        return head

    def _corrected(self, mb: SampleBatch, old: torch.Tensor, sums: Aggregation):
        """(loss mask, aggregation) of the policy-gradient term under ``self.correction``: dropped
        tokens leave the mask, the weights ride on the aggregation, and the normalizers still
        count the response mask (a dropped token is a token of weight 0). Entropy and KL-loss
        terms keep the plain mask."""
        if not self.correction.enabled:
            return mb.response_mask, sums
        if mb.rollout_logprobs is None:
            raise ValueError("algorithm.rollout_correction needs the rollout's log-probs in the batch")
        c = correct(old, mb.rollout_logprobs, mb.response_mask, self.correction)
        keep = c.keep.to(mb.response_mask.dtype)  # (b, l)
        return keep, replace(sums, weights=c.weights, count_mask=mb.response_mask)

    def _micro_batches(self, mini: SampleBatch, cfg: ActorConfig) -> list[SampleBatch]:
        return [mini.select(i) for i in self.micro_batch_index(mini, cfg.micro_batch_size, cfg.max_tokens_per_micro)]


def _scatter_rows(parts: list[torch.Tensor], rows: list[torch.Tensor], n: int, width: int) -> torch.Tensor:
    """(b_i, l_i) pieces put back at rows ``rows[i]`` of an (n, width) tensor, zero-padded."""
    out = parts[0].new_zeros(n, width)
    for r, part in zip(rows, parts):
        out[r.to(out.device), :part.size(1)] = part
    return out
