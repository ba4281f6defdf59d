"""A non-finite loss or gradient never reaches the weights, the Adam state or an export.

One process (gloo, CPU, fp32) builds the tiny actor and makes one good update
(so Adam has moments), then updates with heads that give (1) a NaN loss whose
gradient is finite (loss + NaN: d/d output is unchanged) and (2) a finite loss
whose gradient is NaN (sqrt(0 * sum(output)): value 0, gradient 0.5/0 * 0).
Each must be skipped: every parameter, every main (optimizer) parameter and
every Adam moment bitwise as before, the LR schedule not advanced, the step
flagged ``nonfinite``. Fed to the trainer's bookkeeping, skips are counted
(``actor/skipped_updates``), a good update resets the run of bad ones and
``trainer.max_bad_updates`` in a row raise a one-line NonFiniteError naming
the step. An export of a model with one NaN weight is refused on every rank
and writes nothing. Not covered: DP / TP / PP > 1 (the skip decision is one
MAX all-reduce over the world), fp16 loss scaling.
"""
from types import SimpleNamespace

import pytest
import torch

from dist_helpers import spawn
from megarl.models.tiny import make_tiny_checkpoint


def _batch(vocab: int):
    from megarl.roles.batch import SampleBatch

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, vocab, (4, 10), generator=gen)
    mask = torch.zeros(4, 10)
    mask[:, 4:] = 1.0
    return SampleBatch(ids, mask, torch.full((4,), 10))


def _head(kind: str):
    def head(mb, out):
        x = out.float()
        loss = {"good": lambda: x.square().sum() / 1000,
                "nan_loss": lambda: x.square().sum() / 1000 + float("nan"),
                "nan_grad": lambda: torch.sqrt((x * 0).sum())}[kind]()
        return loss, torch.ones((), dtype=torch.long, device=out.device), {"actor/loss": loss.detach()}
    return head


def _snapshot(actor) -> list[torch.Tensor]:
    """Model parameters, the optimizers' own (main) parameters and every Adam state tensor."""
    out = [p.detach().clone() for p in actor.module.parameters()]
    for opt in actor.trainable.optimizer.chained_optimizers:
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                out.append(p.detach().clone())
                out += [v.clone() for v in opt.optimizer.state[p].values() if torch.is_tensor(v)]
    return out


def _run(rank, ckpt, out_dir):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.config import Config
    from megarl.distributed import build_parallel_groups, init_distributed
    from megarl.errors import NonFiniteError
    from megarl.models.exporter import export_hf
    from megarl.roles.build import build_actor
    from megarl.trainer import phases

    init_distributed()
    groups = build_parallel_groups(1, 1)
    model_parallel_cuda_manual_seed(0)
    cfg = Config()
    cfg.model.path = ckpt
    cfg.actor.optim.lr = 1e-3
    cfg.actor.optim.warmup_steps = 0
    actor = build_actor(cfg, groups, optimizer_steps=10)
    micro = [_batch(57)]
    res = {"good": actor.train_step(micro, _head("good")), "n_params": len(list(actor.module.parameters()))}
    for kind in ("nan_loss", "nan_grad"):
        before, sched = _snapshot(actor), actor.trainable.scheduler.num_steps
        res[kind] = actor.train_step(micro, _head(kind))
        after = _snapshot(actor)
        res[kind]["bitwise_equal"] = len(before) == len(after) and all(
            torch.equal(a, b) for a, b in zip(before, after))
        res[kind]["state_tensors"] = len(before)
        res[kind]["scheduler_advanced"] = actor.trainable.scheduler.num_steps != sched

    updater, metrics = phases.Updater(cfg, actor, None, None, groups), {}  # the trainer's bookkeeping
    rollout = SimpleNamespace(metrics={})
    for kind in ("nan_loss", "nan_grad", "good", "nan_loss", "nan_grad"):  # 2 bad, good, 2 bad: no stop
        updater.record(rollout, "actor", [actor.train_step(micro, _head(kind))], 4, metrics)
    res["skipped"], res["in_row"] = metrics["actor/skipped_updates"], updater.bad_updates["actor"]
    try:
        updater.record(rollout, "actor", [actor.train_step(micro, _head("nan_loss"))], 4, metrics)
        res["abort"] = None
    except NonFiniteError as e:
        res["abort"] = (e.kind, str(e))

    export_hf(actor.module, actor.info, groups, f"{out_dir}/ok")
    weight = dict(actor.module.named_parameters())["decoder.layers.0.mlp.linear_fc1.weight"]
    with torch.no_grad():
        weight[1, 2] = float("nan")
    try:
        export_hf(actor.module, actor.info, groups, f"{out_dir}/bad")
        res["export"] = None
    except NonFiniteError as e:
        res["export"] = str(e)
    return res


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("llama")
    make_tiny_checkpoint(str(ckpt), "LlamaForCausalLM", seed=0, vocab_size=57, eos_token_id=3)
    out = tmp_path_factory.mktemp("export")
    (res,) = spawn(_run, 1, str(ckpt), str(out))
    return res, out


@pytest.mark.parametrize("kind", ["nan_loss", "nan_grad"])
def test_nonfinite_update_leaves_weights_and_adam_state_bitwise(run, kind):
    res, _ = run
    assert res["good"]["update_ok"] == 1.0 and res["good"]["nonfinite"] == 0.0
    step = res[kind]
    assert step["nonfinite"] == 1.0 and step["update_ok"] == 0.0
    assert step["state_tensors"] >= 3 * res["n_params"]  # params, main params, both moments
    assert step["bitwise_equal"]
    assert not step["scheduler_advanced"]


def test_bad_updates_in_a_row_stop_the_run_with_one_line(run):
    res, _ = run
    assert res["skipped"] == 4.0 and res["in_row"] == 2
    kind, message = res["abort"]
    assert kind == "non-finite values" and "\n" not in message
    assert "actor: 3 optimizer updates in a row" in message and "step 5" in message
    assert "trainer.max_bad_updates=3" in message


def test_export_with_a_nan_weight_is_refused_and_writes_nothing(run):
    res, out = run
    assert (out / "ok" / "config.json").exists()
    assert "decoder.layers.0.mlp.linear_fc1.weight" in res["export"] and "gate_proj" in res["export"]
    assert "\n" not in res["export"]
    assert not (out / "bad").exists()


@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", [0, 6, 9])
def test_nonfinite_reads_every_chunk(monkeypatch, bad, where):
    from megarl.roles import optim

    monkeypatch.setattr(optim, "CHECK_CHUNK", 4)  # 10 entries: chunks of 4, 4, 2
    grad = torch.randn(10)
    if bad is not None:
        grad[where] = bad
    assert bool(optim.nonfinite(grad)) == (bad is not None)
