"""LRU cache of per-sample reward values, so duplicate samples are scored once."""
from __future__ import annotations

import hashlib
from collections import OrderedDict


class RewardCache:
    """Maps hash(term, prompt, response, ground_truth) -> value; least recently used goes first.

    The key ignores a sample's `extra` fields: do not cache terms that read them.
    """

    def __init__(self, max_size: int = 100_000):
        if max_size <= 0:
            raise ValueError(f"reward cache max_size={max_size} must be > 0")
        self.max_size = max_size
        self.hits = 0
        self.misses = 0
        self._store: OrderedDict[str, float] = OrderedDict()

    @staticmethod
    def key(term: str, prompt: str, response: str, ground_truth: str | None) -> str:
        h = hashlib.sha256()
        for part in (term, prompt, response, ground_truth):  # length-prefixed: no two tuples collide
            if part is None:
                h.update(b"\xff" * 8)  # not a valid length prefix
                continue
            data = str(part).encode("utf-8", "surrogatepass")
            h.update(len(data).to_bytes(8, "little") + data)
        return h.hexdigest()

    def get(self, key: str) -> float | None:
        """The cached value (counted as a hit) or None (a miss)."""
        if key in self._store:
            self._store.move_to_end(key)
            self.hits += 1
            return self._store[key]
        self.misses += 1
        return None

    def put(self, key: str, value: float) -> None:
        self._store[key] = value
        self._store.move_to_end(key)
        while len(self._store) > self.max_size:
            self._store.popitem(last=False)

    def __len__(self) -> int:
        return len(self._store)

    def metrics(self) -> dict[str, float]:
        """Cumulative hits and misses, hit rate and current size."""
        lookups = self.hits + self.misses
        return {
            "hits": float(self.hits),
            "misses": float(self.misses),
            "hit_rate": self.hits / lookups if lookups else 0.0,
            "size": float(len(self)),
        }
