"""CUDA OOM back-off (megarl/roles/memory.py): a phase that runs out of memory retries on halved micro-batches.

Two DP ranks (gloo, CPU, fp32) build the tiny actor twice from one checkpoint.
On rank 1 only, the first actor's forward raises ``torch.OutOfMemoryError``
whenever a micro-batch has more than 2 rows (what a real OOM does on a too
large micro-batch). With micro_batch_size 4 its forward and its update must
then agree on both ranks to retry at 2 rows, and give what the second actor
(micro_batch_size 2 from the start, no fault) gives: the same log-probs, loss
and grad norm (1e-6) and the same weights after the step; the DP gradient
reduction waited for the decision (no rank hung in it). The divisor stays; a
phase that still runs out at 1/64 of its budget is a one-line error.
"""
import pytest
import torch

from dist_helpers import spawn
from megarl.models.tiny import make_tiny_checkpoint


def _batch(vocab: int, rank: int):
    from megarl.roles.batch import SampleBatch

    gen = torch.Generator().manual_seed(10 + rank)
    ids = torch.randint(5, vocab, (4, 10), generator=gen)
    mask = torch.zeros(4, 10)
    mask[:, 4:] = 1.0
    return SampleBatch(ids, mask, torch.full((4,), 10))


def _head(mb, out):
    loss = out.float().square().sum() / 1000
    return loss, torch.ones((), dtype=torch.long, device=out.device), {"actor/loss": loss.detach()}


def _faulty(role, rows_limit: int, always: bool = False):
    """role.run raises OutOfMemoryError on a micro-batch of more than rows_limit rows."""
    real = role.run

    def run(micro_batches, head, forward_only):
        if always or any(len(mb) > rows_limit for mb in micro_batches):
            raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")
        return real(micro_batches, head, forward_only)

    role.run = run


def _job(rank, ckpt):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.config import Config
    from megarl.distributed import build_parallel_groups, init_distributed
    from megarl.roles.build import build_actor
    from megarl.roles.memory import PhaseOutOfMemory

    init_distributed()
    groups = build_parallel_groups(1, 1)  # DP 2
    cfg = Config()
    cfg.model.path = ckpt
    cfg.actor.optim.lr = 1e-3
    actors = []
    for _ in range(2):
        model_parallel_cuda_manual_seed(0)
        actors.append(build_actor(cfg, groups, optimizer_steps=10))
    faulty, clean = actors
    if rank == 1:
        _faulty(faulty, rows_limit=2)
    batch = _batch(57, rank)
    out = {}
    lp_f = faulty.logprobs(batch, micro_batch_size=4, temperature=1.0)["logprobs"]
    lp_c = clean.logprobs(batch, micro_batch_size=2, temperature=1.0)["logprobs"]
    out["logprob_gap"] = float((lp_f - lp_c).abs().max())
    out["after_forward"] = faulty.backoff.metrics()

    def split(actor, size):
        return lambda: [batch.select(i) for i in actor.micro_batch_index(batch, size, 0)]

    step_f = faulty.train_step(split(faulty, 4), _head)
    step_c = clean.train_step(split(clean, 2), _head)
    out["loss_gap"] = abs(step_f["actor/loss"] - step_c["actor/loss"])
    out["grad_norm_gap"] = abs(step_f["grad_norm"] - step_c["grad_norm"])
    out["weight_gap"] = max(float((a - b).abs().max()) for a, b in zip(faulty.module.parameters(),
                                                                         clean.module.parameters()))
    out["step_metrics"] = {k: step_f[k] for k in ("oom_retries", "memory_divisor", "update_ok")}
    if rank == 1:
        _faulty(clean, rows_limit=0, always=True)
    try:
        clean.train_step(split(clean, 2), _head)
        out["gives_up"] = None
    except PhaseOutOfMemory as e:
        out["gives_up"] = str(e)
    return out


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("oom") / "tiny")
    make_tiny_checkpoint(ckpt, "LlamaForCausalLM", seed=2, vocab_size=57)
    return spawn(_job, 2, ckpt)


def test_forward_retries_at_half_the_rows_on_every_rank(result):
    for r in result:
        assert r["logprob_gap"] <= 1e-6
        assert r["after_forward"] == {"oom_retries": 1.0, "memory_divisor": 2.0}


def test_update_retries_and_equals_the_smaller_micro_batches(result):
    for r in result:
        assert r["loss_gap"] <= 1e-6 and r["grad_norm_gap"] <= 1e-6 and r["weight_gap"] <= 1e-6
        assert r["step_metrics"] == {"oom_retries": 1.0, "memory_divisor": 2.0, "update_ok": 1.0}


def test_gives_up_with_one_line_at_one_64th(result):
    for r in result:
        msg = r["gives_up"]
        assert msg and "CUDA out of memory even at 1/64" in msg and "\n" not in msg
