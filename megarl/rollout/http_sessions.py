"""What the HTTP endpoint records per sample, so the trained sequence is token-in / token-out.

An agent speaks text (OpenAI messages), but every sampled token must reach the
trainer as the engine sampled it, with its log-prob. Each sample's calls are
recorded as *nodes*: the conversation state after one sampled turn — the ids
of the whole sequence (root prompt + sampled and appended ids), their
log-probs and loss mask, and the messages the call was made with.

How a call's prompt ids are found (:meth:`SampleSession.chat_prompt`):

* **extends a node**: the call's messages are a node's messages, then one
  assistant message (the turn that node sampled, whatever text the agent put
  back), then only tool / user / system messages. The prompt is that node's
  ids *as recorded* plus the ids the chat template puts after an assistant turn
  (:class:`~megarl.rollout.turns.TurnRenderer`, rendered and tokenized alone,
  loss mask 0). The agent's re-templated text is never re-tokenized, so an
  assistant message the agent reformatted (tool calls re-serialized as JSON,
  whitespace) costs nothing: the recorded ids win.
* **anything else** (the first call, or an agent that rewrote its history): the
  whole conversation rendered by the chat template is a new root prompt; the
  sample then has more than one chain (``agent_http/chain_resets``) and the
  trainer gets the chain of its last call.

Completions (``/v1/completions``) are token-level already: a prompt whose ids
start with a node's ids extends it (the rest is appended context), else it is a
new root.

A sample's response budget (``rollout.max_new_tokens``) counts sampled and
appended ids of a chain, as in the agent loop. With ``actor.router_replay=r3`` a
node also keeps the expert ids the engine recorded over its ids, merged call by
call as :mod:`megarl.rollout.expert_record` says (sampled tokens from the call
that sampled them, appended context from the next call's prefill).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from megarl.rollout.engine import GenerationResult, mix_seed
from megarl.rollout.expert_record import merge, positions, split


@dataclass
class Node:
    """The sequence after one sampled turn (or a root prompt before any)."""

    ids: list[int]  # root prompt + response so far
    prompt_len: int  # the root prompt's length
    logprobs: list[float]  # per response id
    loss_mask: list[int]  # per response id: 1 sampled, 0 appended context
    messages: list[dict]  # the messages the call that sampled this node was made with (chat), else []
    last_turn: list[int] = field(default_factory=list)  # ids sampled by that call
    finish: str = "length"
    # MoE, recorded: (positions, layers, k) expert ids of ids, the earliest call's first
    # (megarl/rollout/expert_record.py); None: nothing recorded
    experts: np.ndarray | None = None

    def extended(self, context: list[int], result: GenerationResult, messages: list[dict]) -> "Node":
        """The node after ``result``, a call on this node's ids + ``context``."""
        sampled = result.response_ids
        return Node(self.ids + context + sampled, self.prompt_len,
                    self.logprobs + [0.0] * len(context) + result.logprobs,
                    self.loss_mask + [0] * len(context) + [1] * len(sampled), messages, list(sampled),
                    result.finish_reason, merge(self.experts, positions(result)))

    @property
    def response_len(self) -> int:
        return len(self.ids) - self.prompt_len


def _plain(messages: list[dict]) -> list[tuple]:
    """What must match for a call to extend a node: roles, and contents except the assistant's."""
    return [(m.get("role"), None if m.get("role") == "assistant" else m.get("content") or "") for m in messages]


@dataclass
class Prompt:
    """Where a call's turn starts: the node it extends (or a root) and the ids appended to it."""

    base: Node
    context: list[int]  # appended after base.ids, loss mask 0

    @property
    def ids(self) -> list[int]:
        return self.base.ids + self.context


class SampleSession:
    """One sample's calls; thread-safe (an agent may call from several threads)."""

    def __init__(self, key: int, seed: int, budget: int, eos_ids: list[int]):
        self.key, self.seed, self.budget, self.eos_ids = key, seed, budget, set(eos_ids)
        self.nodes: list[Node] = []
        self.last: Node | None = None  # the node of the last call: the trajectory the trainer gets
        self.calls = 0
        self.chain_resets = 0
        self.closed = False
        self.lock = threading.Lock()

    def chat_prompt(self, messages: list[dict], renderer, render_root) -> Prompt:
        """The prompt of a chat call (see the module docstring). ``render_root(messages) -> ids``."""
        plain = _plain(messages)
        with self.lock:
            for node in reversed(self.nodes):
                k = len(node.messages)
                if node.messages and plain[:k] == _plain(node.messages) and len(messages) > k \
                        and messages[k].get("role") == "assistant" \
                        and all(m.get("role") != "assistant" for m in messages[k + 1:]):
                    context = renderer.ids_after_assistant(_for_template(messages[k + 1:]))
                    if node.ids and node.ids[-1] in self.eos_ids and context[:1] == node.ids[-1:]:
                        context = context[1:]  # the turn ended with the template's close already
                    return Prompt(node, context)
            return self._root(render_root(_for_template(messages)))

    def token_prompt(self, ids: list[int]) -> Prompt:
        """The prompt of a completions call: the longest node whose ids it starts with, else a root."""
        with self.lock:
            for node in sorted(self.nodes, key=lambda n: -len(n.ids)):
                if ids[:len(node.ids)] == node.ids:
                    return Prompt(node, ids[len(node.ids):])
            return self._root(ids)

    def _root(self, ids: list[int]) -> Prompt:
        if self.nodes:
            self.chain_resets += 1
        return Prompt(Node(list(ids), len(ids), [], [], []), [])

    def budget_left(self, prompt: Prompt) -> int:
        return self.budget - prompt.base.response_len - len(prompt.context)

    def next_seed(self, choice: int) -> int:
        """The seed of this call's choice ``choice`` (call numbers count per sample, in arrival order)."""
        return self.seed if self.calls == 0 and choice == 0 else mix_seed(mix_seed(self.seed, self.calls), choice)

    def record(self, prompt: Prompt, results: list[GenerationResult], messages: list[dict]) -> None:
        """The call's choices as new nodes; choice 0 is the sample's latest trajectory."""
        with self.lock:
            new = [prompt.base.extended(prompt.context, r, messages) for r in results]
            self.nodes += new
            self.last = new[0]
            self.calls += 1

    def result(self, fallback_prompt: list[int], pad_id: int, failed: bool, extra: dict) -> GenerationResult:
        """The trajectory the trainer gets: the last call's chain; a sample without one (or a failed
        one) is kept with loss mask 0 everywhere, so it trains nothing."""
        node = self.last
        if node is None or node.response_len == 0:
            node = Node(list(fallback_prompt) + [pad_id], len(fallback_prompt), [0.0], [0], [], [], "failed")
            failed = True
        mask = [0] * len(node.loss_mask) if failed else list(node.loss_mask)
        prompt_experts, experts = split(node.experts, node.prompt_len, node.response_len)
        return GenerationResult(node.ids[:node.prompt_len], node.ids[node.prompt_len:], list(node.logprobs),
                                "failed" if failed else node.finish, self.key,
                                {**extra, "final_turn_ids": node.last_turn, "agent_failed": failed,
                                 "chain_resets": self.chain_resets, "calls": self.calls},
                                loss_mask=mask, expert_ids=experts, prompt_expert_ids=prompt_experts)


def _for_template(messages: list[dict]) -> list[dict]:
    """OpenAI messages as plain chat-template input: string contents (parts joined), no None."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        out.append({**m, "content": content or ""})
    return out
