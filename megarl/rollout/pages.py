"""Paged KV cache: one pool of fixed-size pages, reference-counted, and the tensor behind it.

A sequence's keys and values live in pages listed in its block table: token
``j`` sits in page ``table[j // page_size]`` at row ``j % page_size``. Pages are
shared by reference count: the ``n`` samples of one prompt point at the same
prompt pages (the prompt is prefilled once), and a sample that is about to
write into a shared, partly filled page first copies it (copy-on-write). The
same mechanism lets a later multi-turn loop keep a conversation's pages alive
between turns (hold a reference, extend the table) instead of recomputing them.

Page 0 is scratch: never handed out, it receives the writes of padded rows of
a CUDA-graph batch.

MoE with recorded experts (``rollout.record_experts``) and the prefix cache: the
pool also keeps, row for row beside the K/V, the top-k expert ids of the forward
that computed each cached token (:class:`PageExperts`), so a sequence reusing a
page gets its prompt positions' ids as well (SGLang's routed-experts buffer,
indexed by KV slot, does the same).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container
from dataclasses import dataclass

import numpy as np
import torch

from megarl.models.router_replay import unrecorded_mark

SCRATCH_PAGE = 0


class OutOfPages(Exception):
    """The pool has fewer free pages than asked for (the scheduler preempts)."""


class PagePool:
    """Free list and reference counts of ``num_pages`` pages (page 0 reserved), and a prefix cache.

    Prefix cache: a full page can be registered under a key made of its tokens
    and of every token before it (:func:`prefix_keys`: nested tuples, compared
    exactly, so no hash collision can hand out wrong K/V); a later sequence
    whose tokens start the same way takes the page instead of recomputing it. A
    registered page that nobody holds is *idle*: still cached, but handed out
    (least recently used first) when the free list runs dry, so it counts as
    free. :meth:`forget` drops the cache (new weights make its K/V stale).
    ``experts`` (:meth:`keep_experts`): the cached tokens' expert ids, dropped with their pages.
    """

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"a page pool needs at least 2 pages (one is scratch), got {num_pages}")
        self.num_pages = num_pages
        self.experts: PageExperts | None = None
        self.reset()

    def keep_experts(self, page_size: int, shape: tuple[int, int], dtype: np.dtype) -> None:
        """From now on (once), keep each page's (page_size, layers, k) expert ids in ``experts``."""
        if self.experts is None:
            self.experts = PageExperts(self.num_pages, page_size, shape, dtype)

    def reset(self) -> None:
        """Every page free again and nothing cached (a new generate call reusing the storage)."""
        if self.experts is not None:  # ids are read only from cached pages: drop those
            self.experts.drop(list(self._key_of))
        self.refs = np.zeros(self.num_pages, dtype=np.int32)
        self.refs[SCRATCH_PAGE] = 1 << 30  # never freed
        self._free = list(range(self.num_pages - 1, 0, -1))  # pop() hands out low ids first
        self._page_of: dict[tuple, int] = {}  # prefix key -> page
        self._key_of: dict[int, tuple] = {}  # page -> prefix key
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached pages nobody holds, oldest first

    @property
    def free(self) -> int:
        return len(self._free) + len(self._idle)

    def alloc(self, count: int) -> list[int]:
        if count > self.free:
            raise OutOfPages(f"asked for {count} pages, {self.free} free")
        pages = [self._free.pop() if self._free else self._evict() for _ in range(count)]
        self.refs[pages] = 1
        return pages

    def _evict(self) -> int:
        page, _ = self._idle.popitem(last=False)
        del self._page_of[self._key_of.pop(page)]
        if self.experts is not None:
            self.experts.drop([page])
        return page

    def share(self, pages: list[int]) -> None:
        """One more holder of ``pages``."""
        np.add.at(self.refs, pages, 1)

    def release(self, pages: list[int]) -> None:
        """One holder fewer; pages nobody holds go back to the free list (cached ones: idle)."""
        for page in pages:
            self.refs[page] -= 1
            if self.refs[page] == 0:
                if page in self._key_of:
                    self._idle[page] = None
                else:
                    self._free.append(page)
            elif self.refs[page] < 0:
                raise RuntimeError(f"page {page} released more often than held")

    def shared(self, page: int) -> bool:
        return self.refs[page] > 1

    # -- prefix cache --------------------------------------------------------
    def register(self, page: int, key: tuple) -> bool:
        """``page`` (full, held) holds the K/V of the tokens that ``key`` names; False when either is
        cached already (nothing changes)."""
        if key in self._page_of or page in self._key_of:
            return False
        self._page_of[key] = page
        self._key_of[page] = key
        return True

    def lookup(self, key: tuple, unless: Container[int] = ()) -> int | None:
        """The cached page for ``key``, now held once more by the caller; None on a miss, or when the
        page is one of ``unless`` (then it is not taken)."""
        page = self._page_of.get(key)
        if page is None or page in unless:
            return None
        self._idle.pop(page, None)
        self.refs[page] += 1
        return page

    def forget(self) -> None:
        """Drops every cached prefix (and its expert ids); idle pages become free."""
        if self.experts is not None:
            self.experts.drop(list(self._key_of))
        self._free += list(self._idle)
        self._idle.clear()
        self._page_of.clear()
        self._key_of.clear()


