"""Overlapped tool calls (``overlap_tools``) give the turn-by-turn loop's samples, and save its tool waits.

A random tiny Llama with the BPE test tokenizer of ``test_rollout_agent.py``,
sampled at temperature 1: the tool-call end is the token it samples most
often, so turns are a few to tens of tokens long and most samples call a tool
in every turn until ``max_turns`` (5), the budget or EOS. Every call goes to
``sleepy``, a real :class:`~megarl.tools.Tool` in the real
:class:`~megarl.tools.ToolExecutor`, whose result is a function of the turn's
text and whose latency is either a jitter of 0-30 ms from the text (replies
land out of order) or a table.

Equality (TP1, TP2, PP2): per sample the response ids, loss mask, finish
reason, turn and call counts and the conversation are exactly those of the
turn-by-turn reference, and the log-probs equal to 1e-5, with n = 2 (forked
first turns), 64-token prefill chunks and a KV pool too small for every
sequence (the overlapped runs preempt). Why: a sample's turn k has the same
prompt (its ids so far) and seed under either schedule, and the engine's
tokens depend on those and the weights only. Log-probs are not bitwise equal:
the schedules run a sample in batches of other sizes, and a GEMM's rows are
not batch-invariant in their last bits (CPU MKL, fp32: rows of an M < 4
product differ from the same rows at M >= 4 by up to ~7e-6 on a 64 -> 128
linear; seen here: <= 4e-6, as between the engine and training). On TP1 also through the
graph path's buffers run eagerly with decode steps planned ahead (follow-ups
must wait for the pending step to be recorded), and with the prefix cache (the
later turns take cached pages). On TP2 only TP rank 0 runs tools, and both
ranks build identical samples; on PP2 the same with stage 0's TP rank 0.

Wall time (TP1): a first run without delays gives each sample's turn texts
(latencies do not change them); then, per tool round, one call not yet slow
sleeps 0.3 s. Turn by turn every round waits for its slow call (>= rounds x
0.3 s of idle engine); overlapped each sample meets at most one slow call
while the others decode, so its engine must idle less by a margin of half of
(rounds - 1) x 0.3 s, and its wall time be shorter. (The margin is checked on
the idle time: the decode time around it stretches with whatever else the CI
machine runs, and a wall-time margin failed under two busy pytest workers.)

A simulated user (a function of the conversation) answering turns without a
call gives equal samples too. Overlap with SGLang is a config error.

Not covered: CUDA graph capture (the GPU tests), TP x PP together.
"""
import time

import pytest
import torch

from dist_helpers import spawn, worker_actor
from megarl.models.tiny import make_tiny_checkpoint
from test_rollout_agent import make_tokenizer

MAX_NEW, MAX_TURNS, PAGE, SLOW_S = 160, 5, 8, 0.3
POOL_PAGES = 26  # of 8 tokens: one whole conversation (<= 185 tokens) and a few more, not all eight
PROMPTS = ["<s>user:mul 6 7</s><s>assistant:", "<s>user:ab</s><s>assistant:",
           "<s>user:what is 12*34</s><s>assistant:", "<s>user:x</s><s>assistant:"]


def _sleepy(delays: dict | None):
    from megarl.tools import Tool

    def fn(text: str) -> str:
        time.sleep(delays.get(text, 0.0) if delays is not None else 0.002 * (sum(map(ord, text)) % 16))
        return str(sum(map(ord, text)) % 997)

    schema = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
    return Tool("sleepy", "sleeps, then returns a number of the text", schema, fn)


def _parse(text: str):
    from megarl.tools import ToolCall

    return [ToolCall("sleepy", {"text": text})], []


class _NoTools:
    def submit(self, calls):
        raise AssertionError("tools ran on a rank other than the replica's first")

    run = submit


def _engine(actor, groups, tok, pages: int, **options):
    from megarl.rollout.native import EngineOptions, NativeEngine
    from megarl.rollout.pages import KVLayout

    cfg = actor.module.config
    layout = KVLayout(len(actor.module.decoder.layers), cfg.num_query_groups // groups.tp_size, cfg.kv_channels,
                      PAGE, cfg.params_dtype)
    o = EngineOptions(max_batch=8, page_size=PAGE, max_num_batched_tokens=64,
                      kv_cache_gb=pages * layout.page_bytes() / 2**30, **options)
    return NativeEngine(actor.module, groups, actor.info.vocab_size, [tok.eos_token_id], 0, o)


def _user(messages: list[dict]) -> str | None:
    """A simulated user that is a function of the conversation (as both schedules need)."""
    return "go on" if len(messages) < 6 else None


