"""Continuous batching over a paged KV cache: who runs in the next forward.

Every rank of a TP x PP replica runs an identical scheduler on identical inputs
(prompts, sampled tokens), so they agree on every step without talking.

A step is either a **prefill** (chunks of waiting sequences, at most
``max_tokens`` new tokens; a long prompt takes several steps) or a **decode**
(one token for every running sequence). Prefill goes first whenever a waiting
sequence fits: finished sequences free slots and pages, and the freed room is
refilled at once. With ``mixed`` a prefill step also decodes one token of every
running sequence (a **mixed** step: those rows come first, one query each, and
count against ``max_tokens``), so a refill no longer stops the decode for a
forward of its own. Requests of one prompt are one **group** (the engine forms
them): the leader is prefilled once and the others fork from it, sharing its
pages. When a decode step needs more pages than are free, the most recently
admitted sequences are **preempted**: their pages are released and they wait,
at the front of the queue, to be recomputed from their tokens — never an OOM.

Hot state is per slot in numpy arrays (block table, length, last token), so a
decode step costs a few vector ops, not a Python loop over the batch.

A step is committed in two halves, so the engine can plan (and launch) the
next decode while the device still runs this one: :meth:`Scheduler.advance`
does what does not depend on the sampled tokens (lengths, pages, slots of
sequences at their length limit), :meth:`Scheduler.record` appends the tokens
and ends sequences at a stop token. Between the two the last token of a
sequence is *pending*: the next decode plan names its row in the previous
step's output (``src_rows``) instead of the token. :meth:`can_plan_ahead`
says when planning a decode ahead is safe (no admission, no preemption); a
row planned for a sequence whose pending token was a stop is dropped by
``record``. A refill may be planned ahead of a pending decode too
(:meth:`plan_prefill`: it feeds waiting prompts, whose tokens are all known);
its sampled tokens are then pending in its own output rows, which the engine
places after the decode's (``row_base``).

A sequence is *finished* once its last token is recorded (a stop token, or the
``max_new``-th): :meth:`Scheduler.take_finished` hands those out step by step,
for a caller that answers them with new requests while others still decode
(``NativeEngine.serve``); new requests join the waiting queue like any other.

MoE with recorded experts (``record_experts``) and the prefix cache: a sequence that
reuses cached pages takes their tokens' expert ids into its prompt record
(``Sequence.prompt_experts``) from the pool's :class:`~megarl.rollout.pages.PageExperts`,
where each recorded step wrote its ids at its K/V's cache rows. Those ids arrive when
the step is *recorded*, while its pages are registered when it is *advanced* (a step
launched ahead is recorded after the next one is planned), so a page registered with
tokens fed by a step not recorded yet (past ``Sequence.ids_written``) is not reused
before the last step advanced then is recorded (``_ids_due``). The rule is the
schedule's alone, so every rank of a replica agrees on it, a pipeline stage with no
MoE layer (nothing recorded) included.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np

from megarl.rollout.pages import PagePool, pages_for, prefix_keys

# While others decode, a prefill waits until this fraction of the slots is free (or every
# waiting request fits): a prefill step stops every decoding slot for its length, against idle
# slots while waiting. Chosen by a sweep of 1/64 .. 1/8 on ragged requests with graph-replayed
# prefills, where 1/32 made the most useful tokens per second (docs/performance.md); the spread
# between the fractions was a few percent, and any fraction gives the same tokens per request.
ADMIT_FRACTION = 1 / 32


@dataclass
class Sequence:
    """One response being generated."""

    rid: int  # the request's key
    prompt_index: int  # its prefill group (the engine's number for its prompt)
    prompt: list[int]
    seed: int
    max_new: int  # response length limit
    generated: list[int] = field(default_factory=list)  # set back when preempted or finished
    logprobs: list[float] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    cached: int = 0  # tokens whose K/V are in the cache
    slot: int = -1
    forks: list["Sequence"] = field(default_factory=list)  # siblings waiting on this prefill
    finish: str | None = None
    experts: dict = field(default_factory=dict)  # MoE, recorded: response index -> (layers, k) expert ids
    ids_written: int = 0  # MoE, recorded, prefix cache: leading tokens whose ids the steps recorded so far wrote
    # MoE, recorded: (P - 1, layers, k) expert ids that routed prompt tokens 0 .. P - 2 (the prefill's, and at
    # positions in reused prefix-cache pages the forward's that computed them; one array for a prefill group,
    # a fresh one when a preempted sequence is prefilled again)
    prompt_experts: np.ndarray | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated


@dataclass
class StepPlan:
    """One forward: packed new tokens of N sequences and the rows to sample (numpy)."""

    decode: bool
    seqs: list[Sequence]  # (N,) sequences fed this step
    input_ids: np.ndarray  # (T,) int64
    positions: np.ndarray  # (T,) int64
    slot_mapping: np.ndarray  # (T,) int64 cache row of each new token: page * page_size + offset
    block_table: np.ndarray  # (N, max_pages) int32
    seq_lens: np.ndarray  # (N,) int32 keys per sequence after this step
    cu_seqlens_q: np.ndarray  # (N + 1,) int32
    sample_rows: np.ndarray  # (S,) int64 packed token whose logits each sample uses
    sampled: list[Sequence]  # (S,) who receives each sample
    seeds: np.ndarray  # (S,) int64
    offsets: np.ndarray  # (S,) int64 index of the token being sampled in its response
    copies: tuple[list[int], list[int]] = ((), ())  # copy-on-write pages (src, dst) before the step
    src_rows: np.ndarray | None = None  # (T,) row of the previous step's output holding the fed token,
    #                                     -1 where input_ids has it (None: all in input_ids)
    decoding: int = 0  # a mixed prefill: its first `decoding` seqs are running ones, one token each
    step: int = -1  # set by Scheduler.advance: its number among the steps advanced


class Scheduler:
    """Queues, slots and pages for one ``generate`` call."""

    def __init__(self, pool: PagePool, page_size: int, max_seqs: int, max_tokens: int,
                 max_pages: int, stop_ids: set[int], prefix_cache: bool = False, mixed: bool = False,
                 record_experts: bool = False):
        self.pool, self.page_size, self.prefix_cache, self.mixed = pool, page_size, prefix_cache, mixed
        self.record_experts = record_experts  # MoE: reused pages bring their expert ids (module docstring)
        self.reused_tokens = 0  # prompt tokens whose K/V came from the prefix cache
        self._ids_due: dict[int, int] = {}  # record_experts: page registered -> the step whose record fills its ids
        self.max_seqs, self.max_tokens = max_seqs, max_tokens
        self.admit_slots = max(1, int(max_seqs * ADMIT_FRACTION))
        self.stop_ids = set(stop_ids)
        self.table = np.zeros((max_seqs, max_pages), dtype=np.int32)  # SCRATCH_PAGE where unused
        self.lens = np.zeros(max_seqs, dtype=np.int64)  # tokens per slot (prompt + generated)
        self.last = np.zeros(max_seqs, dtype=np.int64)
        self.pending = np.full(max_seqs, -1, dtype=np.int64)  # output row of a slot's unrecorded token
        self.pending_step = np.full(max_seqs, -1, dtype=np.int64)  # the step whose output that row is
        self.prompt_len = np.zeros(max_seqs, dtype=np.int64)
        self.max_new = np.zeros(max_seqs, dtype=np.int64)
        self.free_slots = list(range(max_seqs - 1, -1, -1))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last is preempted first
        self.done: list[Sequence] = []
        self.finished: list[Sequence] = []  # done with every token recorded, not yet taken
        self.preemptions = 0
        self._advanced = 0  # steps advanced so far (StepPlan.step)

    # -- queue ---------------------------------------------------------------
    def add_group(self, seqs: list[Sequence]) -> None:
        """Requests of one prompt: the first is prefilled, the rest fork from it."""
        leader, *rest = seqs
        leader.forks = rest
        self.waiting.append(leader)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def plan_prefill(self, mixed_max_tokens: int | None = None) -> StepPlan | None:
        """A prefill of waiting sequences if one is due and fits now, else None (nothing is preempted);
        a mixed one of at most ``mixed_max_tokens`` new tokens when given (below the scheduler's own
        budget: the engine's prefill graphs, since a mixed step planned ahead of a pending one names
        pending tokens and cannot run eagerly)."""
        return self._plan_prefill(mixed_max_tokens) if self.waiting else None

    def next_step(self) -> StepPlan:
        while True:
            plan = self._plan_prefill() if self.waiting else None
            if plan is not None:
                return plan
            if not self.running:
                raise RuntimeError("the KV cache cannot hold one waiting sequence; raise rollout.kv_cache_gb")
            copies = self._pages_for_decode()  # may preempt every running sequence: then prefill again
            if self.running:
                return self._plan_decode(copies)

    # -- prefill -------------------------------------------------------------
    def _admit(self, seq: Sequence) -> bool:
        """Slots for a waiting sequence and its forks; False when they do not fit."""
        if seq.slot >= 0:
            return True
        group = 1 + len(seq.forks)
        if len(self.free_slots) < group:
            return False
        seq.slot = self.free_slots.pop()
        for f in seq.forks:
            f.slot = self.free_slots.pop()
        return True

    def _worth_admitting(self) -> bool:
        """Prefill now, or keep decoding until more slots are free (``ADMIT_FRACTION``)?"""
        head = self.waiting[0]
        if not self.running or head.slot >= 0:  # nothing to decode, or a prompt half prefilled
            return True
        wanted = 0  # slots the waiting groups need, counted up to admit_slots
        for seq in self.waiting:
            wanted += 1 + len(seq.forks)
            if wanted >= self.admit_slots:
                break
        return len(self.free_slots) >= min(wanted, self.admit_slots)

    def _due_tokens(self) -> int:
        """New tokens of the waiting prompts that the free slots could take now."""
        slots, tokens = len(self.free_slots), 0
        for seq in self.waiting:
            group = 0 if seq.slot >= 0 else 1 + len(seq.forks)
            if group > slots:
                break
            slots -= group
            tokens += len(seq.tokens) - seq.cached
        return tokens

    def _unmixed_refill(self, mixed_budget: int, capped: bool) -> bool:
        """Should this refill stop the decode? Yes when its due prompts do not fit beside the running rows
        and either the mixed budget is the prefill graphs' cap (a wave: one prefill at the full budget, not
        capped chunks) or they are new prompts that fit the full budget alone: mixed, the last one would be
        cut, and the sequences started a step later stay a step apart to the end of the run (a run of
        fixed-length waves then ended with one request decoding alone for a whole response). A prompt
        already being chunked keeps its mixed chunks."""
        due = self._due_tokens()
        whole = due <= self.max_tokens and self.waiting[0].slot < 0
        return due + len(self.running) > mixed_budget and (capped or whole)

    def _plan_prefill(self, mixed_max_tokens: int | None = None) -> StepPlan | None:
        if not self._worth_admitting():
            return None
        mixed_budget = min(self.max_tokens, mixed_max_tokens or self.max_tokens)
        decoding = self.mixed and 0 < len(self.running) < mixed_budget  # running rows ride along (mixed step)
        if decoding and self._unmixed_refill(mixed_budget, capped=mixed_max_tokens is not None):
            decoding = False
        budget = mixed_budget - len(self.running) if decoding else self.max_tokens
        chunks = []
        for seq in list(self.waiting):
            if budget == 0 or not self._admit(seq):
                break
            if self.prefix_cache and not seq.pages:
                self._reuse_prefix(seq)
            tokens = len(seq.tokens)
            take = min(tokens - seq.cached, budget)
            grow = pages_for(seq.cached + take, self.page_size) - len(seq.pages)
            # keep a page of headroom per decoding sequence (and per fork) so decode rarely preempts
            reserve = len(self.running) + len(seq.forks)
            if self.pool.free - grow < reserve and (chunks or self.running):
                break
            if grow > self.pool.free:
                break
            seq.pages += self.pool.alloc(grow)
            self._set_table(seq)
            chunks.append((seq, seq.cached, seq.cached + take))
            budget -= take
            if seq.cached + take < tokens:
                break  # the rest of this prompt goes in the next step
        if not chunks:
            return None
        # the prefill left a page per running sequence (reserve above), so this never preempts
        decoding = decoding and len(self._decode_page_needs()) <= self.pool.free
        copies = self._pages_for_decode() if decoding else ((), ())
        return self._step_plan(chunks, list(self.running) if decoding else [], copies)

    def _reuse_prefix(self, seq: Sequence) -> None:
        """Cached full pages that start ``seq``'s tokens (at least its last token is left to compute);
        recording experts, only pages whose ids are written, and their ids go to its prompt record."""
        tokens = seq.tokens
        unless = self._ids_due if self.record_experts else ()
        for key in prefix_keys(tokens, self.page_size, (len(tokens) - 1) // self.page_size):
            page = self.pool.lookup(key, unless)
            if page is None:
                break
            seq.pages.append(page)
            seq.cached += self.page_size
        self.reused_tokens += seq.cached
        self._set_table(seq)
        if self.record_experts and seq.cached and self.pool.experts is not None:
            self._reused_prompt_experts(seq)

    def _reused_prompt_experts(self, seq: Sequence) -> None:
        """A fresh prompt record for ``seq`` (shared with its forks) holding its reused pages' ids at its
        prompt positions (but the last, never in a reused page); its prefill records the rest. Reused
        positions past the prompt (a preempted or resumed sequence's response) keep the rows that
        sampled them."""
        store, count = self.pool.experts, len(seq.prompt) - 1
        seq.prompt_experts = np.full((count, *store.rows.shape[2:]), store.mark, dtype=store.rows.dtype)
        reused = min(seq.cached, count)
        seq.prompt_experts[:reused] = store.read(seq.pages, reused)  # (reused, layers, k)
        for fork in seq.forks:
            fork.prompt_experts = seq.prompt_experts

    def _remember(self, seq: Sequence) -> None:
        """Registers ``seq``'s full pages of computed K/V in the prefix cache (recording experts: a page
        holding tokens past those whose ids are written has them once the last step advanced is recorded)."""
        if self.prefix_cache:
            full = min(seq.cached, len(seq.tokens)) // self.page_size  # a pending token's page waits
            keys = prefix_keys(seq.tokens, self.page_size, full)
            for k, (page, key) in enumerate(zip(seq.pages, keys)):
                if self.pool.register(page, key) and self.record_experts and (k + 1) * self.page_size > seq.ids_written:
                    self._ids_due[page] = self._advanced - 1

    def _step_plan(self, chunks, decoding: list[Sequence], copies) -> StepPlan:
        """Prompt chunks (seq, start, end), after one decode row of each of ``decoding`` (a mixed step):
        the decode row feeds the last sampled token, whose K/V land at lens - 1."""
        d = len(decoding)
        dec = np.array([s.slot for s in decoding], dtype=np.int64)  # (D,)
        ids, pos, cu, sample_rows, sampled = [], [], [d], [], []
        for seq, start, end in chunks:
            tokens = seq.tokens
            ids += tokens[start:end]
            pos += range(start, end)
            cu.append(cu[-1] + end - start)
            if end == len(tokens):  # prompt complete: sample for it and its forks
                group = [seq] + seq.forks
                sample_rows += [cu[-1] - 1] * len(group)
                sampled += group
        seqs = decoding + [c[0] for c in chunks]
        positions = np.concatenate([self.lens[dec] - 1, np.array(pos, dtype=np.int64)])
        slots = np.array([s.slot for s in seqs])
        cu_seqlens = np.concatenate([np.arange(d), cu]).astype(np.int32)
        seq_of_token = np.repeat(slots, np.diff(cu_seqlens))
        seq_lens = np.concatenate([self.lens[dec], [c[2] for c in chunks]]).astype(np.int32)
        offsets = [len(s.generated) for s in sampled]
        return StepPlan(
            decode=False, seqs=seqs, input_ids=np.concatenate([self.last[dec], np.array(ids, dtype=np.int64)]),
            positions=positions, slot_mapping=self._cache_rows(seq_of_token, positions),
            block_table=self._tables(slots, seq_lens), seq_lens=seq_lens, cu_seqlens_q=cu_seqlens,
            sample_rows=np.concatenate([np.arange(d), np.array(sample_rows, dtype=np.int64)]),
            sampled=decoding + sampled, seeds=np.array([s.seed for s in decoding + sampled], dtype=np.int64),
            offsets=np.concatenate([self.lens[dec] - self.prompt_len[dec], np.array(offsets, dtype=np.int64)]),
            copies=copies, src_rows=np.concatenate([self.pending[dec], np.full(len(ids), -1)]) if d else None,
            decoding=d,
        )

    # -- decode --------------------------------------------------------------
    def _plan_decode(self, copies: tuple[list[int], list[int]]) -> StepPlan:
        """One token of every running sequence: a mixed step's decode rows without prompt chunks."""
        return replace(self._step_plan([], list(self.running), copies), decode=True, decoding=0)

    def _pages_for_decode(self) -> tuple[list[int], list[int]]:
        """A page for every sequence whose next token starts one or lands in a shared page."""
        while self.running:
            needs = self._decode_page_needs()
            if len(needs) <= self.pool.free:
                break
            partial = next((s for s in self.waiting if s.pages), None)  # a prompt half prefilled
            self._preempt(partial or self.running[-1])
        else:
            return [], []
        src, dst = [], []
        for seq, index in needs:
            page = self.pool.alloc(1)[0]
            if index < len(seq.pages):  # shared partial page: copy, then write the copy
                src.append(seq.pages[index])
                dst.append(page)
                self.pool.release([seq.pages[index]])
                seq.pages[index] = page
            else:
                seq.pages.append(page)
            self.table[seq.slot, index] = page
        return src, dst

    def _decode_page_needs(self) -> list[tuple[Sequence, int]]:
        """(sequence, page index) for every write that needs a fresh page (vectorized; loops over those only)."""
        slots = np.array([seq.slot for seq in self.running])
        index = (self.lens[slots] - 1) // self.page_size  # (B,) page of the position written
        held = self.table[slots, np.minimum(index, self.table.shape[1] - 1)]
        fresh = held == 0  # past the sequence's pages (page 0 is never a sequence's)
        shared = ~fresh & (self.pool.refs[held] > 1)
        needs = [(self.running[i], int(index[i])) for i in np.flatnonzero(fresh)]
        shared_seen: dict[int, int] = {}  # the last holder of a shared page may keep it
        for i in np.flatnonzero(shared):
            page = int(held[i])
            shared_seen[page] = shared_seen.get(page, 0) + 1
            if shared_seen[page] < self.pool.refs[page]:
                needs.append((self.running[i], int(index[i])))
        return needs

    def _preempt(self, seq: Sequence) -> None:
        """Release ``seq``'s pages and slots; it waits at the front to be recomputed.

        A running sequence goes back to the front of the queue; a half-prefilled
        prompt keeps its place (and its forks, whose slots it held for them).
        """
        self._remember(seq)  # its recompute (or a neighbour) may find these pages again
        self.pool.release(seq.pages)
        seq.pages, seq.cached, seq.ids_written = [], 0, 0
        for member in [seq] + seq.forks:
            self._free_slot(member)
        if seq in self.running:
            self.running.remove(seq)
            self.waiting.appendleft(seq)
        self.preemptions += 1

    # -- results -------------------------------------------------------------
    def can_plan_ahead(self) -> bool:
        """True if the next step is a decode of running sequences that needs neither an admission
        nor a preemption: it can be planned before the pending tokens are recorded. (A due admission
        may still be planned ahead of a pending decode: :meth:`plan_prefill`.)"""
        if not self.running or (self.waiting and self._worth_admitting()):
            return False
        return len(self._decode_page_needs()) <= self.pool.free

    def commit(self, plan: StepPlan, tokens: np.ndarray, logprobs: np.ndarray) -> None:
        """Both halves at once: the step ran and its tokens (S,) are here."""
        self.advance(plan)
        self.record(plan, tokens, logprobs)

    def advance(self, plan: StepPlan, on_device: bool = False, row_base: int = 0) -> None:
        """The token-independent half of a step: cached tokens, lengths, and sequences that reach
        their length limit with this step's token end now. ``on_device``: the sampled tokens stay
        in the step's output rows, ``row_base`` + row (the next decode reads them there)."""
        plan.step, self._advanced = self._advanced, self._advanced + 1
        for seq, start, end in zip(plan.seqs, plan.cu_seqlens_q[:-1], plan.cu_seqlens_q[1:]):
            seq.cached += int(end - start)
        if not plan.decode:
            prefilled = plan.seqs[plan.decoding:]
            for seq in prefilled:
                self._remember(seq)  # full pages now computed, for requests that start the same way
            self._start_decoding(prefilled)
        slots = np.array([s.slot for s in plan.sampled], dtype=np.int64)
        self.lens[slots] += 1
        self.pending[slots] = row_base + np.arange(len(slots)) if on_device else -1
        self.pending_step[slots] = plan.step
        at_limit = self.lens[slots] - self.prompt_len[slots] >= self.max_new[slots]
        for i in np.flatnonzero(at_limit):
            seq = plan.sampled[i]
            seq.finish = "length"
            self._retire(seq)

    def record(self, plan: StepPlan, tokens: np.ndarray, logprobs: np.ndarray) -> None:
        """The sampled tokens (S,) of an advanced step; a stop token ends its sequence."""
        if self.record_experts and self.prefix_cache:  # this step's ids are written: up to each fed token's
            for seq, end in zip(plan.seqs, plan.positions[plan.cu_seqlens_q[1:] - 1].tolist()):
                seq.ids_written = end + 1
        for seq, tok, lp in zip(plan.sampled, tokens.tolist(), logprobs.tolist()):
            if seq.finish == "stop":
                continue  # a row planned ahead past the sequence's stop token
            seq.generated.append(tok)
            seq.logprobs.append(lp)
            if seq.slot >= 0 and seq.finish is None:
                self.last[seq.slot] = tok
                if self.pending_step[seq.slot] == plan.step:  # else a later step's row holds it now
                    self.pending[seq.slot] = -1
            if tok in self.stop_ids:
                if seq.finish is None:
                    self._retire(seq)
                seq.finish = "stop"
            if seq.finish == "stop" or (seq.finish == "length" and len(seq.generated) == seq.max_new):
                self.finished.append(seq)  # its last token: later rows of it are skipped above
        if self._ids_due:  # steps are recorded in order: the ids of this one and those before are written
            self._ids_due = {page: step for page, step in self._ids_due.items() if step > plan.step}

    def unfinished(self) -> list[Sequence]:
        """Sequences not done (running, waiting, and the forks of waiting leaders), each with the tokens
        it recorded; only meaningful once no step is pending."""
        waiting = [m for seq in self.waiting for m in [seq] + seq.forks]
        return [s for s in self.running + waiting if s.finish is None]

    def take_finished(self) -> list[Sequence]:
        """Sequences finished since the last call, in the order their last tokens were recorded."""
        out, self.finished = self.finished, []
        return out

    def _retire(self, seq: Sequence) -> None:
        """A finished sequence gives back its slot and pages (later kernels run after this step's)."""
        self.running.remove(seq)
        self._remember(seq)
        self.pool.release(seq.pages)
        seq.pages = []
        self._free_slot(seq)
        self.done.append(seq)

    def _start_decoding(self, prefilled: list[Sequence]) -> None:
        """Prefilled sequences (and their forks, sharing the pages) start decoding."""
        for seq in prefilled:
            if seq.cached < len(seq.tokens):
                continue
            self.waiting.remove(seq)
            for member in [seq] + seq.forks:
                if member is not seq:
                    member.pages, member.cached = list(seq.pages), seq.cached
                    self.pool.share(seq.pages)
                    self._set_table(member)
                self.lens[member.slot] = len(member.tokens)
                self.prompt_len[member.slot], self.max_new[member.slot] = len(member.prompt), member.max_new
                self.running.append(member)
            seq.forks = []

    # -- helpers -------------------------------------------------------------
    def _set_table(self, seq: Sequence) -> None:
        self.table[seq.slot, : len(seq.pages)] = seq.pages

    def _free_slot(self, seq: Sequence) -> None:
        self.table[seq.slot] = 0
        self.pending[seq.slot] = -1
        self.free_slots.append(seq.slot)
        seq.slot = -1

    def _tables(self, slots: np.ndarray, seq_lens: np.ndarray) -> np.ndarray:
        """Block tables of ``slots``, as wide as the longest of them needs (less work on short batches)."""
        return self.table[slots, : pages_for(int(seq_lens.max()), self.page_size)]

    def _cache_rows(self, slots: np.ndarray, positions: np.ndarray) -> np.ndarray:
        pages = self.table[slots, positions // self.page_size].astype(np.int64)
        return pages * self.page_size + positions % self.page_size
