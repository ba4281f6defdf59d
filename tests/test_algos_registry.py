"""Registries of extension points: names, dotted paths, and their errors."""
import sys

import pytest
import torch

from megarl.algos.advantages import AdvantageConfig, AdvantageInputs, get_advantage, register_advantage
from megarl.algos.losses import get_policy_loss
from megarl.algos.registry import Registry, load_dotted

USER_MODULE = '''
import torch

def const_adv(batch, cfg):
    """Every real token gets advantage 2 and return 3."""
    m = batch.response_mask.to(torch.float64)
    return 2 * m, 3 * m
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "megarl_test_user_adv.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "megarl_test_user_adv"
    sys.modules.pop("megarl_test_user_adv", None)


def test_unknown_name_lists_available():
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'nope'; available: gae, grpo"):
        get_advantage("nope")
    with pytest.raises(ValueError, match=r"available: gspo, ppo, ppo_clip"):
        get_policy_loss("ppo2")
    assert get_policy_loss("ppo") is get_policy_loss("ppo_clip")  # alias


@pytest.mark.parametrize("sep", [":", "."])
def test_dotted_path_user_estimator(user_module, sep):
    """The user function gives 2 and 3 on the mask [1, 0]."""
    fn = get_advantage(f"{user_module}{sep}const_adv")
    batch = AdvantageInputs(torch.zeros(1, 2), torch.tensor([[1.0, 0.0]]))
    adv, ret = fn(batch, AdvantageConfig())
    assert adv.tolist() == [[2.0, 0.0]] and ret.tolist() == [[3.0, 0.0]]


def test_dotted_path_errors_and_stdlib():
    assert load_dotted("math:sqrt")(9.0) == 3.0
    assert load_dotted("os.path.join")("a", "b") == "a/b"
    with pytest.raises(ValueError, match="cannot import module"):
        load_dotted("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        load_dotted("math:nope")


def test_register_twice_is_an_error():
    reg: Registry = Registry("thing")
    reg.register("a")(len)
    reg.register("a")(len)  # same function again is fine
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a")(abs)
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("gae")(abs)


BAD_USER_MODULE = '''
import torch

def flat(batch, cfg):
    """(B,) instead of (B, T): would broadcast silently."""
    return batch.sequence_scores(), batch.sequence_scores()

def nan_on_real_token(batch, cfg):
    adv = torch.zeros_like(batch.token_rewards)
    adv[0, 0] = float("nan")
    return adv, adv

def nan_on_padding(batch, cfg):
    adv = torch.where(batch.response_mask != 0, 1.0, float("nan"))
    return adv, adv

def one_tensor(batch, cfg):
    return batch.token_rewards

not_callable = 3
'''


@pytest.fixture
def bad_module(tmp_path, monkeypatch):
    (tmp_path / "megarl_test_bad_adv.py").write_text(BAD_USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "megarl_test_bad_adv"
    sys.modules.pop("megarl_test_bad_adv", None)


@pytest.mark.parametrize("fn,needle", [
    ("flat", "returned advantages of shape (2,); want (2, 3) (B, T)"),
    ("nan_on_real_token", "returned NaN/inf advantages at 1 response tokens"),
    ("one_tensor", "returned Tensor; return (advantages, returns)"),
])
def test_user_estimator_output_is_checked(bad_module, fn, needle):
    from megarl.algos.advantages import compute_advantages
    from megarl.errors import ExtensionError

    batch = AdvantageInputs(torch.ones(2, 3), torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))
    with pytest.raises(ExtensionError) as e:
        compute_advantages(f"{bad_module}:{fn}", batch, AdvantageConfig())
    assert needle in str(e.value) and f"algorithm.advantage='{bad_module}:{fn}'" in str(e.value)


def test_nan_outside_the_mask_is_allowed(bad_module):
    from megarl.algos.advantages import compute_advantages

    batch = AdvantageInputs(torch.ones(1, 3), torch.tensor([[1.0, 1.0, 0.0]]))
    adv, _ = compute_advantages(f"{bad_module}:nan_on_padding", batch, AdvantageConfig())
    assert adv[0, :2].tolist() == [1.0, 1.0]


@pytest.mark.parametrize("key,value,needle", [
    ("algorithm.advantage", "no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
    ("algorithm.advantage", "megarl_test_bad_adv:not_callable", "is not callable"),
    ("algorithm.advantage", "megarl_test_bad_adv:missing", "has no attribute 'missing'"),
    ("actor.policy_loss", "no_such_module_xyz:loss", "cannot import module"),
    ("actor.policy_loss", "ppo3", "unknown policy loss 'ppo3'"),
])
def test_extension_paths_fail_at_config_time(bad_module, monkeypatch, key, value, needle):
    import os

    from megarl.errors import ConfigError
    from megarl.cli import load_config
    from megarl.config import Config
    from megarl.config_checks import validate

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.chdir(root)
    cfg = load_config([os.path.join(root, "yaml", "tiny_grpo.yaml"), f"{key}={value}"], Config)
    with pytest.raises(ConfigError) as e:
        validate(cfg, 1)
    assert str(e.value).startswith(f"{key}={value!r}: ") and needle in str(e.value) and "\n" not in str(e.value)
