"""Helpers the section checks share: number and count checks, the HF config reader, role defaults."""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

from megarl.errors import ConfigError
from megarl.config import Config


GROUP_ADVANTAGES = {"grpo", "rloo", "reinforce_pp_baseline"}


SCORE_ONLY_ADVANTAGES = {"grpo", "rloo"}  # advantages from sequence scores alone (no token rewards)


def read_hf_config(path: str, key: str = "model.path") -> dict:
    """config.json of a Hugging Face directory, or a ConfigError naming ``key``."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"{key}: '{path}' has no config.json; point it at a Hugging Face model directory")
    try:
        return json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{cfg_file}:{e.lineno}: invalid JSON ({e.msg})") from None


def check_numbers(obj, prefix: str, keys, low: float | None = None, strict: bool = False) -> None:
    """Each ``obj.<key>`` must be finite and, with ``low``, >= low (> low when ``strict``)."""
    for key in keys:
        value = getattr(obj, key)
        bad = not math.isfinite(value) or (low is not None and (value < low or (strict and value == low)))
        if bad:
            bound = "" if low is None else f" {'>' if strict else '>='} {low:g}"
            raise ConfigError(f"{prefix}.{key}={value} must be a finite number{bound}")


def check_counts(obj, prefix: str, keys, low: int = 1) -> None:
    """Each integer ``obj.<key>`` must be >= low."""
    for key in keys:
        if getattr(obj, key) < low:
            raise ConfigError(f"{prefix}.{key}={getattr(obj, key)} must be >= {low}")


def have_te() -> bool:
    """transformer_engine is importable (megarl.models.builder.have_te, without importing megatron)."""
    return importlib.util.find_spec("transformer_engine") is not None


def one_line_error(e: Exception) -> str:
    return " ".join(str(e.args[0] if e.args else e).split())


def uses_critic(cfg: Config) -> bool:
    """critic.enable, defaulting to "the advantage estimator needs values"."""
    return cfg.critic.enable if cfg.critic.enable is not None else cfg.algorithm.advantage == "gae"


def uses_ref(cfg: Config) -> bool:
    """ref.enable, defaulting to "some KL term is on"."""
    if cfg.ref.enable is not None:
        return cfg.ref.enable
    return cfg.algorithm.kl_in_reward or cfg.actor.kl_loss_coef > 0
