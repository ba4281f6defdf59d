"""``actor.forward_micro_batch_size`` / ``critic.forward_micro_batch_size``: the forward-only passes.

The old and reference log-probs and the critic's values take micro-batches of their own size
(0: the update's ``micro_batch_size``): with no activations kept, larger ones run faster
(docs/performance.md).
Checked here: ``prepare`` hands each forward its size; the log-probs do not depend on it
beyond fp32 rounding (1e-6 relative; rows are computed independently, only the matmul shapes
change); a negative size is a config error.
"""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dist_helpers import spawn


class _Recorder:
    """Stands in for a role: records the micro-batch size of each forward it is asked for."""

    replay = None  # no router replay (a dense model)

    def __init__(self, log: list, name: str):
        self.log, self.name = log, name

    def logprobs(self, batch, micro, temperature, max_tokens):
        self.log.append((self.name, micro))
        return {"logprobs": torch.zeros(2, 3), "entropy": torch.zeros(2, 3)}

    def values(self, batch, micro):
        self.log.append((self.name, micro))
        return torch.zeros(2, 3)


def _prepare_sizes(**sizes) -> list:
    from contextlib import nullcontext

    from megarl.config import Config
    from megarl.trainer import phases

    cfg = Config()
    cfg.actor.ppo_epochs = 2  # not on-policy: the old log-probs get a forward of their own
    cfg.algorithm.advantage = "gae"
    for key, value in sizes.items():
        role, name = key.split("__")
        setattr(getattr(cfg, role), name, value)
    log = []
    actor = _Recorder(log, "old")
    actor.module = SimpleNamespace(config=SimpleNamespace(hidden_dropout=0.0, attention_dropout=0.0))
    phases.prepare(SimpleNamespace(batch=_Batch()), cfg, step=0, dp_size=1, actor=actor, ref=_Recorder(log, "ref"),
                   critic=_Recorder(log, "values"), timer=lambda name: nullcontext())
    return log


class _Batch:
    """Two rows; prepare sets the reference log-probs and the values on it."""

    ref_logprobs = values = None

    def __len__(self):
        return 2


@pytest.mark.parametrize("sizes, expected", [
    ({"actor__micro_batch_size": 4, "critic__micro_batch_size": 2}, {"old": 4, "ref": 4, "values": 2}),
    ({"actor__micro_batch_size": 4, "actor__forward_micro_batch_size": 32, "critic__micro_batch_size": 2,
      "critic__forward_micro_batch_size": 16}, {"old": 32, "ref": 32, "values": 16}),
])
def test_prepare_gives_each_forward_its_size(sizes, expected, monkeypatch):
    from megarl.trainer import phases

    monkeypatch.setattr(phases, "_set_old_logprobs", lambda rollout, out: None)
    assert dict(_prepare_sizes(**sizes)) == expected


def test_negative_size_is_a_config_error():
    from megarl.errors import ConfigError
    from megarl.config import Config
    from megarl.config_checks import check_actor

    cfg = Config()
    cfg.actor.forward_micro_batch_size = -1
    with pytest.raises(ConfigError, match=r"actor.forward_micro_batch_size=-1 must be >= 0"):
        check_actor(cfg)


def _logprobs_job(rank):
    from test_broken_inputs_checkpoint import _actor
    from test_recompute import _batch

    actor, _ = _actor()
    batch = _batch(actor.info.vocab_size)
    return {m: actor.logprobs(batch, m, 1.0)["logprobs"].numpy().copy() for m in (1, 3, 8)}


def test_logprobs_do_not_depend_on_the_forward_micro_batch():
    out = spawn(_logprobs_job, 1)[0]
    assert np.abs(out[1]).max() > 0
    for m in (3, 8):
        np.testing.assert_allclose(out[m], out[1], rtol=1e-6, atol=1e-6)  # 3e-7 relative seen
