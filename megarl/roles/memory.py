"""CUDA out-of-memory back-off: a phase that runs out of memory halves its micro-batch budget and retries.

    backoff = MemoryBackoff("actor")
    out = backoff.retrying("update", lambda: attempt())   # attempt raises OutOfMemoryAgreed

Every rank takes part in one decision: after a phase's micro-batches (caught
``torch.OutOfMemoryError`` here, finished elsewhere) a MAX all-reduce over the
world says whether any rank ran out; then every rank retries alike with
micro-batch size and token budget divided by 2, 4, ... (``budget``), and the
divisor stays for the rest of the run. The data-parallel gradient reduction is
held back until that decision (``deferred_finalize``), so a rank that stopped
early never leaves its peers waiting inside it. Within a TP group the shapes,
and so the allocations, are the same on every rank, so an OOM strikes them
together; a pipeline stage that runs out alone leaves its peer waiting in a
send or receive, which the collective timeout (``trainer.collective_timeout_s``)
turns into a loud failure.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from megarl.distributed import device
from megarl.errors import UserInputError

MAX_HALVINGS = 6  # down to 1/64 of the configured budget, then give up


class OutOfMemoryAgreed(RuntimeError):
    """Some rank ran out of memory in this phase; every rank raises it together."""


class PhaseOutOfMemory(UserInputError):
    kind = "out of memory"


def any_rank(flag: bool, group=None) -> bool:
    """The OR of ``flag`` over every rank of ``group`` (None: the world; one MAX all-reduce)."""
    t = torch.tensor([float(flag)], device=device())
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def caught_oom(fn):
    """(fn(), False), or (None, True) when fn ran out of CUDA memory (cache emptied)."""
    try:
        return fn(), False
    except torch.OutOfMemoryError:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return None, True


@contextlib.contextmanager
def deferred_finalize(config):
    """Inside: megatron's schedule records its ``finalize_model_grads`` call instead of making it.
    Yields a list to which the call's (args, kwargs) go; the caller replays it with ``real``."""
    real, calls = config.finalize_model_grads_func, []
    config.finalize_model_grads_func = lambda *a, **k: calls.append((a, k))
    try:
        yield real, calls
    finally:
        config.finalize_model_grads_func = real


class MemoryBackoff:
    """A role's micro-batch budget divisor and its out-of-memory retries."""

    def __init__(self, role: str):
        self.role = role
        self.divisor = 1
        self.retries = 0

    def budget(self, micro_batch_size: int, max_tokens: int) -> tuple[int, int]:
        """The configured (rows, tokens) per micro-batch under the current divisor (0 tokens: no budget)."""
        d = self.divisor
        return max(1, micro_batch_size // d), (max(1, max_tokens // d) if max_tokens > 0 else 0)

    def retrying(self, phase: str, attempt):
        """attempt() until no rank runs out of memory; halves the budget before each retry."""
        while True:
            try:
                return attempt()
            except OutOfMemoryAgreed:
                if self.divisor >= 2 ** MAX_HALVINGS:
                    raise PhaseOutOfMemory(
                        f"{self.role} {phase}: CUDA out of memory even at 1/{self.divisor} of the micro-batch "
                        f"budget; lower {self.role}.micro_batch_size / max_tokens_per_micro, or turn on "
                        f"{self.role}.recompute or actor.lora") from None
                self.divisor *= 2
                self.retries += 1
                if not dist.is_initialized() or dist.get_rank() == 0:
                    print(f"{self.role} {phase}: CUDA out of memory; retrying with micro-batches at "
                          f"1/{self.divisor} of the configured budget (kept for the rest of the run)", flush=True)

    def metrics(self) -> dict[str, float]:
        return {"oom_retries": float(self.retries), "memory_divisor": float(self.divisor)}
