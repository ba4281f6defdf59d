"""``stream=true`` on ``/v1/chat/completions``: Server-Sent Events as the engine samples.

Each choice's request is registered with the engine's queue with a token
callback (:meth:`~megarl.rollout.http_server.EngineQueue.submit`); between
engine steps the engine's thread hands it the tokens recorded so far, and the
new ones wait in the choice's :class:`TokenInbox` until the handler's event loop
takes them (the tokens of every step since its last turn at once). Per choice the
client gets a role chunk, then content deltas as tokens arrive (each chunk with its
tokens' log-probs when asked; with log-probs a chunk goes out for every delivery,
even while its text is held back), then, when the request finishes, the rest of the
content, the tool calls, the finish reason (with megarl's ``token_ids``), and
after every choice the usage and ``[DONE]``.

The streamed content always adds up to the non-streamed message's content:

* text from ``<tool_call>`` on is held back until the end (it is a call's body
  when the parser finds calls, and content when it does not), and so is a tail
  that may be the start of ``<tool_call>`` or an incomplete character;
* with ``stop`` strings, tokens after the one that completes a stop string are
  not sent (the request is cut there, as the non-streamed one is).
"""
from __future__ import annotations

import asyncio
import json
import threading

from aiohttp import web

from megarl.rollout.engine import GenerationResult
from megarl.rollout.http_openai import choice_message, cut_at_stop, first_stop, token_logprob
from megarl.tools import TOOL_CALL_START


class ChoiceStream:
    """One choice's chunks: content deltas while it decodes, the rest when it finishes."""

    def __init__(self, state, index: int, head: dict, stop: list[str], logprobs: bool):
        self.state, self.index, self.head, self.stop, self.logprobs = state, index, head, stop, logprobs
        self.ids: list[int] = []
        self.lps: list[float] = []
        self.sent_text, self.sent_tokens = "", 0
        self.cut = False  # a stop string completed: later tokens are not this choice's
        self.checked = 0  # tokens whose prefixes complete no stop string
        self.eos_texts = state.tokenizer.convert_ids_to_tokens(state.eos_ids)

    def chunk(self, delta: dict, finish: str | None = None, **extra) -> dict:
        return self.head | {"choices": [{"index": self.index, "delta": delta, "finish_reason": finish, **extra}]}

    def opening(self) -> dict:
        return self.chunk({"role": "assistant", "content": ""})

    def extend(self, ids: list[int], lps: list[float]) -> list[dict]:
        """The engine recorded these tokens since the last call: their content delta, if any."""
        if self.cut:
            return []
        self.ids += ids
        self.lps += lps
        if self.stop:
            self._cut_at_stop()
        return self._delta(self._safe_text())

    def _cut_at_stop(self) -> None:
        """Cuts after the first token that completes a stop string (as ``cut_at_stop`` does), the
        prefixes already checked left out."""
        k = first_stop(self.ids, self.stop, self.state.decode, self.checked)
        if k is not None:
            self.ids, self.lps, self.cut = self.ids[:k], self.lps[:k], True
        self.checked = len(self.ids)

    def finish(self, result: GenerationResult) -> list[dict]:
        """The request finished (``result`` cut at the stop strings): the rest of its message."""
        self.ids, self.lps = list(result.response_ids), list(result.logprobs)
        message, finish = choice_message(self.state, result)
        content = message.get("content") or ""
        chunks = self._delta(content)
        for k, call in enumerate(message.get("tool_calls") or []):
            chunks.append(self.chunk({"tool_calls": [{"index": k, **call}]}))
        chunks.append(self.chunk({}, finish, token_ids=list(result.response_ids)))
        return chunks

    def _text(self) -> str:
        text = self.state.decode(self.ids)
        for eos in self.eos_texts:
            text = text.replace(eos, "")
        return text

    def _safe_text(self) -> str:
        """The content so far that no later token can change."""
        text = self._text()
        if TOOL_CALL_START in text:
            return text[:text.index(TOOL_CALL_START)]
        for k in range(min(len(TOOL_CALL_START) - 1, len(text)), 0, -1):
            if TOOL_CALL_START.startswith(text[-k:]):
                return text[:-k]
        return text.rstrip("\ufffd")

    def _delta(self, text: str) -> list[dict]:
        """A chunk with the content past what was sent and the log-probs of the tokens not yet sent."""
        grown = text.startswith(self.sent_text) and len(text) > len(self.sent_text)
        entries = [token_logprob(self.state, i, lp) for i, lp in
                   zip(self.ids[self.sent_tokens:], self.lps[self.sent_tokens:])] if self.logprobs else []
        if not grown and not entries:
            return []
        delta = {"content": text[len(self.sent_text):]} if grown else {}
        self.sent_text = text if grown else self.sent_text
        self.sent_tokens = len(self.ids)
        extra = {"logprobs": {"content": entries}} if self.logprobs else {}
        return [self.chunk(delta, **extra)]


