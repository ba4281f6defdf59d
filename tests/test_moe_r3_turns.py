"""Rollout routing replay over multi-turn tool episodes, HTTP agent episodes and partial rollouts.

One spawned process per case (gloo, CPU, fp32), a tiny Qwen3-MoE (2 layers, 4 experts, top-2) whose
vocabulary is the BPE test tokenizer's (tests/test_rollout_agent.py: a chat template with user,
assistant and tool turns), the native engine recording experts, the actor built with
``actor.router_replay=r3``. What the batch carries (megarl/rollout/expert_record.py): a sampled
token's row from the call that sampled it, the appended context's rows from the next call's prefill.

- Multi-turn (the agent loop, turn by turn and overlapped): the tool-call end is a token the first
  sample draws early, so conversations take several turns with tool context between them. Every
  position but each row's last is recorded; with the rollout's weights the router's own choice (no
  replay) equals the recorded ids at every recorded position and layer (agreement 1.0: ids shifted by
  a position or taken from another row would disagree) and the replayed log-probs equal the engine's
  (1e-5); at unrecorded positions the replayed forward routes as the forward without replay. After
  the routers moved, the replayed forward routes to the recorded experts on every recorded token and
  layer, the router left alone would not (agreement < 1), and unrecorded tokens take the router's own
  top-k.
- HTTP agents: two chat calls per sample over the OpenAI endpoint (a tool message between them), and
  one agent that fails before calling (its row: nothing recorded, all free-routed); the same checks.
- Both, with the engine's prefix cache on too: later calls reuse earlier calls' pages (and the ids of
  the forwards that computed them, megarl/rollout/pages.py PageExperts); the same checks hold.
- Partial rollouts: ``PartialRollouts`` over the engine, the weights changed between steps; in every
  trained batch a response resumed across the update keeps the earlier policy's ids for its prompt
  and earlier tokens and the new policy's for the new ones: the recorded ids of each policy's
  positions are exactly that policy's own routing (agreement 1.0 under its weights) while the other
  policy routes some of them elsewhere; the replayed forward routes to the recorded ids everywhere.
Not covered: EP/PP (tests/test_moe_r3.py covers the layouts; the merge is per stage), bf16.
"""
from __future__ import annotations

import json
import pickle
import urllib.request

import pytest
import torch

from dist_helpers import spawn

EXPERTS = 4


def _actor(ckpt):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.config import Config
    from megarl.distributed import build_parallel_groups, init_distributed
    from megarl.roles.build import build_actor

    init_distributed()
    groups = build_parallel_groups(1, 1)
    model_parallel_cuda_manual_seed(0)
    cfg = Config()
    cfg.model.path = ckpt
    cfg.actor.router_replay = "r3"
    return build_actor(cfg, groups, optimizer_steps=1), groups


def _engine(actor, groups, prefix_cache: bool = False):
    """The engine; with ``prefix_cache`` it counts the tokens it reuses over all its calls in ``reused``."""
    from megarl.rollout.native import EngineOptions, NativeEngine

    options = EngineOptions(max_batch=4, page_size=8, max_num_batched_tokens=64, kv_cache_gb=0.01,
                            record_experts=True, prefix_cache=prefix_cache)
    engine = NativeEngine(actor.module, groups, actor.info.vocab_size, [], 0, options)  # turns end at a stop id
    engine.reused, record = 0, engine._record

    def counting(sched, counters):
        record(sched, counters)
        engine.reused += sched.reused_tokens
    engine._record = counting
    return engine


class Routing:
    """Every router forward: its routing map (tokens, experts), its own top-k (tokens, k) and the loaded
    ids and recorded mask, in the routers' token order, per layer (appended per forward)."""

    def __init__(self, actor):
        self.maps: list = []
        for layer in actor.replay.layers:
            layer.router.register_forward_hook(self._hook)
            original = layer.get_replay_topk

            def wrapped(scores, topk, *args, _original=original, _layer=layer):
                _layer.own = torch.topk(scores, topk, dim=1).indices
                return _original(scores, topk, *args)
            layer.get_replay_topk = wrapped

    def _hook(self, router, _inputs, out):
        replay = router.router_replay
        ids = None if replay.owner.ids is None else replay.owner.ids[:, replay.layer]
        self.maps.append((out[1].clone(), replay.own, ids, replay.owner.valid))

    def take(self) -> list:
        maps, self.maps = self.maps, []
        return maps


def _as_map(ids: torch.Tensor) -> torch.Tensor:
    """(tokens, k) expert ids -> (tokens, experts) bool."""
    return torch.zeros(len(ids), EXPERTS, dtype=torch.bool).scatter(1, ids, True)


