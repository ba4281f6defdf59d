"""Rewards: rule-based functions, a registry, reward-model interface, composite and cache."""
from megarl.rewards.cache import RewardCache
from megarl.rewards.composite import CompositeReward, RewardOutput
from megarl.rewards.math_answer import extract_answer, math_answer_reward, normalize_answer
from megarl.rewards.registry import get_reward, register_reward
from megarl.rewards.rules import DEFAULT_FORMAT_PATTERN, format_reward
from megarl.rewards.terms import RewardModelScorer, RewardModelTerm, RewardSample, RewardTerm
