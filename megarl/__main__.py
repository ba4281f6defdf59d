"""``python -m megarl train CONFIG.yaml --nproc N [key=value ...]``: the ``megarl`` command (megarl/launcher.py)."""
from megarl.launcher import main

main()