def _forwards(actor, batch, routing: Routing) -> dict:
    """The replayed forward and the one without replay of ``batch``: log-probs, agreements, routing."""
    actor.replay.reset()
    routing.take()  # earlier forwards' maps dropped
    replayed = actor.logprobs(batch, 2, 1.0)["logprobs"]
    out = {"replayed": replayed, "agree": actor.replay.read(), "maps": routing.take()}
    with actor.replay.observing():
        out["free"] = actor.logprobs(batch, 2, 1.0)["logprobs"]
    out["own_agree"], out["free_maps"] = actor.replay.read(), routing.take()
    return out


def _routing_facts(replay: dict, same_weights: bool) -> dict:
    """Counts over every router forward of the replayed pass: recorded rows routed to other experts than
    recorded, unrecorded rows not routed by the router's own top-k (and, with the rollout's weights,
    unlike the forward without replay)."""
    facts = {"recorded": 0, "wrong": 0, "unrecorded": 0, "not_own": 0, "unlike_free": 0}
    for (routed, own, ids, valid), (free, *_rest) in zip(replay["maps"], replay["free_maps"]):
        facts["recorded"] += int(valid.sum())
        facts["wrong"] += int((routed[valid] != _as_map(ids[valid])).any(-1).sum())
        facts["unrecorded"] += int((~valid).sum())
        facts["not_own"] += int((routed[~valid] != _as_map(own[~valid])).any(-1).sum())
        if same_weights:
            facts["unlike_free"] += int((routed[~valid] != free[~valid]).any(-1).sum())
    return facts


def _move_weights(actor, seed: int) -> None:
    """A "weight update": every weight nudged, the routers by much more (the engine reads them in place)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in actor.module.named_parameters():
            scale = 0.5 if "router" in name else 0.02
            p.add_(scale * torch.randn(p.shape, generator=gen))


def _check_episode(actor, batch, routing) -> dict:
    """The checks of the module docstring on a rollout batch: before and after the routers moved."""
    from megarl.models.router_replay import recorded

    before = _forwards(actor, batch, routing)
    facts = {"before": _routing_facts(before, True), "agree_before": before["own_agree"]["r3/agreement"]}
    mask = batch.response_mask != 0
    facts["lp_gap"] = float((before["replayed"] - batch.rollout_logprobs).abs()[mask].max())
    facts["recorded_mask"] = recorded(batch.expert_ids, EXPERTS)
    _move_weights(actor, 1)
    after = _forwards(actor, batch, routing)
    facts["after"] = _routing_facts(after, False)
    facts["agree_after"] = after["agree"]["r3/agreement"]
    facts["own_after"] = after["own_agree"]["r3/agreement"]
    facts["lengths"], facts["loss_mask"] = batch.lengths, batch.response_mask
    return facts


# -- multi-turn -------------------------------------------------------------------------------
class _Call:
    name, arguments = "mul", {"a": 6, "b": 7}


class _Tools:
    """Both schedules' tool executor: every call answers "424242"."""

    def run(self, calls):
        from test_rollout_agent import Out

        return [Out("424242") for _ in calls]

    def submit(self, calls):
        from concurrent.futures import Future

        done = Future()
        done.set_result(self.run(calls))
        return done


def _multi_turn(rank, ckpt, prefix_cache):
    from test_rollout_agent import make_tokenizer

    from megarl.rollout.agent import AgentLoop, AgentOptions
    from megarl.rollout.engine import SamplingParams, sample_requests
    from megarl.trainer.rollout import to_sample_batch

    actor, groups = _actor(ckpt)
    routing = Routing(actor)
    engine, tok = _engine(actor, groups, prefix_cache), make_tokenizer()
    prompts = [tok.encode("<s>user:mul 6 7</s><s>assistant:"), tok.encode("<s>user:ab</s><s>assistant:")]
    requests, params = sample_requests(prompts, 2, 5, 40), SamplingParams(temperature=1.0)
    end = engine.generate(requests[:1], params)[0].response_ids[2]  # sample 0 calls its tool in turn 0
    out = {}
    for overlap in (False, True):
        loop = AgentLoop(engine, tok, _Tools(), lambda text: ([_Call()], []),
                         AgentOptions(end, max_turns=3, overlap_tools=overlap))
        results = loop.generate(requests, params)
        out[overlap] = {"turns": [r.extra["turns"] for r in results],
                        "context": [r.loss_mask.count(0) for r in results]}
    out["reused"] = engine.reused
    # the checks move the weights: the overlapped schedule's batch is checked on its own weights first
    out[True].update(_check_episode(actor, to_sample_batch(results, 0, "cpu"), routing))
    return pickle.dumps(out)


# -- HTTP agents ------------------------------------------------------------------------------
def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the local server: no proxy
    with direct.open(request, timeout=120) as response:
        return json.loads(response.read())


