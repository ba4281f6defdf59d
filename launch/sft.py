"""Supervised warm start: torchrun --nproc_per_node N launch/sft.py yaml/tiny_sft.yaml [key=value ...]

Trains the policy on (prompt, response) rows with the PPO model code and
writes a Hugging Face directory to sft.out_dir.
"""
import torch.distributed as dist

from megarl.cli import main_guard
from megarl.config import Config
from megarl.config_checks import validate_sft
from megarl.launch_common import setup


def main(argv):
    cfg, rank = setup(argv, Config, validate_sft)
    from megarl.trainer.sft import run_sft

    def log(step, total, m):
        if rank == 0 and step == 0:
            print(f"sft rows: {m['rows']} ({m['too_long']} longer than sft.max_len skipped)", flush=True)
        elif rank == 0 and (step % 20 == 0 or step == total):
            print(f"sft step {step}/{total}  nll {m['nll'] / max(m['tokens'], 1):.4f}  "
                  f"grad_norm {m['grad_norm']:.3f}  lr {m['lr']:.2e}", flush=True)

    run_sft(cfg, log)
    if rank == 0:
        print(f"wrote {cfg.sft.out_dir}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main_guard(main, cls=Config, usage=__doc__)
