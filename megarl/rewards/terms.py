"""The pieces a CompositeReward is built from: samples, terms, the RM interface."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import torch
from torch import Tensor


@dataclass
class RewardSample:
    """One rollout as the reward functions see it."""

    prompt: str
    response: str
    ground_truth: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    """The sample's other dataset fields, passed to reward functions as `extra`."""


class RewardModelScorer(Protocol):
    """Scores a batch with a reward model: `scorer(batch) -> (B,) tensor`.

    `batch` is what the caller hands CompositeReward as `rm_batch` (e.g. token
    ids already on the RM's device), or the list of RewardSample when it gives
    none. A NaN/inf entry marks that sample as failed.
    """

    def __call__(self, batch: Any) -> Tensor: ...


@dataclass
class _Shaping:
    """value -> clip(value * scale + shift); weight in the total; fallback on failure."""

    weight: float = 1.0
    """Multiplies the shaped value in the per-sample total."""
    scale: float = 1.0
    """Shaped value = raw * scale + shift (e.g. RM in [-1, 1] to [0, 5]: scale 2.5, shift 2.5)."""
    shift: float = 0.0
    """See scale."""
    clip: tuple[float, float] | None = None
    """(low, high) bounds of the shaped value; None: unbounded."""
    fallback: float = 0.0
    """Shaped value of a sample whose scoring raised or gave NaN/inf/a non-number."""

    def shape(self, raw: Tensor) -> Tensor:
        """raw (B,) with NaN for failures -> shaped (B,) with fallback for failures."""
        shaped = raw * self.scale + self.shift
        if self.clip is not None:
            shaped = shaped.clamp(self.clip[0], self.clip[1])
        return torch.where(torch.isfinite(raw), shaped, torch.full_like(raw, self.fallback))


@dataclass
class RewardTerm(_Shaping):
    """A per-sample reward function term (see megarl.rewards.registry for the signature)."""

    name: str = "format"
    """Registered reward name or dotted path 'pkg.module:function'."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments passed to the function."""
    cache: bool | None = None
    """Look values up in the composite's RewardCache (keyed on prompt, response, ground truth and
    `extra`). None: yes for a registered reward, no for a 'module:function' one (set True when the
    function is a pure function of its arguments)."""
    label: str | None = None
    """Name in metrics and per-term outputs; defaults to `name`. Must be unique."""

    @classmethod
    def of(cls, entry: "RewardTerm | Sequence[Any]") -> "RewardTerm":
        """A RewardTerm, or a tuple (name, weight[, kwargs])."""
        if isinstance(entry, RewardTerm):
            return entry
        name, weight, *rest = entry
        return cls(name=name, weight=float(weight), kwargs=dict(rest[0]) if rest else {})

    @property
    def key(self) -> str:
        return self.label or self.name


@dataclass
class RewardModelTerm(_Shaping):
    """A reward-model term: scores come from `scorer` for the whole batch."""

    scorer: RewardModelScorer | None = None
    """The caller's RM scorer (required)."""
    cache: bool = False
    """Cache per-sample scores; used only when no rm_batch is given (misses are re-scored as samples)."""
    label: str = "rm"
    """Name in metrics and per-term outputs."""

    @property
    def key(self) -> str:
        return self.label
