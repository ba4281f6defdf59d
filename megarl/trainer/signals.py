"""Stopping on SIGTERM / SIGINT at a step boundary, with a checkpoint, instead of dying mid-step.

SLURM sends SIGTERM before it kills a job (``--signal`` sets how early) and
torchrun forwards the signals it gets to every worker. The first SIGTERM or
SIGINT only raises a flag; the training loop asks :meth:`StopSignal.agreed` at
the end of each step, which all-reduces the flag (MAX) so every rank stops
after the same step even when the signal reached them at different moments;
the run then saves and exits 0. A second signal of the same kind gets the
default behaviour back (a second Ctrl-C interrupts at once).
"""
from __future__ import annotations

import signal
import threading

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignal:
    """Installs the handlers (main thread only); ``agreed()`` is collective over the world."""

    def __init__(self, device):
        self.device, self.received = device, None
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.received = signal.Signals(signum).name
        signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))  # the next one acts at once

    def agreed(self) -> bool:
        """True on every rank if any rank got a stop signal (call at the same point on all ranks)."""
        flag = torch.tensor([1.0 if self.received else 0.0], device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