def two_call_agent(sample, base_url):
    """A chat turn, a tool result, a second turn; sample key 3 fails before calling."""
    if sample["key"] == 3:
        raise RuntimeError("this agent fails")
    messages = [{"role": "user", "content": "mul 6 7"}]
    first = _post(f"{base_url}/chat/completions", {"model": "m", "messages": messages, "max_tokens": 6})
    content = first["choices"][0]["message"].get("content") or ""
    messages += [{"role": "assistant", "content": content}, {"role": "tool", "content": "42"}]
    _post(f"{base_url}/chat/completions", {"model": "m", "messages": messages, "max_tokens": 6})
    return 1.0


def _http(rank, ckpt, prefix_cache):
    from test_rollout_agent import make_tokenizer

    from megarl.config import Config
    from megarl.rollout.engine import SamplingParams, sample_requests
    from megarl.rollout.http_agents import HttpAgentRollout
    from megarl.tools import resolve_parser
    from megarl.trainer.rollout import to_sample_batch

    actor, groups = _actor(ckpt)
    routing = Routing(actor)
    tok = make_tokenizer()
    end = tok.convert_tokens_to_ids("</tool_call>")
    parser = resolve_parser(Config().rollout.server.parser)
    engine = _engine(actor, groups, prefix_cache)
    agents = HttpAgentRollout(engine, tok, two_call_agent, parser, [], 0, host="127.0.0.1", port=0,
                              workers=4, timeout_s=120, model_name="m", max_len=100, stop_ids=[end])
    try:
        results = agents.generate(sample_requests([tok.encode("<s>user:mul 6 7</s><s>assistant:")], 4, 9, 60),
                                  SamplingParams(temperature=1.0))
    finally:
        agents.close()
    out = {"calls": [r.extra["calls"] for r in results], "failed": [r.extra["agent_failed"] for r in results],
           "context": [r.loss_mask.count(0) for r in results], "reused": engine.reused}
    out.update(_check_episode(actor, to_sample_batch(results, 0, "cpu"), routing))
    return pickle.dumps(out)


# -- partial rollouts -------------------------------------------------------------------------
def _positions_of(batch, versions_by_row: list, version: int) -> torch.Tensor:
    """(B, L) bool: positions whose ids the call of ``version`` recorded (the prompt's with the response's
    first token, row P - 1 + j with token j)."""
    from megarl.models.router_replay import recorded

    out = torch.zeros(batch.expert_ids.shape[:2], dtype=torch.bool)
    for i, versions in enumerate(versions_by_row):
        p = int(batch.lengths[i]) - len(versions)
        if versions[0] == version:
            out[i, :p - 1] = True
        for j, v in enumerate(versions):
            out[i, p - 1 + j] = v == version
    return out & recorded(batch.expert_ids, EXPERTS)


def _agreement_on(actor, batch, positions: torch.Tensor) -> float:
    """The router's own top-k (no replay) against the recorded ids at ``positions`` only."""
    from megarl.models.router_replay import unrecorded

    b = batch.select(torch.arange(len(batch)))
    b.expert_ids = b.expert_ids.clone()
    b.expert_ids[~positions] = unrecorded(b.expert_ids.dtype)
    actor.replay.reset()
    with actor.replay.observing():
        actor.logprobs(b, 2, 1.0)
    return actor.replay.read()["r3/agreement"]


STOPS = tuple(range(20, 28))  # responses end at one of these: lengths vary, groups finish at different steps


def _load(actor, weights: list) -> None:
    with torch.no_grad():
        for param, saved in zip(actor.module.parameters(), weights):
            param.copy_(saved)


