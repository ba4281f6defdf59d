"""The OpenAI endpoint against the engine: concurrent chat sessions through HTTP vs the same requests direct.

    python benchmarks/bench_server.py                      # CUDA: qwen2.5-1.5b shape, 128 sessions, 64 + 256 tokens
    python benchmarks/bench_server.py --tiny --out /tmp/server.json   # CPU smoke run (tiny-llama shape)

One process (no torchrun). A random-weight checkpoint of the shape (benchmarks/make_checkpoint.py: a
word-level tokenizer, so a prompt of ``--prompt-len`` tokens is exact) and one native engine with no
stop ids (ignore_eos: every response is ``--new-tokens`` long), CUDA graphs on CUDA. Each of
``--sessions`` samples is one user message whose chat template gives ``--prompt-len`` tokens; per
repeat, timed by wall clock:

* direct: the samples' requests in one ``engine.generate`` (their ids, seeds and length limits);
* http: the same samples through ``rollout.server``'s path (``HttpAgentRollout``): an agent per sample,
  all at once, each calling ``/samples/<id>/v1/chat/completions`` with the official ``openai`` client
  (``AsyncOpenAI`` on one event loop, a connection per session) and ``max_tokens`` = ``--new-tokens``;
  the server tokenizes the messages, queues the calls into the running batch and records the
  sessions; ``--stream`` adds a streamed run (SSE chunks every engine step), its agents in the
  worker processes when ``--agent-processes`` is given (one client loop parsing every session's
  chunks would bound it);
* http_processes (``--agent-processes N``): the http run with the agents in N worker processes
  (``rollout.server.agent_processes``), each with its own client loop, so the clients' Python work
  does not share the engine's interpreter lock.

tokens/s = sessions x new tokens / seconds (prefill included), the median over ``--repeats``, after a
warm-up of both paths (and every CUDA-graph batch size). A sample's tokens depend on its prompt and
seed only, so in exact arithmetic the HTTP responses equal the direct ones (``same_tokens``, and per
path ``paths.<name>.same``: the fraction equal and the median first differing position). In bf16
the calls arriving over time decode in other batch compositions, whose rounding can flip a sampled
token; ``paths.direct_split`` measures that alone (the direct requests in two calls of half the
batch). Per path also the engine's step counters of its last repeat and when its first and last
call reached the engine. Writes ``{"direct_tokens_per_s", "http_tokens_per_s", "sessions",
"workload", ...}`` to ``--out``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from functools import partial

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_rollout import build_model, capture_buckets, start_distributed, timed  # noqa: E402

MODEL = "megarl-policy"


class ClientLoop:
    """``AsyncOpenAI`` on its own event loop thread; the agents (threads of the rollout's pool) hand it
    their calls, so every session's HTTP runs on one loop as an asyncio client's would."""

    def __init__(self, sessions: int):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="bench-client", daemon=True).start()
        self.client = self.run(self._make(sessions))

    @staticmethod
    async def _make(sessions: int):
        from openai import AsyncOpenAI, DefaultAsyncHttpxClient
        try:  # the HTTP stack openai's client is built on (httpx2 from openai 3.x, httpx before)
            import httpx2 as httpx
        except ImportError:
            import httpx

        limits = httpx.Limits(max_connections=2 * sessions, max_keepalive_connections=2 * sessions)
        return AsyncOpenAI(base_url="http://127.0.0.1/v1", api_key="local", max_retries=0, timeout=3600,
                           http_client=DefaultAsyncHttpxClient(limits=limits))

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()


async def _chat(client, messages: list[dict], max_tokens: int, stream: bool) -> dict:
    if not stream:
        reply = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens)
        return {"tokens": reply.usage.completion_tokens}
    chunks = 0
    async for chunk in await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                                            stream=True):
        chunks += bool(chunk.choices and chunk.choices[0].delta.content)
    return {"chunks": chunks}


_CLIENTS: ClientLoop | None = None  # this process's client loop (the bench's, or an agent worker process's)
_CLIENTS_LOCK = threading.Lock()  # the agents' threads make it once


def chat_agent(sessions: int, max_tokens: int, stream: bool, sample: dict, base_url: str) -> dict:
    """One session: one chat call of ``max_tokens`` tokens on the sample's base URL, through this
    process's ``AsyncOpenAI`` (made at its first call: the bench's, or an agent process's own)."""
    global _CLIENTS
    with _CLIENTS_LOCK:
        if _CLIENTS is None:
            _CLIENTS = ClientLoop(sessions)
    return _CLIENTS.run(_chat(_CLIENTS.client.with_options(base_url=base_url), sample["messages"], max_tokens,
                              stream))


def make_prompts(tok, n: int, length: int, vocab: int) -> list[list[dict]]:
    """``n`` single-message conversations whose chat template gives exactly ``length`` tokens."""
    def ids(messages):
        return tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False)

    overhead = len(ids([{"role": "user", "content": "w0"}])) - 1
    g = torch.Generator().manual_seed(0)
    words = torch.randint(0, vocab - 8, (n, length - overhead), generator=g).tolist()
    conversations = [[{"role": "user", "content": " ".join(f"w{w}" for w in row)}] for row in words]
    assert all(len(ids(c)) == length for c in conversations), "the chat template does not give --prompt-len tokens"
    return conversations


