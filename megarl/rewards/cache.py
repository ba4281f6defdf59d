"""The reward cache: per-sample reward values by content key, so duplicate samples are scored once."""
from __future__ import annotations

import hashlib
from typing import Any, Mapping, Sequence

from megarl.rewards.cache_backends import CacheBackend, MemoryBackend


def canonical(value: Any) -> str:
    """A text equal for equal values in any process: dict keys and set members sorted, numpy and
    torch values as lists. Values it cannot tell apart by repr only ever cost a cache miss."""
    if isinstance(value, dict):
        return "{" + ",".join(sorted(f"{canonical(k)}:{canonical(v)}" for k, v in value.items())) + "}"
    if isinstance(value, list):
        return "[" + ",".join(canonical(v) for v in value) + "]"
    if isinstance(value, tuple):
        return "(" + ",".join(canonical(v) for v in value) + ")"
    if isinstance(value, (set, frozenset)):
        return "set{" + ",".join(sorted(canonical(v) for v in value)) + "}"
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        return f"{type(value).__name__}:{canonical(value.tolist())}"
    return repr(value)


class RewardCache:
    """Maps hash(term, prompt, response, ground_truth, extra) -> value in a backend (an LRU by default).

    The key covers everything a reward function reads, the sample's `extra` fields included
    (as :func:`canonical` text), so two samples that differ anywhere never share a value.
    Counting: of the keys in one lookup, each distinct key the backend lacks is a
    miss (its value gets computed once); every other key is a hit.
    """

    def __init__(self, max_size: int = 100_000, backend: CacheBackend | None = None):
        self.backend = backend if backend is not None else MemoryBackend(max_size)
        self.hits = 0
        self.misses = 0

    @staticmethod
    def key(term: str, prompt: str, response: str, ground_truth: str | None, extra: Any = None) -> str:
        h = hashlib.sha256()
        extra_text = None if extra is None else canonical(extra)
        for part in (term, prompt, response, ground_truth, extra_text):  # length-prefixed: no two tuples collide
            if part is None:
                h.update(b"\xff" * 8)  # not a valid length prefix
                continue
            data = str(part).encode("utf-8", "surrogatepass")
            h.update(len(data).to_bytes(8, "little") + data)
        return h.hexdigest()

    @property
    def name(self) -> str:
        return self.backend.name

    @property
    def fallbacks(self) -> int:
        """Times the backend switched to a lower level (Redis -> the on-disk store)."""
        return self.backend.fallbacks

    def get_many(self, keys: Sequence[str]) -> list[float | None]:
        """The cached value for each key, None where absent; one round trip to the backend."""
        values = self.backend.get_many(keys) if keys else []
        missing = len({k for k, v in zip(keys, values) if v is None})
        self.misses += missing
        self.hits += len(keys) - missing
        return values

    def put_many(self, items: Mapping[str, float]) -> None:
        """Stores finite values (the caller checks); one round trip to the backend."""
        if items:
            self.backend.put_many(items)

    def get(self, key: str) -> float | None:
        return self.get_many([key])[0]

    def put(self, key: str, value: float) -> None:
        self.put_many({key: value})

    def __len__(self) -> int:
        return len(self.backend)

    def metrics(self) -> dict[str, float]:
        """Cumulative hits and misses, hit rate, size and fallbacks."""
        lookups = self.hits + self.misses
        return {
            "hits": float(self.hits),
            "misses": float(self.misses),
            "hit_rate": self.hits / lookups if lookups else 0.0,
            "size": float(len(self)),
            "fallbacks": float(self.fallbacks),
        }


def open_reward_cache(kind: str, size: int, path: str, redis_url: str) -> RewardCache:
    """kind: memory (an LRU of ``size``) | sqlite (the file ``path``) | redis (``redis_url``, written
    through to ``path``); sqlite and redis keep an LRU of ``size`` in front."""
    if kind == "memory":
        return RewardCache(size)
    from megarl.rewards.cache_backends import SqliteBackend, TieredBackend

    store = SqliteBackend(path)
    if kind == "redis":
        from megarl.rewards.cache_redis import RedisBackend

        store = RedisBackend(redis_url, store)
    elif kind != "sqlite":
        raise ValueError(f"unknown reward cache {kind!r}; expected memory, sqlite or redis")
    return RewardCache(backend=TieredBackend(MemoryBackend(size), store))
