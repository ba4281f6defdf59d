"""Where cached reward values live: a per-process LRU, a SQLite file, or Redis with the file beside it.

Every backend maps a key (the sha256 hex of RewardCache.key) to a float and
answers a whole step in one call: ``get_many`` / ``put_many``. Values are kept
as 8 little-endian IEEE-754 bytes, so a float comes back bitwise equal (-0.0,
subnormals and all); only finite values are ever stored.
"""
from __future__ import annotations

import logging
import os
import sqlite3
import struct
import time
from collections import OrderedDict
from typing import Mapping, Protocol, Sequence

log = logging.getLogger(__name__)
_DOUBLE = struct.Struct("<d")
REDIS_NAMESPACE = "megarl:reward:"
START_REDIS_HINT = "start one with `redis-server --port 6379 --daemonize yes`"


def encode(value: float) -> bytes:
    return _DOUBLE.pack(value)


def decode(data: bytes) -> float:
    return _DOUBLE.unpack(data)[0]


class CacheBackend(Protocol):
    """A key -> float store. ``fallbacks``: times it switched to a lower level (Redis -> disk)."""

    name: str
    fallbacks: int

    def get_many(self, keys: Sequence[str]) -> list[float | None]: ...

    def put_many(self, items: Mapping[str, float]) -> None: ...

    def __len__(self) -> int: ...


class MemoryBackend:
    """An LRU of ``max_size`` entries in this process: the least recently used goes first."""

    name = "memory"
    fallbacks = 0

    def __init__(self, max_size: int):
        if max_size <= 0:
            raise ValueError(f"reward cache max_size={max_size} must be > 0")
        self.max_size = max_size
        self._store: OrderedDict[str, float] = OrderedDict()

    def get_many(self, keys: Sequence[str]) -> list[float | None]:
        out = []
        for key in keys:
            value = self._store.get(key)
            if value is not None:
                self._store.move_to_end(key)
            out.append(value)
        return out

    def put_many(self, items: Mapping[str, float]) -> None:
        for key, value in items.items():
            self._store[key] = value
            self._store.move_to_end(key)
        while len(self._store) > self.max_size:
            self._store.popitem(last=False)

    def __len__(self) -> int:
        return len(self._store)


def _use_wal(db: sqlite3.Connection, attempts: int = 100) -> None:
    """Switches the file to WAL. Two ranks opening a new file at once can race in the switch,
    where SQLite answers "database is locked" at once instead of waiting (seen in CI with
    two processes): retry until the other one's switch is done."""
    for attempt in range(attempts):
        try:
            db.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or attempt == attempts - 1:
                raise
            time.sleep(0.05)


class SqliteBackend:
    """A SQLite file (WAL mode) that processes share and that outlives the run; no eviction.

    Keep ``path`` on a local disk: SQLite's locks are not reliable over NFS.
    """

    name = "sqlite"
    fallbacks = 0
    _CHUNK = 500  # keys per SELECT ... IN (...), well under SQLite's bound-variable limit

    def __init__(self, path: str):
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._db = sqlite3.connect(path, timeout=60.0)  # waits for another rank's write to finish
        _use_wal(self._db)
        self._db.execute("PRAGMA synchronous=NORMAL")  # WAL: a crashed process loses nothing committed
        with self._db:
            self._db.execute("CREATE TABLE IF NOT EXISTS rewards (key TEXT PRIMARY KEY, value BLOB NOT NULL)")

    def get_many(self, keys: Sequence[str]) -> list[float | None]:
        found: dict[str, float] = {}
        unique = list(dict.fromkeys(keys))
        for i in range(0, len(unique), self._CHUNK):
            chunk = unique[i: i + self._CHUNK]
            marks = ",".join("?" * len(chunk))
            rows = self._db.execute(f"SELECT key, value FROM rewards WHERE key IN ({marks})", chunk)
            found.update((k, decode(v)) for k, v in rows)
        return [found.get(k) for k in keys]

    def put_many(self, items: Mapping[str, float]) -> None:
        if not items:
            return
        with self._db:  # one transaction
            self._db.executemany("INSERT OR REPLACE INTO rewards (key, value) VALUES (?, ?)",
                                 [(k, encode(v)) for k, v in items.items()])

    def __len__(self) -> int:
        return self._db.execute("SELECT COUNT(*) FROM rewards").fetchone()[0]


class TieredBackend:
    """An in-process LRU in front of a shared store: repeated hits cost no round trip."""

    def __init__(self, front: MemoryBackend, store: CacheBackend):
        self.front, self.store = front, store

    @property
    def name(self) -> str:
        return self.store.name

    @property
    def fallbacks(self) -> int:
        return self.store.fallbacks

    def get_many(self, keys: Sequence[str]) -> list[float | None]:
        out = self.front.get_many(keys)
        missing = list(dict.fromkeys(k for k, v in zip(keys, out) if v is None))
        if missing:
            found = {k: v for k, v in zip(missing, self.store.get_many(missing)) if v is not None}
            self.front.put_many(found)
            out = [found.get(k) if v is None else v for k, v in zip(keys, out)]
        return out

    def put_many(self, items: Mapping[str, float]) -> None:
        self.store.put_many(items)
        self.front.put_many(items)

    def __len__(self) -> int:
        return len(self.store)
