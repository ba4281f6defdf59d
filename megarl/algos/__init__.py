"""Advantage estimators, policy/value losses, KL penalties (pure functions over tensors).

Token tensors are (B, T) over response tokens with `response_mask` (B, T);
scores and group ids are (B,).
"""
from megarl.algos.advantages import (
    AdvantageConfig,
    AdvantageInputs,
    compute_advantages,
    get_advantage,
    register_advantage,
)
from megarl.algos.aggregation import AGG_MODES, Aggregation, agg_loss, count_tokens_and_seqs
from megarl.algos.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_to_rewards,
    kl_loss,
    kl_penalty,
)
from megarl.algos.losses import (
    PolicyLossConfig,
    entropy_loss,
    get_policy_loss,
    register_policy_loss,
    value_loss,
)
from megarl.algos.masked import masked_mean, masked_sum, masked_var, masked_whiten, zero_masked
from megarl.algos.returns import discounted_returns, gae_advantages, group_advantages, group_normalized_scores