def _generate(actor, groups, tok, end_id, overlap: bool, delays=None, pages=POOL_PAGES, graphs=False,
              interaction=None, **options):
    from megarl.rollout.agent import AgentLoop, AgentOptions
    from megarl.rollout.engine import SamplingParams, sample_requests
    from megarl.rollout.graphs import DecodeGraphs
    from megarl.rollout.prefill_graphs import PrefillGraphs
    from megarl.tools import ToolExecutor

    engine = _engine(actor, groups, tok, pages, **options)
    if graphs:  # the CUDA-graph path's buffers, eagerly: decode steps planned ahead, prefills padded
        engine.graphs = DecodeGraphs(engine, 8, capture=False)
        engine.prefill_graphs = PrefillGraphs(engine, engine.graphs, capture=False)
    first = groups.tp_rank == 0 and groups.pp_rank == 0
    executor = ToolExecutor({"sleepy": _sleepy(delays)}, max_workers=8) if first else _NoTools()
    loop = AgentLoop(engine, tok, executor, _parse, AgentOptions(end_id, MAX_TURNS, 64, overlap_tools=overlap),
                     groups, interaction)
    start = time.perf_counter()
    results = loop.generate(sample_requests([tok.encode(p) for p in PROMPTS], 2, 11, MAX_NEW), SamplingParams())
    wall = time.perf_counter() - start
    if first:
        executor.close()
    samples = [(r.response_ids, r.loss_mask, r.logprobs, r.finish_reason, r.extra["turns"], r.extra["tool_calls"],
                r.extra["trajectory"]) for r in results]
    return {"samples": samples, "wall": wall, "stats": dict(loop.stats)}


def _slow_table(samples) -> dict:
    """Per tool round one call of a sample with no slow call yet: its turn text -> SLOW_S. Only texts
    that no other call has (short turns repeat) are picked, so a slow text is one sample's one call."""
    calls = [[m["content"] for m, nxt in zip(s[6], s[6][1:]) if m["role"] == "assistant" and nxt["role"] == "tool"]
             for s in samples]
    texts = [text for c in calls for text in c]
    table, slow = {}, set()
    for k in range(max(len(c) for c in calls)):
        pick = next((i for i, c in enumerate(calls) if len(c) > k and i not in slow and texts.count(c[k]) == 1),
                    None)
        if pick is not None:
            slow.add(pick)
            table[calls[pick][k]] = SLOW_S
    return table


def _run(rank, ckpt, end_id, tp, pp, timing):


    actor, groups = worker_actor(ckpt, tp, pp)
    tok = make_tokenizer()
    run = lambda overlap, **kw: _generate(actor, groups, tok, end_id, overlap, **kw)  # noqa: E731
    out = {"sync": run(False), "overlap": run(True)}
    if timing:
        out["ahead"] = run(True, graphs=True)
        out["instant"] = run(True, delays={})  # tools that return at once
        out["prefix"] = run(True, prefix_cache=True, pages=400)
        out["sync_user"], out["overlap_user"] = run(False, interaction=_user), run(True, interaction=_user)
        table = _slow_table(run(False, delays={}, pages=400)["samples"])
        out["rounds"] = len(table)
        out["sync_slow"] = run(False, delays=table, pages=400)
        out["overlap_slow"] = run(True, delays=table, pages=400)
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tok = make_tokenizer()
    path = tmp_path_factory.mktemp("llama")
    hf = make_tiny_checkpoint(str(path), "LlamaForCausalLM", seed=3, vocab_size=len(tok), max_position_embeddings=256)
    with torch.no_grad():  # sharper next-token distributions: some tokens common, EOS rare
        hf.model.norm.weight.mul_(3.0)
    hf.save_pretrained(str(path))
    gen, counts = torch.Generator().manual_seed(0), torch.zeros(len(tok))
    for prompt in PROMPTS:  # the token sampled most often ends tool calls
        ids = torch.tensor([tok.encode(prompt)] * 4)
        with torch.no_grad():
            for _ in range(32):
                nxt = torch.multinomial(torch.softmax(hf(ids).logits[:, -1], -1), 1, generator=gen)
                counts += torch.bincount(nxt.flatten(), minlength=len(tok))
                ids = torch.cat([ids, nxt], 1)
    counts[[tok.eos_token_id, 0]] = 0
    return str(path), int(counts.argmax())


@pytest.fixture(scope="module")
def tp1(model):
    (r,) = spawn(_run, 1, *model, 1, 1, True)
    return r


