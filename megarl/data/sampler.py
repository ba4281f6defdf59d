"""DP-sharded, seeded, resumable prompt sampler.

Each step consumes one global batch of `batch_size * dp_size` dataset
indices; DP rank r takes the contiguous slice [r*B, (r+1)*B) of it, so the
ranks' slices are disjoint and together cover the global batch.

Epochs: epoch e visits a permutation drawn from (seed, e) (or 0..N-1 when
shuffle=False). drop_last: the tail of an epoch that cannot fill a whole
global batch (N mod B_global indices) is skipped, and the next step starts
epoch e+1. The tail is a different set each epoch because the permutation
changes, so no prompt is starved.

State is the position (epoch, offset): offset counts global samples consumed
within the epoch. `load_state_dict(state_dict())` on a fresh sampler with the
same dataset size and seed yields exactly the batches the original would have
produced next; the global batch size may differ after resume (offset is in
samples, not steps).
"""
from __future__ import annotations

from typing import Any

import numpy as np
from megarl.errors import DataError


class PromptSampler:
    """Yields this rank's list of dataset indices per step, forever."""

    def __init__(self, num_items: int, batch_size: int, dp_rank: int = 0,
                 dp_size: int = 1, seed: int = 0, shuffle: bool = True):
        self.num_items = num_items
        self.batch_size = batch_size  # per DP rank
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.offset = 0  # global samples consumed in the current epoch
        self._check()
        self._perm_epoch = -1
        self._perm = np.arange(0)

    def _check(self) -> None:
        if self.batch_size <= 0 or self.dp_size <= 0:
            raise ValueError(f"PromptSampler: batch_size={self.batch_size}, dp_size={self.dp_size}; "
                             "both must be positive")
        if not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"PromptSampler: dp_rank={self.dp_rank} not in [0, {self.dp_size})")
        if self.num_items < self.global_batch_size:
            raise DataError(f"PromptSampler: dataset has {self.num_items} prompts, fewer than one global "
                             f"batch ({self.batch_size} x {self.dp_size}); lower the batch size or add data")

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.dp_size

    @property
    def steps_per_epoch(self) -> int:
        return self.num_items // self.global_batch_size

    def permutation(self, epoch: int) -> np.ndarray:
        """Dataset order for `epoch`; a pure function of (seed, epoch)."""
        if not self.shuffle:
            return np.arange(self.num_items)
        rng = np.random.default_rng([self.seed, epoch])
        return rng.permutation(self.num_items)

    def next_global(self) -> list[int]:
        """Advance one step and return the whole global batch (all ranks)."""
        if self.offset + self.global_batch_size > self.num_items:
            self.epoch, self.offset = self.epoch + 1, 0  # drop_last
        if self._perm_epoch != self.epoch:
            self._perm, self._perm_epoch = self.permutation(self.epoch), self.epoch
        batch = self._perm[self.offset:self.offset + self.global_batch_size]
        self.offset += self.global_batch_size
        return batch.tolist()

    def __iter__(self) -> "PromptSampler":
        return self

    def __next__(self) -> list[int]:
        """This rank's slice of the next global batch."""
        lo = self.dp_rank * self.batch_size
        return self.next_global()[lo:lo + self.batch_size]

    @property
    def step_in_epoch(self) -> int:
        """Index within the epoch of the batch returned last."""
        return max(self.offset // self.global_batch_size - 1, 0)

    def next_batch(self, dataset: Any) -> Any:
        """This rank's next PromptBatch from a PromptDataset (anything with .batch)."""
        indices = next(self)
        return dataset.batch(indices, epoch=self.epoch, step=self.step_in_epoch)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed,
                "num_items": self.num_items, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") == "mixture":  # megarl.data.mixture.MixtureSampler's
            raise DataError("the checkpoint's data position is of several training sets (data.train_mix), but "
                            "this run reads one; resume with the same data settings (or start a new trainer.run_dir)")
        for key in ("seed", "num_items", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(f"PromptSampler.load_state_dict: checkpoint has {key}={state[key]} but this "
                                 f"sampler has {getattr(self, key)}; resume with the same data and seed")
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
