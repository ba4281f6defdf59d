"""rollout.sglang.* keys: defaults, the cross-field refusals, and what reaches SGLangOptions (no SGLang needed).

Expected: deterministic inference off by default; SGLang's dtype bfloat16 whatever model.dtype
(float32 by default: SGLang's Hopper attention needs 16-bit), said in the start-up line; parallel.cp > 1
and parallel.pp > 1 refused with one-line ConfigErrors naming the key; every rollout.sglang key reaches
SGLangOptions. Not covered: the engine itself (test_rollout_sglang*.py).
"""
from types import SimpleNamespace

import pytest


def _cfg(**parallel):
    from megarl.config import Config

    cfg = Config()
    cfg.rollout.engine = "sglang"
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    return cfg


def test_defaults():
    from megarl.config import SGLangConfig
    from megarl.rollout.sglang import SGLangOptions

    s = SGLangConfig()
    assert (s.deterministic, s.dtype, s.weights_cpu_backup, s.start_timeout_s) == (False, "bfloat16", False, 1800.0)
    o = SGLangOptions(model_path="x")
    assert (o.deterministic, o.dtype, o.weights_cpu_backup) == (False, "bfloat16", False)


@pytest.mark.parametrize("key, value, match", [("cp", 2, "^rollout.engine=sglang needs parallel.cp=1 "),
                                               ("pp", 2, "^rollout.engine=sglang needs parallel.pp=1 ")])
def test_context_and_pipeline_parallel_refused(key, value, match):
    from megarl.config_checks import check_sglang
    from megarl.errors import ConfigError

    with pytest.raises(ConfigError, match=match) as e:
        check_sglang(_cfg(**{key: value}))
    assert "\n" not in str(e.value)
    check_sglang(_cfg())  # cp = pp = 1: fine


def test_start_timeout_must_be_positive():
    from megarl.config_checks import check_sglang
    from megarl.errors import ConfigError

    cfg = _cfg()
    cfg.rollout.sglang.start_timeout_s = 0
    with pytest.raises(ConfigError, match="rollout.sglang.start_timeout_s"):
        check_sglang(cfg)


def test_every_key_reaches_the_options(monkeypatch):
    import megarl.rollout.sglang as sglang
    from megarl.rollout.factory import _sglang, engine_title

    built = {}
    monkeypatch.setattr(sglang, "SGLangEngine", lambda module, groups, info, stops, options: built.setdefault("o", options))
    cfg = _cfg()
    s = cfg.rollout.sglang
    s.mem_fraction_static, s.deterministic, s.weights_cpu_backup, s.start_timeout_s = 0.3, True, True, 99.0
    s.max_running_requests, s.update_bucket_mb, s.dtype = 7, 64.0, "float16"
    assert cfg.model.dtype == "float32"
    _sglang(cfg, SimpleNamespace(module=None, info=None), SimpleNamespace(tp_rank=0), [3], 0)
    o = built["o"]
    assert (o.mem_fraction_static, o.deterministic, o.weights_cpu_backup, o.start_timeout_s) == (0.3, True, True, 99.0)
    assert (o.max_running_requests, o.update_bucket_mb, o.dtype, o.model_path) == (7, 64.0, "float16", cfg.model.path)
    assert engine_title(cfg) == ("the sglang rollout engine (it samples in rollout.sglang.dtype=float16, the actor "
                                 "trains in model.dtype=float32; algorithm.rollout_correction.preset=sglang corrects "
                                 "for it)")
    cfg.model.dtype = "float16"
    assert engine_title(cfg) == "the sglang rollout engine"
