"""Cross-field checks of a :class:`megarl.config.Config`, one short function per section.

Each failure is a :class:`ConfigError` that names the key and the fix. The sections live in
common (shared helpers), moe, layout, rollout, training, inputs; validate runs them all.
"""
from megarl.config_checks.common import uses_critic, uses_ref
from megarl.config_checks.inputs import check_data, check_sft_data
from megarl.config_checks.layout import check_packing
from megarl.config_checks.moe import check_experts, check_moe_rollout, check_router_replay, moe_experts
from megarl.config_checks.rollout import check_multi_turn, check_server, check_sglang
from megarl.config_checks.training import check_actor, check_critic, check_reward, check_reward_cache, check_trainer
from megarl.config_checks.validate import validate, validate_sft

__all__ = [
    "check_actor", "check_critic", "check_data", "check_experts", "check_moe_rollout", "check_multi_turn",
    "check_packing", "check_reward", "check_reward_cache", "check_router_replay", "check_server", "check_sft_data",
    "check_sglang", "check_trainer", "moe_experts", "uses_critic", "uses_ref", "validate", "validate_sft",
]