class PageExperts:
    """MoE, recorded: (pages, page_size, layers, k) host ids, row for row where the pool's K/V are.

    Every recorded step writes its tokens' ids at the cache rows its K/V went to (``write``, with its
    copy-on-write page copies first), so a full cached page holds the ids of the forward that computed
    its K/V. Rows of pages that leave the cache are set back to the unrecorded mark (``drop``); a page
    is read only once the scheduler knows its ids are written (megarl/rollout/scheduler.py). Per
    token it costs layers x k bytes (uint8 below 256 experts) beside the K/V's
    2 x layers x kv_heads x head_dim x dtype bytes.
    """

    def __init__(self, num_pages: int, page_size: int, shape: tuple[int, int], dtype: np.dtype):
        self.mark = unrecorded_mark(np.dtype(dtype))
        self.rows = np.full((num_pages, page_size, *shape), self.mark, dtype=dtype)  # (pages, page_size, layers, k)

    def write(self, cache_rows: np.ndarray, ids: np.ndarray) -> None:
        """(T,) cache rows (page * page_size + offset) <- (T, layers, k) ids of the tokens computed there."""
        self.rows.reshape(-1, *self.rows.shape[2:])[cache_rows] = ids

    def copy(self, src: list[int], dst: list[int]) -> None:
        """Copy-on-write, as :meth:`KVCache.copy_pages`: pages ``src`` -> ``dst``."""
        if len(src):
            self.rows[list(dst)] = self.rows[list(src)]

    def read(self, pages: list[int], tokens: int) -> np.ndarray:
        """(tokens, layers, k) ids of the first ``tokens`` tokens laid out in ``pages``."""
        return self.rows[pages].reshape(-1, *self.rows.shape[2:])[:tokens]

    def drop(self, pages) -> None:
        """``pages`` no longer hold cached ids."""
        self.rows[pages] = self.mark


def prefix_keys(tokens: list[int], page_size: int, pages: int) -> list[tuple]:
    """Keys of the first ``pages`` full pages of ``tokens``: (key of the page before, this page's tokens)."""
    out, key = [], ()
    for k in range(pages):
        key = (key, tuple(tokens[k * page_size:(k + 1) * page_size]))
        out.append(key)
    return out


@dataclass(frozen=True)
class KVLayout:
    """Shape of this rank's cache: its pipeline stage's layers, its TP share of the KV heads."""

    layers: int
    kv_heads: int  # per TP rank
    head_dim: int
    page_size: int
    dtype: torch.dtype

    def page_bytes(self) -> int:
        """Bytes of one page over all layers, keys and values."""
        item = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.layers * self.page_size * self.kv_heads * self.head_dim * item


class KVCache:
    """The pool's storage: (layers, 2, pages, page_size, kv_heads, head_dim).

    ``pinned``: the storage keeps one device address for its whole life
    (:class:`~megarl.rollout.vmm.PinnedAddressBuffer`), so CUDA graphs that
    read it stay valid while :meth:`release` gives the memory back between
    generate calls; otherwise it is a plain tensor, dropped by its owner.
    """

    def __init__(self, layout: KVLayout, num_pages: int, device, pinned: bool = False):
        self.layout = layout
        shape = (layout.layers, 2, num_pages, layout.page_size, layout.kv_heads, layout.head_dim)
        self.storage = None
        if pinned:
            from megarl.rollout.vmm import PinnedAddressBuffer

            self.storage = PinnedAddressBuffer(num_pages * layout.page_bytes(), torch.device(device))
            self.data = self.storage.view(shape, layout.dtype)
        else:
            self.data = torch.zeros(shape, dtype=layout.dtype, device=device)
        self.pool = PagePool(num_pages)

    @property
    def capacity(self) -> int:
        """Pages the storage holds (the pool may use fewer)."""
        return self.data.shape[2]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def release(self) -> None:
        """Pinned storage: unmap the memory (the address stays)."""
        self.storage.unmap()

    def resume(self) -> None:
        """Pinned storage: map memory again at the same address (contents undefined)."""
        self.storage.map()
        self.pool.reset()  # nothing cached survives an unmap

    def keys(self, layer: int) -> torch.Tensor:
        return self.data[layer, 0]  # (pages, page_size, kv_heads, head_dim)

    def values(self, layer: int) -> torch.Tensor:
        return self.data[layer, 1]

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy-on-write: pages ``src`` -> ``dst`` in every layer, keys and values."""
        if src:
            s = torch.tensor(src, device=self.data.device)
            d = torch.tensor(dst, device=self.data.device)
            self.data[:, :, d] = self.data[:, :, s]


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def pool_pages(layout: KVLayout, budget_bytes: float, needed_tokens: int, max_seqs: int) -> int:
    """Pages to allocate: what the requests can use at most, capped by the budget.

    ``needed_tokens`` is the sum over requests of prompt + max_new_tokens (an
    upper bound: shared prompt pages make it less); the budget wins when smaller,
    and the scheduler then preempts instead of running out of memory.
    """
    need = pages_for(needed_tokens, layout.page_size) + max_seqs + 1  # + partial pages + scratch
    fits = int(budget_bytes // layout.page_bytes())
    return max(2, min(need, fits))
