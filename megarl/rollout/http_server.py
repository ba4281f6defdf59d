"""An OpenAI-compatible HTTP endpoint on the rollout engine (``rollout.server``).

Routes, each also under a per-sample base URL ``/samples/<id>/v1`` (the id an
agent is given): ``POST /v1/chat/completions``, ``POST /v1/completions``,
``GET /v1/models``. On the plain ``/v1`` routes the sample is the request's
``user`` field or its ``X-Megarl-Sample`` header.

HTTP stack: aiohttp. One package (no ASGI server + framework pair), its server
runs on an event loop in a thread of the trainer's process with no signal
handlers to install, answers Server-Sent Events through a plain
``StreamResponse``, binds port 0 and reports the port it got — all the endpoint
needs, and it is maintained by aio-libs with frequent releases.

A call becomes engine requests (:class:`~megarl.rollout.engine.Request`, one per
choice ``n``) through :class:`EngineQueue`; the engine's loop drains the queue
between steps, so calls arriving while a step runs join the next one
(continuous batching), and resolves each request's future when it finishes.
Sampling (temperature, top-p) is the rollout's: a call may restate the
rollout's temperature but not change it (one ``serve`` call samples with one
setting, and the trainer needs the log-probs under it). ``stop`` strings cut the
response at the token that completes them (the ids kept are the ids trained).
Streaming sends SSE chunks as the engine records tokens, between its steps
(``http_stream.py``). Bad requests get OpenAI-shaped errors (``{"error": {message, type,
param, code}}``, 400/404) and nothing else happens.
"""
from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable

from aiohttp import web

from megarl.rollout.engine import GenerationResult, Request
from megarl.rollout.http_openai import ApiError, chat_body, completion_body, cut_at_stop, parse_chat
from megarl.rollout.http_sessions import SampleSession
from megarl.rollout.http_stream import stream_chat


class EngineQueue:
    """Thread-safe: HTTP handlers put requests in, the engine's loop takes them out and finishes them."""

    def __init__(self):
        self.waiting: queue.Queue[tuple[Request, Future]] = queue.Queue()
        self.running: dict[int, Future] = {}
        self.streamed: dict[int, Callable] = {}  # key -> on_tokens(ids, logprobs) of a streamed request
        self._next_key = 0
        self._lock = threading.Lock()

    def submit(self, prompt: list[int], seeds: list[int], max_tokens: int,
               streams: list[Callable] | None = None) -> list[Future]:
        """One request per seed; ``streams``: per request an ``on_tokens(ids, logprobs)`` the engine's
        thread calls between steps with the tokens so far (:meth:`progress`)."""
        futures = []
        with self._lock:
            for j, seed in enumerate(seeds):
                future: Future = Future()
                if streams is not None:
                    self.streamed[self._next_key] = streams[j]
                self.waiting.put((Request(self._next_key, list(prompt), seed, max_tokens), future))
                self._next_key += 1
                futures.append(future)
        return futures

    def take(self, wait_s: float) -> list[Request]:
        """What is waiting; blocks up to ``wait_s`` for a first one."""
        out = []
        try:
            item = self.waiting.get(timeout=wait_s) if wait_s > 0 else self.waiting.get_nowait()
            while True:
                req, future = item
                self.running[req.key] = future
                out.append(req)
                item = self.waiting.get_nowait()
        except queue.Empty:
            return out

    def progress(self, key: int, ids: list[int], logprobs: list[float]) -> None:
        on_tokens = self.streamed.get(key)
        if on_tokens is not None:
            on_tokens(ids, logprobs)

    def finished(self, key: int, result: GenerationResult) -> None:
        self.streamed.pop(key, None)
        self.running.pop(key).set_result(result)

    def fail_waiting(self, message: str) -> None:
        """Calls that arrived after the engine stopped serving."""
        for _req, future in self.take(0):
            future.set_exception(ApiError(503, message, "server_error"))
        self.running.clear()
        self.streamed.clear()


class ServerState:
    """What the handlers read: the sessions of the running rollout, the engine's queue, the limits."""

    def __init__(self, tokenizer, renderer, parser, model_name: str, eos_ids: list[int]):
        self.tokenizer, self.renderer, self.parser = tokenizer, renderer, parser
        self.model_name, self.eos_ids = model_name, list(eos_ids)
        self.sessions: dict[str, SampleSession] = {}
        self.queue = EngineQueue()
        self.longest = 0  # prompt + max_tokens the engine is sized for in this rollout
        self.temperature = 1.0
        self.bad_requests = 0

    def session(self, request: web.Request, body: dict) -> SampleSession:
        sid = request.match_info.get("sid") or request.headers.get("X-Megarl-Sample") or body.get("user")
        if sid is None:
            raise ApiError(400, "no sample id: use the base URL /samples/<id>/v1, the 'user' field or the "
                                "X-Megarl-Sample header", param="user")
        s = self.sessions.get(str(sid))
        if s is None or s.closed:
            raise ApiError(404, f"sample {sid!r} is not part of the running rollout", code="sample_not_found")
        return s

    def render_root(self, messages: list[dict], tools) -> list[int]:
        kwargs = {"tools": tools} if tools else {}
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


