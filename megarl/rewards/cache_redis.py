"""Redis as the shared level of the reward cache, with a SQLite file as the level below it."""
from __future__ import annotations

import logging
from typing import Mapping, Sequence
from urllib.parse import urlparse

import redis
from redis.backoff import NoBackoff
from redis.connection import parse_url
from redis.exceptions import RedisError
from redis.retry import Retry

from megarl.rewards.cache_backends import REDIS_NAMESPACE, START_REDIS_HINT, SqliteBackend, decode, encode

log = logging.getLogger(__name__)


def connect(url: str, timeout_s: float) -> redis.Redis:
    """A client that gives up after ``timeout_s`` and one retry instead of redis-py's default backoff."""
    return redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                retry=Retry(NoBackoff(), 1))


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def redis_url_problem(url: str, timeout_s: float = 3.0) -> str | None:
    """Why ``url`` names no usable Redis server (one line, for a config error), or None."""
    try:
        parse_url(url)
    except ValueError as e:
        return f"cannot be parsed ({_one_line(e)}); write it as redis://host:port/db"
    parts = urlparse(url)
    db = parts.path.strip("/")
    if parts.scheme != "unix" and db and not db.isdigit():
        return f"database '{db}' is not a number; write it as redis://host:port/db, e.g. redis://127.0.0.1:6379/0"
    try:
        connect(url, timeout_s).ping()
    except RedisError as e:
        return f"no Redis server answers ({_one_line(e)}); {START_REDIS_HINT}"
    return None


class RedisBackend:
    """Redis, shared by every rank and node, above an on-disk store that gets every write first.

    A lookup asks Redis (one MGET) and then the disk for what Redis lacks; a write
    goes to the disk (one transaction), then to Redis (one MSET). When Redis stops
    answering (refused, timed out, out of memory) the backend logs one warning and
    serves from the disk for the rest of the run, which therefore holds every value
    this process wrote. ``key_prefix`` namespaces the keys in a shared server.
    """

    name = "redis"

    def __init__(self, url: str, disk: SqliteBackend, timeout_s: float = 5.0, key_prefix: str = REDIS_NAMESPACE):
        self.url, self.disk, self.prefix = url, disk, key_prefix
        self.fallbacks = 0
        self._client = connect(url, timeout_s)

    @property
    def up(self) -> bool:
        return self.fallbacks == 0

    def get_many(self, keys: Sequence[str]) -> list[float | None]:
        values: list[float | None] = [None] * len(keys)
        if self.up and keys:
            try:
                raw = self._client.mget([self.prefix + k for k in keys])
                values = [None if r is None else decode(r) for r in raw]
            except RedisError as e:
                self._fall_back(e)
        missing = list(dict.fromkeys(k for k, v in zip(keys, values) if v is None))
        if not missing:
            return values
        on_disk = {k: v for k, v in zip(missing, self.disk.get_many(missing)) if v is not None}
        if on_disk and self.up:  # known below but not in Redis (a restarted server): lift it up
            self._put_redis(on_disk)
        return [on_disk.get(k) if v is None else v for k, v in zip(keys, values)]

    def put_many(self, items: Mapping[str, float]) -> None:
        self.disk.put_many(items)
        if self.up and items:
            self._put_redis(items)

    def _put_redis(self, items: Mapping[str, float]) -> None:
        try:
            self._client.mset({self.prefix + k: encode(v) for k, v in items.items()})
        except RedisError as e:
            self._fall_back(e)

    def _fall_back(self, e: RedisError) -> None:
        self.fallbacks += 1
        log.warning("reward cache: Redis at %s stopped answering (%s); the on-disk store %s serves the rest "
                    "of the run", self.url, _one_line(e), self.disk.path)
        self._client.close()

    def __len__(self) -> int:
        return len(self.disk)
