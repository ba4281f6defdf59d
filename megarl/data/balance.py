"""Balancing sequences over data-parallel ranks by token count (LPT).

    ranks = balance_lpt([len(s) for s in seqs], n_ranks=4)   # ranks[r]: indices for rank r

Longest-processing-time first: sequences in decreasing length (ties: lower
index first) each go to the rank with the fewest tokens so far (ties: lower
rank) among those with room. Deterministic, so every rank computes the same
assignment from the same global lengths. Without ``capacities`` the largest
load is at most 4/3 of the optimum (Graham 1969); with ``capacities`` (rows
per rank, e.g. to keep fixed-size micro-batches) ranks that are full are
skipped.
"""
from __future__ import annotations

from typing import Optional, Sequence


def balance_lpt(lengths: Sequence[int], n_ranks: int,
                capacities: Optional[Sequence[int]] = None) -> list[list[int]]:
    """Indices of ``lengths`` per rank, each list in increasing index order."""
    if n_ranks < 1:
        raise ValueError(f"balance_lpt: n_ranks={n_ranks}; need at least one rank")
    room = list(capacities) if capacities is not None else [len(lengths)] * n_ranks
    if len(room) != n_ranks or sum(room) < len(lengths):
        raise ValueError(f"balance_lpt: capacities {room} cannot hold {len(lengths)} sequences on {n_ranks} ranks")
    loads = [0] * n_ranks
    ranks: list[list[int]] = [[] for _ in range(n_ranks)]
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        r = min((r for r in range(n_ranks) if room[r] > 0), key=lambda r: (loads[r], r))
        ranks[r].append(i)
        loads[r] += lengths[i]
        room[r] -= 1
    return [sorted(idx) for idx in ranks]


def max_over_mean(loads: Sequence[float]) -> float:
    """Largest load over the mean load (1.0 = perfectly balanced; 1.0 when all are 0)."""
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0
