"""What every entry script does first: config, distributed start, checks."""
from __future__ import annotations

import logging
import os
import warnings

from megarl.cli import load_config
from megarl.config_checks import validate
from megarl.distributed import discover, init_distributed


def quiet_libraries() -> None:
    """megatron-core and torch warn loudly about CPU-only and deprecated paths."""
    warnings.filterwarnings("ignore")
    logging.getLogger("megatron").setLevel(logging.ERROR)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def setup(argv, cls, checks=validate):
    """Parses and checks the config, joins the process group; returns (cfg, rank)."""
    quiet_libraries()
    cfg = load_config(argv, cls)
    checks(cfg, discover().world_size)  # before joining: a bad config exits alone
    info = init_distributed(cfg.trainer.collective_timeout_s)
    return cfg, info.rank