class TokenInbox:
    """The tokens the engine's thread hands over between steps, per choice, until the handler takes them.

    At most one wake-up per choice waits in the handler's queue: while it waits, later steps' tokens
    join the same delivery, so a handler (or a client) slower than the engine gets fewer, larger
    chunks instead of a backlog of one chunk per step, and the engine's thread schedules at most one
    callback per choice between two of the handler's turns."""

    def __init__(self, n: int, loop, events: asyncio.Queue):
        self.loop, self.events = loop, events
        self.lock = threading.Lock()
        self.sent = [0] * n  # tokens of each choice handed over so far
        self.ids: list[list[int]] = [[] for _ in range(n)]  # handed over, not yet taken
        self.lps: list[list[float]] = [[] for _ in range(n)]
        self.waiting = [False] * n  # a wake-up for the choice is in the handler's queue

    def pusher(self, j: int):
        def push(ids: list[int], lps: list[float]) -> None:  # the engine's thread, between steps
            with self.lock:
                if len(ids) <= self.sent[j]:
                    return
                self.ids[j] += ids[self.sent[j]:]
                self.lps[j] += lps[self.sent[j]:len(ids)]
                self.sent[j] = len(ids)
                wake, self.waiting[j] = not self.waiting[j], True
            if wake:
                self.loop.call_soon_threadsafe(self.events.put_nowait, (j, False))
        return push

    def take(self, j: int) -> tuple[list[int], list[float]]:
        """The choice's tokens handed over since the last take (the handler's loop)."""
        with self.lock:
            ids, lps, self.ids[j], self.lps[j], self.waiting[j] = self.ids[j], self.lps[j], [], [], False
        return ids, lps


async def stream_chat(request: web.Request, state, session, prompt, call, max_tokens: int, head: dict):
    """Samples ``call``'s choices and streams them; records them in ``session`` at the end."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    loop, events = asyncio.get_running_loop(), asyncio.Queue()
    inbox = TokenInbox(call.n, loop, events)
    with session.lock:
        seeds = [session.next_seed(j) for j in range(call.n)]
    futures = state.queue.submit(prompt.ids, seeds, max_tokens, [inbox.pusher(j) for j in range(call.n)])
    for j, f in enumerate(futures):
        f.add_done_callback(lambda _f, j=j: loop.call_soon_threadsafe(events.put_nowait, (j, True)))
    choices = [ChoiceStream(state, j, head, call.stop, call.logprobs) for j in range(call.n)]

    async def send(chunk: dict) -> None:
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())

    for c in choices:
        await send(c.opening())
    results: list[GenerationResult | None] = [None] * call.n
    while any(r is None for r in results):
        j, done = await events.get()
        if not done:
            for chunk in choices[j].extend(*inbox.take(j)):
                await send(chunk)
            continue
        try:
            results[j] = cut_at_stop(futures[j].result(), call.stop, state.decode)
        except Exception as e:  # noqa: BLE001 - the headers are sent: the error goes out as an event
            await send({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}})
            await response.write_eof()
            return response
        for chunk in choices[j].finish(results[j]):
            await send(chunk)
    session.record(prompt, results, call.messages)
    sampled = sum(len(r.response_ids) for r in results)
    usage = {"prompt_tokens": len(prompt.ids), "completion_tokens": sampled, "total_tokens": len(prompt.ids) + sampled}
    await send(head | {"choices": [], "usage": usage})
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response