def checkpoint(shape: str, work: str) -> str:
    out = os.path.join(work, shape)
    if not os.path.isfile(os.path.join(out, "config.json")):
        subprocess.run([sys.executable, "benchmarks/make_checkpoint.py", "--shape", shape, "--out", out,
                        "--prompts", "1"], cwd=ROOT, check=True)
    return out


def build(args):
    """(engine, HTTP rollouts by agent_processes (0: threads; --agent-processes), tokenizer, vocab size)."""
    from megarl.data.tokenizer import load_tokenizer
    from megarl.rollout.http_agents import HttpAgentRollout
    from megarl.rollout.native import EngineOptions, NativeEngine
    from megarl.tools import parse_hermes

    path = checkpoint(args.shape, args.work)
    module, info, groups = build_model(path, args)
    longest = args.prompt_len + args.new_tokens
    options = EngineOptions(max_batch=args.sessions, cuda_graphs=not args.eager, max_model_len=longest,
                            prefix_cache=False, kv_cache_gb=args.kv_cache_gb)
    engine = NativeEngine(module, groups, info.vocab_size, [], 0, options)  # no stop ids: fixed lengths
    tok = load_tokenizer(path)
    http = {n: HttpAgentRollout(engine, tok, None, parse_hermes, [tok.eos_token_id], 0, host="127.0.0.1", port=0,
                                workers=args.sessions, timeout_s=3600, model_name=MODEL, max_len=longest,
                                stop_ids=[], agent_processes=n)
            for n in sorted({0, args.agent_processes})}
    return engine, http, tok, info.vocab_size


class Arrivals:
    """When each call of an HTTP run reached the engine's queue, in seconds from the run's start."""

    def __init__(self, queue):
        self.start, self.times = time.perf_counter(), []
        submit = queue.submit

        def timed_submit(*args, **kwargs):
            self.times.append(time.perf_counter() - self.start)
            return submit(*args, **kwargs)
        queue.submit = timed_submit

    def begin(self) -> None:
        self.start, self.times = time.perf_counter(), []

    def summary(self) -> dict:
        return {"first_s": min(self.times), "last_s": max(self.times)} if self.times else {}


def run_http(http, conversations, requests, params, max_tokens: int, stream: bool):
    http.agent = partial(chat_agent, len(requests), max_tokens, stream)
    http.bind_items({r.key: {"messages": c} for r, c in zip(requests, conversations)})
    http.arrivals.begin()
    return http.generate(requests, params)


def sameness(results, direct: dict) -> dict:
    """How many of a path's responses equal the direct run's, and where the others first differ."""
    firsts = []
    for r in results:
        ids, ref = list(r.response_ids), direct[r.key]
        if ids != ref or r.extra.get("agent_failed"):
            firsts.append(next((i for i, (a, b) in enumerate(zip(ids, ref)) if a != b), min(len(ids), len(ref))))
    return {"equal_frac": 1 - len(firsts) / len(results),
            "first_difference_median": statistics.median(firsts) if firsts else None}


def split_direct(engine, requests, params) -> list:
    """The direct requests in two generate calls of half the batch each: the same samples in other
    batch compositions, which in bf16 change the logits' rounding (so, rarely, a sampled token)."""
    half = len(requests) // 2
    return engine.generate(requests[:half], params) + engine.generate(requests[half:], params)


