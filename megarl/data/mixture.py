"""Several training sets mixed by weight: one dataset, a deterministic resumable sampler.

    ds, sizes = load_mixture([(cfg_a, 0.7), (cfg_b, 0.3)], tokenizer)   # ds: sets concatenated
    sampler = MixtureSampler(sizes, [0.7, 0.3], batch_size=8, dp_rank=r, dp_size=4, seed=0)
    batch = sampler.next_batch(ds)

Which set each sample of the global batch comes from is decided by a
weighted round robin over the whole run: sample k (counted from the start)
goes to the set i with the largest deficit ``w_i * (k + 1) - taken_i``
(weights normalized; ties to the lower i). After any k samples each set has
had ``w_i * k`` of them within one sample. Within a set, samples follow a
permutation per epoch of that set, a pure function of (seed, set, epoch);
a set that runs out starts its next epoch (sets cycle at their own pace).

State is the count taken from each set; ``load_state_dict(state_dict())``
on a fresh sampler with the same sizes, weights and seed continues exactly.
Each DP rank takes the contiguous slice r of every global batch, as
:class:`megarl.data.sampler.PromptSampler` does.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from megarl.data.config import PromptDataConfig
from megarl.data.dataset import PromptDataset, PromptItem, load_prompt_dataset
from megarl.errors import DataError


def load_mixture(parts: Sequence[PromptDataConfig], tokenizer: Any) -> tuple[PromptDataset, list[int]]:
    """Each config loaded, the items concatenated and renumbered; (dataset, kept prompts per set)."""
    items: list[PromptItem] = []
    counts = {"rows": 0, "malformed": 0, "too_long": 0, "kept": 0}
    sizes = []
    for cfg in parts:
        ds = load_prompt_dataset(cfg, tokenizer)
        for it in ds.items:
            it.index = len(items)
            items.append(it)
        for key, value in ds.counts.items():
            counts[key] = counts.get(key, 0) + value
        sizes.append(len(ds))
    return PromptDataset(items, counts), sizes


class MixtureSampler:
    """Yields this rank's dataset indices per step, drawing from several sets by weight."""

    def __init__(self, sizes: Sequence[int], weights: Sequence[float], batch_size: int,
                 dp_rank: int = 0, dp_size: int = 1, seed: int = 0):
        if len(sizes) != len(weights) or not sizes:
            raise DataError(f"MixtureSampler: {len(sizes)} sets and {len(weights)} weights; give one weight per set")
        if any(not w > 0 for w in weights) or any(n <= 0 for n in sizes):
            raise DataError(f"data.train_mix: weights {list(weights)} must be > 0 and every set non-empty "
                            f"(sizes {list(sizes)})")
        if batch_size <= 0 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"MixtureSampler: batch_size={batch_size}, dp_rank={dp_rank}, dp_size={dp_size}")
        self.sizes = [int(n) for n in sizes]
        self.weights = [float(w) for w in weights]
        total = sum(self.weights)
        self.shares = [w / total for w in self.weights]
        self.starts = np.cumsum([0] + self.sizes[:-1]).tolist()  # index of each set's first item
        self.batch_size, self.dp_rank, self.dp_size, self.seed = batch_size, dp_rank, dp_size, seed
        self.taken = [0] * len(self.sizes)  # samples drawn from each set so far
        self.steps = 0
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.dp_size

    @property
    def epoch(self) -> int:
        """Passes completed over the largest-share set (for the batch's bookkeeping only)."""
        i = max(range(len(self.sizes)), key=lambda j: (self.shares[j], -j))
        return self.taken[i] // self.sizes[i]

    def permutation(self, which: int, epoch: int) -> np.ndarray:
        """Order of set ``which`` in ``epoch``; a pure function of (seed, which, epoch)."""
        key = (which, epoch)
        if key not in self._perms:
            self._perms = {k: v for k, v in self._perms.items() if k[0] != which}  # keep one epoch per set
            self._perms[key] = np.random.default_rng([self.seed, which, epoch]).permutation(self.sizes[which])
        return self._perms[key]

    def _pick_set(self) -> int:
        k = sum(self.taken)
        return max(range(len(self.sizes)), key=lambda i: (self.shares[i] * (k + 1) - self.taken[i], -i))

    def next_global(self) -> list[int]:
        """Advance one step and return the whole global batch (all ranks)."""
        batch = []
        for _ in range(self.global_batch_size):
            i = self._pick_set()
            epoch, offset = divmod(self.taken[i], self.sizes[i])
            batch.append(self.starts[i] + int(self.permutation(i, epoch)[offset]))
            self.taken[i] += 1
        self.steps += 1
        return batch

    def __iter__(self) -> "MixtureSampler":
        return self

    def __next__(self) -> list[int]:
        lo = self.dp_rank * self.batch_size
        return self.next_global()[lo:lo + self.batch_size]

    def next_batch(self, dataset: Any) -> Any:
        """This rank's next PromptBatch from the concatenated dataset."""
        indices = next(self)
        return dataset.batch(indices, epoch=self.epoch, step=self.steps - 1)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "mixture", "taken": list(self.taken), "steps": self.steps, "sizes": list(self.sizes),
                "weights": list(self.weights), "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "mixture":
            raise DataError("the checkpoint's data position is of one training set, but data.train_mix now names "
                            "several; resume with the same data settings (or start a new trainer.run_dir)")
        mine = {"sizes": self.sizes, "weights": self.weights, "seed": self.seed}
        for key, value in mine.items():
            if state[key] != value:
                raise DataError(f"data.train_mix: the checkpoint has {key} {state[key]}, this run "
                                f"{getattr(self, key)}; resume with the same sets, weights and data.seed "
                                "(or start a new trainer.run_dir)")
        self.taken, self.steps = [int(t) for t in state["taken"]], int(state["steps"])