def _partial(rank, ckpt):
    from megarl.data.dataset import PromptBatch, PromptItem
    from megarl.models.router_replay import recorded
    from megarl.rollout.engine import SamplingParams
    from megarl.trainer.partial import PartialRollouts, group_results
    from megarl.trainer.rollout import to_sample_batch

    actor, groups = _actor(ckpt)
    routing = Routing(actor)
    engine = _engine(actor, groups)
    drawn = [0]

    def draw():
        drawn[0] += 1
        return PromptBatch([PromptItem(drawn[0], [5 + drawn[0], 9, 11, 2 * drawn[0] + 1], "", None)])

    p = PartialRollouts(quota=1, n=2, batches=3, max_new_tokens=20)
    weights, checked = [], []
    for step in range(4):
        weights.append([t.detach().clone() for t in actor.module.parameters()])
        p.top_up(draw, seed=100 + step)
        p.generate(engine, SamplingParams(temperature=1.0, stop_token_ids=STOPS), step)
        for g in p.take():
            rows = group_results([g])
            if len({v for r in rows for v in r.versions}) > 1:
                checked.append((to_sample_batch(rows, 0, "cpu"), [r.versions for r in rows]))
        _move_weights(actor, 10 + step)
        engine.update_weights()
    out = []
    for batch, versions in checked:
        inside = torch.arange(batch.width)[None, :] < (batch.lengths - 1)[:, None]
        facts = {"versions": versions, "every_position": torch.equal(recorded(batch.expert_ids, EXPERTS), inside)}
        forward = _forwards(actor, batch, routing)  # the current (later) weights, replayed
        facts["routing"] = _routing_facts(forward, False)
        latest = max(v for vs in versions for v in vs)
        older = torch.zeros(batch.expert_ids.shape[:2], dtype=torch.bool)
        for v in sorted({v for vs in versions for v in vs}):
            at = _positions_of(batch, versions, v)
            older |= at if v < latest else False
            _load(actor, weights[v])
            facts[v] = {"count": int(at.sum()), "own": _agreement_on(actor, batch, at)}
        facts["older_under_latest"] = _agreement_on(actor, batch, older)  # what a re-prefill would have chosen
        out.append(facts)
    return pickle.dumps(out)


# -- the tests --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from test_rollout_agent import make_tokenizer

    from megarl.models.tiny import make_tiny_checkpoint

    path = tmp_path_factory.mktemp("moe_r3_turns")
    make_tiny_checkpoint(str(path), "Qwen3MoeForCausalLM", seed=61, vocab_size=len(make_tokenizer()))
    return str(path)


def _assert_episode(r: dict) -> None:
    lengths = r["lengths"]
    width = r["recorded_mask"].shape[1]
    inside = torch.arange(width)[None, :] < (lengths - 1)[:, None]
    assert torch.equal(r["recorded_mask"] & ~inside, torch.zeros_like(inside))  # nothing past a row's end
    assert r["agree_before"] == 1.0 and r["lp_gap"] <= 1e-5
    b, a = r["before"], r["after"]
    assert b["recorded"] > 100 and b["wrong"] == 0 and b["unrecorded"] > 0
    assert b["not_own"] == 0 and b["unlike_free"] == 0  # unrecorded rows: as without replay
    assert a["wrong"] == 0 and a["not_own"] == 0 and a["unrecorded"] == b["unrecorded"]
    assert r["agree_after"] < 1.0 and r["own_after"] < 1.0  # the moved routers would choose others


@pytest.mark.parametrize("prefix_cache", [False, True], ids=["cold", "prefix_cache"])
def test_multi_turn_tool_episode(ckpt, prefix_cache):
    r = pickle.loads(spawn(_multi_turn, 1, ckpt, prefix_cache)[0])
    assert (r["reused"] > 0) == prefix_cache  # later turns take earlier turns' pages (and their ids)
    assert max(r[False]["turns"]) > 1 and r[False]["turns"] == r[True]["turns"]
    inside = torch.arange(r[True]["recorded_mask"].shape[1])[None, :] < (r[True]["lengths"] - 1)[:, None]
    assert torch.equal(r[True]["recorded_mask"], inside)  # context included: every position but the last
    assert max(r[True]["context"]) > 0  # some rows hold tool context between turns
    _assert_episode(r[True])


@pytest.mark.parametrize("prefix_cache", [False, True], ids=["cold", "prefix_cache"])
def test_http_agent_episode(ckpt, prefix_cache):
    r = pickle.loads(spawn(_http, 1, ckpt, prefix_cache)[0])
    assert (r["reused"] > 0) == prefix_cache  # the second call takes the first one's pages
    assert r["failed"] == [False, False, False, True] and r["calls"][:3] == [2, 2, 2]
    failed = r["recorded_mask"][3]
    assert not failed.any()  # the failed sample: nothing recorded, its row free-routed
    live = r["recorded_mask"][:3]
    inside = torch.arange(live.shape[1])[None, :] < (r["lengths"][:3] - 1)[:, None]
    assert torch.equal(live, inside)
    _assert_episode(r)


def test_partial_rollout_resumed_across_a_weight_update(ckpt):
    out = pickle.loads(spawn(_partial, 1, ckpt)[0])
    assert out  # some trained group held a response resumed across an update
    assert sum(f["routing"]["recorded"] for f in out) > 100
    for facts in out:
        assert facts["every_position"]  # ids for the prompt and every response token but the last
        assert facts["routing"]["wrong"] == 0 and facts["routing"]["not_own"] == 0
        for v in {v for vs in facts["versions"] for v in vs}:
            assert facts[v]["count"] > 0 and facts[v]["own"] == 1.0  # each position: its own policy's ids
    assert min(f["older_under_latest"] for f in out) < 1.0  # kept ids the later policy would not choose
