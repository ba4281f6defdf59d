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