async def _body(request: web.Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
        raise ApiError(400, "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _limits(state: ServerState, session: SampleSession, prompt, max_tokens: int | None) -> int:
    """The call's max_tokens, checked against the sample's budget and the engine's context."""
    left = session.budget_left(prompt)
    room = state.longest - len(prompt.ids)
    if room < 1 or left < 1:
        raise ApiError(400, f"the prompt is {len(prompt.ids)} tokens and the sample has {max(left, 0)} response "
                            f"tokens left; the context is {state.longest} tokens", param="messages",
                       code="context_length_exceeded")
    if max_tokens is None:
        return min(left, room)
    if max_tokens > min(left, room):
        raise ApiError(400, f"max_tokens={max_tokens} is more than the {min(left, room)} tokens this sample has "
                            "left", param="max_tokens", code="context_length_exceeded")
    return max_tokens


async def _sample(state: ServerState, session: SampleSession, prompt, n: int, max_tokens: int,
                  stop: list[str]) -> list[GenerationResult]:
    with session.lock:
        seeds = [session.next_seed(j) for j in range(n)]
    futures = state.queue.submit(prompt.ids, seeds, max_tokens)
    results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
    return [cut_at_stop(r, stop, state.decode) for r in results]


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state: ServerState = request.app["state"]
    body = await _body(request)
    call = parse_chat(body, state.model_name, state.temperature)
    session = state.session(request, body)
    prompt = session.chat_prompt(call.messages, state.renderer, lambda m: state.render_root(m, call.tools))
    max_tokens = _limits(state, session, prompt, call.max_tokens)
    created, rid = int(time.time()), f"chatcmpl-{session.key}-{session.calls}"
    if call.stream:
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_name}
        return await stream_chat(request, state, session, prompt, call, max_tokens, head)
    results = await _sample(state, session, prompt, call.n, max_tokens, call.stop)
    session.record(prompt, results, call.messages)
    return web.json_response(chat_body(state, results, len(prompt.ids), call.logprobs, rid, created))


async def completions(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    body = await _body(request)
    call = parse_chat(body, state.model_name, state.temperature, completion=True)
    if call.stream:
        raise ApiError(400, "stream=true is served on /chat/completions only", param="stream")
    session = state.session(request, body)
    prompt_ids = call.prompt if isinstance(call.prompt, list) else \
        state.tokenizer.encode(call.prompt, add_special_tokens=False)
    prompt = session.token_prompt(prompt_ids)
    max_tokens = _limits(state, session, prompt, call.max_tokens)
    results = await _sample(state, session, prompt, call.n, max_tokens, call.stop)
    session.record(prompt, results, [])
    payload = completion_body(state, results, len(prompt.ids), call.logprobs, f"cmpl-{session.key}-{session.calls}",
                              int(time.time()))
    return web.json_response(payload)


async def models(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    return web.json_response({"object": "list", "data": [{"id": state.model_name, "object": "model",
                                                          "owned_by": "megarl", "created": 0}]})


@web.middleware
async def openai_errors(request: web.Request, handler):
    try:
        return await handler(request)
    except ApiError as e:
        request.app["state"].bad_requests += 1
        return web.json_response(e.body(), status=e.status)


def build_app(state: ServerState) -> web.Application:
    app = web.Application(middlewares=[openai_errors])
    app["state"] = state
    for base in ("/v1", "/samples/{sid}/v1"):
        app.router.add_post(f"{base}/chat/completions", chat_completions)
        app.router.add_post(f"{base}/completions", completions)
        app.router.add_get(f"{base}/models", models)
    return app


class HttpServer:
    """The app on its own event loop thread; ``port`` is the one bound (``port=0``: a free one)."""

    def __init__(self, state: ServerState, host: str, port: int):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="megarl-http", daemon=True)
        self.thread.start()
        self.runner = web.AppRunner(build_app(state), access_log=None)
        self._call(self.runner.setup())
        self._call(web.TCPSite(self.runner, host, port).start())
        self.host, self.port = self.runner.addresses[0][:2]

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def close(self) -> None:
        self._call(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