def measure(args) -> dict:
    from megarl.rollout.engine import SamplingParams, sample_requests

    engine, http, tok, vocab = build(args)
    conversations = make_prompts(tok, args.sessions, args.prompt_len, vocab)
    prompts = [tok.encode(tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False) for c in conversations]
    params = SamplingParams(temperature=1.0)
    requests = sample_requests(prompts, 1, 1, args.new_tokens)
    capture_buckets(engine, prompts)
    engine.generate(sample_requests(prompts, 1, 0, 4), params)  # warm-up of both paths
    for rollout in http.values():  # (starts the agent processes)
        rollout.arrivals = Arrivals(rollout.state.queue)
        run_http(rollout, conversations, sample_requests(prompts, 1, 0, 4), params, 4, args.stream)
    streamer = http[args.agent_processes]  # streamed chunks are parsed by the agents' clients: in their processes
    paths = {"direct": (None, lambda: engine.generate(requests, params)),
             "http": (http[0], lambda: run_http(http[0], conversations, requests, params, args.new_tokens, False))}
    if args.agent_processes:
        paths["http_processes"] = (http[args.agent_processes], lambda: run_http(
            http[args.agent_processes], conversations, requests, params, args.new_tokens, False))
    if args.stream:
        paths["http_stream"] = (streamer, lambda: run_http(streamer, conversations, requests, params,
                                                           args.new_tokens, True))
    seconds, out, details = {name: [] for name in paths}, {}, {}
    for _ in range(args.repeats):
        for name, (rollout, fn) in paths.items():
            seconds[name].append(timed(lambda: out.__setitem__(name, fn())))  # noqa: B023 - called at once
            details[name] = {"engine": dict(engine.stats),
                             "arrivals": rollout.arrivals.summary() if rollout is not None else {}}
    for rollout in http.values():
        rollout.close()
    direct = {r.key: r.response_ids for r in out["direct"]}
    assert all(len(ids) == args.new_tokens for ids in direct.values()), "a direct response stopped early"
    for name in paths:
        if name != "direct":
            details[name]["same"] = sameness(out[name], direct)
    details["direct_split"] = {"same": sameness(split_direct(engine, requests, params), direct)}
    same = all(details[name]["same"]["equal_frac"] == 1.0 for name in paths if name != "direct")
    tokens = args.sessions * args.new_tokens
    rates = {k: tokens / statistics.median(v) for k, v in seconds.items()}
    return {"rates": rates, "seconds": seconds, "same_tokens": same, "paths": details,
            "stream_agents": f"{args.agent_processes} processes" if args.agent_processes else "threads"}


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny-llama shape, 8 sessions, 16 new tokens")
    ap.add_argument("--shape", default=None, help="a benchmarks/make_checkpoint.py shape (default qwen2.5-1.5b)")
    ap.add_argument("--sessions", type=int, default=None, help="concurrent chat sessions (default 128)")
    ap.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per session (chat template included)")
    ap.add_argument("--new-tokens", type=int, default=None, help="sampled tokens per session (default 256)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each path (the median is reported)")
    ap.add_argument("--stream", action="store_true", help="also time the sessions with stream=true")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--agent-processes", type=int, default=0,
                    help="also time the sessions with the agents in this many worker processes "
                         "(rollout.server.agent_processes; the plain http run keeps them on threads)")
    ap.add_argument("--kv-cache-gb", type=float, default=0.0, help="KV cache (0: rollout.kv_cache_fraction)")
    ap.add_argument("--work", default="/tmp/megarl_bench", help="where the random checkpoint is written")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks/results/server.json"))
    args = ap.parse_args()
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.shape = args.shape or ("tiny-llama" if args.tiny else "qwen2.5-1.5b")
    args.sessions = args.sessions or (8 if args.tiny else 128)
    args.new_tokens = args.new_tokens or (16 if args.tiny else 256)
    args.dtype = "float32" if args.tiny or args.device == "cpu" else "bfloat16"
    args.eager = args.eager or args.device == "cpu"
    args.kv_cache_gb = args.kv_cache_gb or (0.05 if args.tiny else 0.0)
    return args


def main() -> None:
    args = parse()
    start_distributed()
    got = measure(args)
    rates = got["rates"]
    result = {
        "direct_tokens_per_s": rates["direct"], "http_tokens_per_s": rates["http"], "sessions": args.sessions,
        "workload": {"shape": args.shape, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                     "temperature": 1.0, "repeats": args.repeats, "client": "openai.AsyncOpenAI",
                     "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"},
        "http_over_direct": rates["http"] / rates["direct"], "same_tokens": got["same_tokens"],
        "seconds": got["seconds"], "paths": got["paths"],
    }
    if "http_stream" in rates:
        result["http_stream_tokens_per_s"] = rates["http_stream"]
        result["workload"]["stream_agents"] = got["stream_agents"]
    if "http_processes" in rates:
        result["http_processes_tokens_per_s"] = rates["http_processes"]
        result["http_processes_over_direct"] = rates["http_processes"] / rates["direct"]
        result["workload"]["agent_processes"] = args.agent_processes
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{args.sessions} sessions, {args.prompt_len} + {args.new_tokens} tokens ({args.shape}, {args.device}): "
          f"direct {rates['direct']:.0f} tokens/s, http {rates['http']:.0f} tokens/s "
          f"({100 * result['http_over_direct']:.1f}%)"
          + (f", agents in {args.agent_processes} processes {rates['http_processes']:.0f} tokens/s "
             f"({100 * result['http_processes_over_direct']:.1f}%)" if "http_processes" in rates else "")
          + (f", streamed {rates['http_stream']:.0f} tokens/s"
                                                           if "http_stream" in rates else "")
          + f"; same tokens: {got['same_tokens']} (equal responses: "
          + ", ".join(f"{k} {v['same']['equal_frac']:.2f}" for k, v in got["paths"].items() if "same" in v) + ")")


if __name__ == "__main__":
    main()
