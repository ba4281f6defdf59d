"""launch/ppo.py with a fault injected, for the kill-and-resume tests (never used by megarl itself).

``MEGARL_TEST_KILL_IN_SAVE=STEP:RANK``: while saving the checkpoint of step
STEP, once the first role's shards are written and before the step directory
is renamed, the process of global rank RANK kills itself with SIGKILL. Only in
the first attempt (``TORCHELASTIC_RESTART_COUNT`` 0 or unset), so a run
restarted by ``torchrun --max-restarts`` gets past it.

Run it like the entry script: ``torchrun ... tests/fault_launch.py yaml/tiny.yaml key=value ...``.
"""
import os
import runpy
import signal
import sys
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _install_kill_in_save(spec: str) -> None:
    import megarl.trainer.checkpoint as checkpoint

    step, rank = (int(x) for x in spec.split(":"))
    real = checkpoint.dist_checkpointing

    def save(state, directory, *args, **kwargs):
        real.save(state, directory, *args, **kwargs)
        if f"step_{step:06d}.partial" in directory and int(os.environ.get("RANK", "0")) == rank:
            os.kill(os.getpid(), signal.SIGKILL)

    checkpoint.dist_checkpointing = SimpleNamespace(save=save, load=real.load)


if __name__ == "__main__":
    spec = os.environ.get("MEGARL_TEST_KILL_IN_SAVE")
    if spec and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        _install_kill_in_save(spec)
    sys.argv = [os.path.join(ROOT, "launch", "ppo.py"), *sys.argv[1:]]
    runpy.run_path(sys.argv[0], run_name="__main__")