def _assert_same(a, b):
    """Ids, masks, finish, counts, conversations exactly; log-probs to fp32 rounding (see the docstring)."""
    assert len(a["samples"]) == len(b["samples"]) == 2 * len(PROMPTS)
    for (*x, x_logprobs), (*y, y_logprobs) in zip(_logprobs_last(a), _logprobs_last(b)):
        assert x == y
        assert torch.allclose(torch.tensor(x_logprobs), torch.tensor(y_logprobs), rtol=0, atol=1e-5)


def _logprobs_last(run):
    return [(ids, mask, finish, turns, calls, conversation, logprobs)
            for ids, mask, logprobs, finish, turns, calls, conversation in run["samples"]]


def test_overlapped_samples_equal_turn_by_turn_tp1(tp1):
    sync, overlap = tp1["sync"], tp1["overlap"]
    _assert_same(sync, overlap)
    _assert_same(sync, tp1["ahead"])
    _assert_same(sync, tp1["prefix"])
    turns = [s[4] for s in sync["samples"]]
    calls = [s[5] for s in sync["samples"]]
    assert max(turns) == MAX_TURNS and sum(c >= 2 for c in calls) >= 3  # several samples go many rounds
    assert {s[3] for s in sync["samples"]} >= {"max_turns"}
    _assert_same(sync, tp1["instant"])
    # The pool cannot hold every conversation, so the overlapped schedules preempt; how often depends on
    # when the tools return (2-5 times per run here; once, on a loaded CI machine, not in `overlap`).
    assert sum(tp1[k]["stats"]["rollout/preemptions"] for k in ("overlap", "ahead", "instant", "overlap_user")) > 0
    assert tp1["ahead"]["stats"]["rollout/planned_ahead_steps"] > 0
    assert tp1["prefix"]["stats"]["rollout/prefix_cached_tokens"] > 0
    assert overlap["stats"]["agent/overlap_tools"] == 1.0 and sync["stats"]["agent/overlap_tools"] == 0.0
    _assert_same(tp1["sync_user"], tp1["overlap_user"])  # a simulated user answers turns without a call
    assert any(m["role"] == "user" for s in tp1["overlap_user"]["samples"] for m in s[6])


def test_overlap_needs_an_engine_that_serves():
    from megarl.errors import ConfigError
    from megarl.config import Config
    from megarl.config_checks import check_multi_turn
    from megarl.rollout.agent import AgentLoop, AgentOptions
    from test_rollout_agent import Executor, ScriptedEngine, parse

    cfg = Config()
    cfg.rollout.multi_turn.enable, cfg.rollout.engine = True, "sglang"
    with pytest.raises(ConfigError, match=r"^rollout.multi_turn.overlap_tools=true needs rollout.engine=native"):
        check_multi_turn(cfg)
    cfg.rollout.multi_turn.overlap_tools = False
    check_multi_turn(cfg)
    tok = make_tokenizer()
    with pytest.raises(ValueError, match="overlap_tools needs an engine"):
        AgentLoop(ScriptedEngine(tok), tok, Executor(), parse, AgentOptions(1, overlap_tools=True))


def test_overlap_hides_slow_tools(tp1):
    rounds, sync, overlap = tp1["rounds"], tp1["sync_slow"], tp1["overlap_slow"]
    print(f"\nslow rounds {rounds}: turn by turn {sync['wall']:.2f} s (tool wait "
          f"{sync['stats']['timing/agent_tool_wait']:.2f} s), overlapped {overlap['wall']:.2f} s (idle "
          f"{overlap['stats']['timing/agent_tool_wait']:.2f} s)")
    _assert_same(sync, overlap)
    assert rounds >= 3
    idle_sync, idle_overlap = sync["stats"]["timing/agent_tool_wait"], overlap["stats"]["timing/agent_tool_wait"]
    assert idle_sync >= 0.95 * rounds * SLOW_S
    assert idle_overlap < idle_sync - 0.5 * (rounds - 1) * SLOW_S
    assert overlap["wall"] < sync["wall"]


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_overlapped_samples_equal_turn_by_turn_tp2_pp2(model, tp, pp):
    a, b = spawn(_run, 2, *model, tp, pp, False)
    _assert_same(a["sync"], a["overlap"])
    _assert_same(a["sync"], b["sync"])
    _assert_same(a["overlap"], b["overlap"])
    # preemption is forced and asserted at TP1 (test above); here whether the overlapped schedule
    # preempts depends on when the tools return (it did not in one CI run), so it is not asserted
