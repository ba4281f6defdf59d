"""Starting SGLang beside Megatron without changing the rank that starts it.

SGLang 0.5.23's ``Engine(...)`` configures the process it is built in: it sets
CUDA/NCCL environment variables (``NCCL_CUMEM_ENABLE``, ``NCCL_NVLS_ENABLE``,
``CUDA_DEVICE_MAX_CONNECTIONS``, and under deterministic inference at TP > 1
``NCCL_ALGO`` and the NCCL channel counts), forces the ``spawn`` start method,
installs a SIGQUIT handler, calls ``logging.basicConfig(force=True)`` and may
change the gc thresholds. Only TP rank 0 of each TP group builds an engine, so
left alone this makes rank 0 differ from its peers (a later NCCL communicator
of rank 0 would run another algorithm than the same communicator's other
ranks). :func:`isolated_process_state` snapshots all of that and puts it back
once the engine is up: SGLang's workers are already spawned by then and keep
the environment they started with. (Not restored: the raised open-files soft
limit, which SGLang's own sockets in this process may need, and the asyncio
event loop the engine keeps for itself.)

:func:`startup_group`: rank 0 may take minutes to build the engine (weights,
CUDA graphs). Its TP peers wait for it on a gloo group of their own whose
timeout is ``rollout.sglang.start_timeout_s``, not on a group bounded by
``trainer.collective_timeout_s``.
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import logging
import multiprocessing
import os
import signal
import threading
from collections.abc import Iterator
from typing import Optional

import torch.distributed as dist

from megarl.distributed import ParallelGroups

_SIGNALS = tuple(s for s in (getattr(signal, n, None) for n in ("SIGQUIT", "SIGTERM", "SIGINT", "SIGCHLD")) if s)


def _logging_state() -> list:
    """(logger, level, handlers, propagate) of the root logger and every named logger."""
    loggers = [logging.getLogger()] + [v for v in logging.Logger.manager.loggerDict.values()
                                       if isinstance(v, logging.Logger)]
    return [(lg, lg.level, list(lg.handlers), lg.propagate) for lg in loggers]


def process_state() -> dict:
    """What :func:`isolated_process_state` restores, as comparable values (for tests)."""
    root = logging.getLogger()
    return {"environ": dict(os.environ), "start_method": multiprocessing.get_start_method(allow_none=True),
            "signals": {int(s): signal.getsignal(s) for s in _SIGNALS}, "gc_threshold": gc.get_threshold(),
            "root_logging": (root.level, list(root.handlers))}


@contextlib.contextmanager
def isolated_process_state() -> Iterator[None]:
    """Runs the body, then restores environment variables, the multiprocessing start method, signal
    handlers, logging configuration and gc thresholds as they were before it (also on error)."""
    environ = dict(os.environ)
    start_method = multiprocessing.get_start_method(allow_none=True)
    handlers = {s: signal.getsignal(s) for s in _SIGNALS}
    logs = _logging_state()
    thresholds = gc.get_threshold()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(environ)
        multiprocessing.set_start_method(start_method, force=True)
        for s, h in handlers.items():
            if h is not None and threading.current_thread() is threading.main_thread():
                signal.signal(s, h)  # (SGLang installs handlers from the main thread only)
        for lg, level, old_handlers, propagate in logs:
            lg.setLevel(level)
            lg.handlers[:] = old_handlers
            lg.propagate = propagate
        gc.set_threshold(*thresholds)


def startup_group(groups: ParallelGroups, timeout_s: float) -> Optional[dist.ProcessGroup]:
    """A gloo group over this rank's TP group with a ``timeout_s`` timeout (None at TP 1).

    Collective over the world: every rank calls it (SGLang needs the same TP size everywhere).
    """
    if groups.tp_size == 1:
        return None
    layouts = [None] * dist.get_world_size()
    dist.all_gather_object(layouts, dist.get_process_group_ranks(groups.tp))
    distinct = sorted({tuple(r) for r in layouts})
    mine, _ = dist.new_subgroups_by_enumeration([list(r) for r in distinct], backend="gloo",
                                                timeout=datetime.timedelta(seconds=timeout_s))
    return mine
