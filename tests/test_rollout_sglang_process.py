"""isolated_process_state puts back what SGLang's Engine(...) changes in its process, also when it raises.

The body does what SGLang 0.5.23's start does (tests/sglang_fake.py, ``_configure_process``): sets and
removes environment variables, forces the spawn start method, installs a SIGQUIT handler, reconfigures
logging with force=True, changes gc thresholds. Expected: process_state() after equals before, and
the body's error comes out unchanged. Not covered: the open-files limit and asyncio loop (not restored).
"""
import contextlib
import gc
import logging
import multiprocessing
import os
import signal

import pytest


def _change_everything():
    os.environ["NCCL_ALGO"] = "allreduce:tree"
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "8"
    os.environ.pop("HOME", None)
    multiprocessing.set_start_method("spawn", force=True)
    signal.signal(signal.SIGQUIT, lambda signum, frame: None)
    logging.basicConfig(level=logging.ERROR, format="[x] %(message)s", force=True)
    logging.getLogger("megarl").setLevel(logging.CRITICAL)
    gc.set_threshold(1, 2, 3)


def _state():
    from megarl.rollout.sglang_process import process_state

    state = process_state()
    state["megarl_level"] = logging.getLogger("megarl").level
    return state


@pytest.mark.parametrize("fails", [False, True])
def test_everything_is_put_back(fails):
    from megarl.rollout.sglang_process import isolated_process_state

    before = _state()
    with pytest.raises(RuntimeError, match="^engine start failed$") if fails else contextlib.nullcontext():
        with isolated_process_state():
            _change_everything()
            assert _state() != before
            if fails:
                raise RuntimeError("engine start failed")
    assert _state() == before
