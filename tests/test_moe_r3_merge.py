"""Recorded expert ids of sequences that grow over several engine calls (megarl/rollout/expert_record.py).

No model: engines stand in whose every recorded row says which call computed it and at which position
(row t of call c = [[c, t], [c, t]]: 2 layers, top-2), so the merged record of a trajectory shows where
each of its positions came from. Checked exactly:

- :func:`merge` keeps every recorded row of the earlier record and fills the rest from the later one
  (uint8 and int16 ids); :func:`split` cuts a record into a result's prompt and response rows, padding
  with the unrecorded mark;
- the native engine's result of a resumed request: its prefix's rows unrecorded (this call did not
  sample them), the new tokens' rows recorded;
- multi-turn (agent loop, both schedules' shared path): a sampled token's row from its own turn, the
  appended context's rows (and the row of a turn's last sampled token) from the next turn's prefill,
  the prompt's from turn 0, the last position unrecorded; in the batch, position t holds row t;
- HTTP sessions: the same over a chain of chat calls; a stop string that cuts a choice cuts its rows;
- partial rollouts: a response resumed in a later call keeps its earlier rows (and its prompt's) and
  takes the new tokens' rows from the later call; a restarted sample drops its record; the record
  survives the in-flight state's round trip.
- a result whose rows do not fit its tokens is refused (one line); config: r3 with multi-turn, the
  agent server and partial rollouts passes the checks.
Not covered here: real routing (tests/test_moe_r3_turns.py).
"""
from dataclasses import replace

import numpy as np
import pytest

from megarl.models.router_replay import unrecorded_mark
from megarl.rollout.engine import GenerationResult, Request, SamplingParams
from megarl.rollout.expert_record import merge, positions, split

MARK = unrecorded_mark(np.dtype(np.uint8))


def rows(call: int, start: int, stop: int, dtype=np.uint8) -> np.ndarray:
    """Rows of positions start .. stop - 1 as call ``call`` records them: (n, 2 layers, top-2)."""
    t = np.arange(start, stop)
    return np.stack([np.full_like(t, call), t], -1)[:, None, :].repeat(2, 1).astype(dtype)


def tag(result: GenerationResult, call: int, prefix: int = 0) -> GenerationResult:
    """``result`` with the rows call ``call`` would record: prompt positions, response rows (a resumed
    request's first ``prefix`` rows unrecorded, as the native engine leaves them)."""
    p, r = len(result.prompt_ids), len(result.response_ids)
    experts = rows(call, p - 1, p - 1 + r)
    experts[:prefix] = MARK
    return replace(result, prompt_expert_ids=rows(call, 0, p - 1), expert_ids=experts)


def origin(record: np.ndarray) -> list:
    """Per position: the call that recorded it (None: unrecorded); and checks row t is position t."""
    out = []
    for t, row in enumerate(record):
        if row[0, 0] == unrecorded_mark(record.dtype):
            out.append(None)
            continue
        assert row[0, 1] == t % 256 and (row == row[0]).all()
        out.append(int(row[0, 0]))
    return out


@pytest.mark.parametrize("dtype", [np.uint8, np.int16])
def test_merge_keeps_earlier_rows_and_split_pads(dtype):
    mark = unrecorded_mark(np.dtype(dtype))
    old = rows(0, 0, 3, dtype)
    old[1] = mark
    merged = merge(old, rows(1, 0, 5, dtype))
    assert origin(merged) == [0, 1, 0, 1, 1]
    assert merge(None, old) is old and merge(old, None) is old and merge(None, None) is None
    prompt, response = split(merged, 3, 4)  # positions 0, 1 | 2, 3, 4 and one more (unrecorded)
    assert origin(np.concatenate([prompt, response])) == [0, 1, 0, 1, 1, None]
    assert prompt.dtype == dtype and split(None, 3, 4) == (None, None)
    assert [len(a) for a in split(merged, 1, 2)] == [0, 2]  # a one-token prompt has no prompt rows


def test_native_result_of_a_resumed_request_leaves_its_prefix_unrecorded():
    from megarl.rollout.step_experts import sequence_expert_ids
    from megarl.rollout.scheduler import Sequence

    seq = Sequence(0, 0, [5, 6, 7], 1, 8, generated=[1, 2, 3, 4])  # prefix of 2, then 2 sampled
    assert sequence_expert_ids(seq) == (None, None)  # nothing recorded yet
    seq.prompt_experts = rows(1, 0, 2)
    seq.experts = {2: rows(1, 4, 5)[0], 3: rows(1, 5, 6)[0]}
    response, prompt = sequence_expert_ids(seq)
    assert origin(np.concatenate([prompt, response])) == [1, 1, None, None, 1, 1]


def _tagged_agent_engine(tok):
    from test_rollout_agent import ScriptedEngine

    class Tagged(ScriptedEngine):
        def generate(self, requests, params):
            return [tag(r, len(self.calls)) for r in super().generate(requests, params)]

    return Tagged(tok)


def test_multi_turn_record_sampled_from_their_turn_context_from_the_next_prefill():
    from test_rollout_agent import _loop, make_tokenizer

    from megarl.trainer.rollout import to_sample_batch

    tok = make_tokenizer()
    engine = _tagged_agent_engine(tok)
    prompt = tok.encode("<s>user:mul</s><s>assistant:")
    (r,) = _loop(tok, engine).generate([Request(0, prompt, 0, 60)], SamplingParams())
    first, second = engine.script
    p, context = len(prompt), len(r.response_ids) - len(first) - len(second)
    assert context > 0 and r.loss_mask == [1] * len(first) + [0] * context + [1] * len(second)
    record = np.concatenate([r.prompt_expert_ids, r.expert_ids])  # positions 0 .. P + R - 2
    # turn 0 (call 1): the prompt's rows and the rows that sampled its tokens (P - 1 .. P + len(first) - 2);
    # turn 1's prefill (call 2): its last sampled token's row and the context's; then its own sampled rows
    want = [1] * (p - 1 + len(first)) + [2] * (context + len(second))
    assert origin(record) == want
    batch = to_sample_batch([r], 0, "cpu")
    assert origin(batch.expert_ids[0].numpy()) == want + [None]  # the last token routes freely


def test_http_session_chain_and_stop_cut():
    from test_rollout_agent import make_tokenizer

    from megarl.rollout.http_openai import cut_at_stop
    from megarl.rollout.http_sessions import SampleSession
    from megarl.rollout.turns import TurnRenderer

    tok = make_tokenizer()
    renderer = TurnRenderer(tok)

    def render_root(messages):
        return tok.encode(renderer._render(messages, generation_prompt=True), add_special_tokens=False)

    session = SampleSession(0, 1, 60, [tok.eos_token_id])
    user = [{"role": "user", "content": "mul"}]
    first = session.chat_prompt(user, renderer, render_root)
    sampled = tok.encode("ab a b", add_special_tokens=False)
    cut = cut_at_stop(tag(GenerationResult(first.ids, sampled, [-0.5] * len(sampled), "length", 0), 1), [" a"],
                      tok.decode)
    n = len(cut.response_ids)
    assert n < len(sampled) and cut.response_ids == sampled[:n] and len(cut.expert_ids) == n  # with its rows
    session.record(first, [cut], user)
    messages = user + [{"role": "assistant", "content": "ab a"}, {"role": "tool", "content": "42"}]
    second = session.chat_prompt(messages, renderer, render_root)
    assert second.base is session.last and second.context  # extends the first call's chain
    turn = [tok.eos_token_id]
    session.record(second, [tag(GenerationResult(second.ids, turn, [-0.5], "stop", 1), 2)], messages)
    r = session.result(first.ids, 0, False, {})
    p = len(first.ids)
    assert r.response_ids == sampled[:n] + second.context + turn
    record = np.concatenate([r.prompt_expert_ids, r.expert_ids])
    assert origin(record) == [1] * (p - 1 + n) + [2] * (len(second.context) + 1)
    failed = SampleSession(1, 1, 60, [tok.eos_token_id]).result(first.ids, 0, False, {})
    assert failed.expert_ids is None  # no call: nothing recorded, the trainer's router chooses


class _TaggedPartial:
    """``generate_until`` of tests/test_partial.py's scripted engine, each call's rows tagged with the
    version of its weights."""

    def __init__(self):
        from test_partial import ScriptedEngine

        self.inner = ScriptedEngine()

    def generate_until(self, requests, params, enough):
        version = self.inner.version
        finished, unfinished = self.inner.generate_until(requests, params, enough)
        prefix = {r.key: len(r.prefix) for r in requests}
        return ([tag(r, version, prefix[r.key]) for r in finished],
                [tag(r, version, prefix[r.key]) for r in unfinished])


def test_partial_resumed_response_keeps_its_earlier_rows():
    from test_partial import _draw

    from megarl.trainer.partial import PartialRollouts, group_results

    p, engine = PartialRollouts(2, 3, 2, 40), _TaggedPartial()
    draw, resumed = _draw([0]), 0
    for step in range(4):
        engine.inner.version = step
        p.top_up(draw, seed=1000 * step)
        p.generate(engine, SamplingParams(), step)
        for g in p.take():
            for s, r in zip(g.samples, group_results([g])):
                record = np.concatenate([r.prompt_expert_ids, r.expert_ids])
                calls = origin(record)
                plen = len(g.item.prompt_ids)
                # the prompt's rows and each token's from the call that first computed them: the one
                # that sampled the response's first token, and the one that sampled that token
                assert calls == [s.versions[0]] * (plen - 1) + s.versions
                resumed += len(set(s.versions)) > 1
    assert resumed  # some responses were resumed across steps
    carried = [s for g in p.groups for s in g.samples if s.tokens]
    assert carried
    state = p.state_dict()
    other = PartialRollouts(2, 3, 2, 40)
    other.load_state_dict(state)
    again = [s for g in other.groups for s in g.samples if s.tokens]
    assert all(np.array_equal(a.experts, b.experts) for a, b in zip(carried, again))
    p.restart_older_than(10**6)
    assert all(s.experts is None for g in p.groups for s in g.samples)


def test_r3_with_multi_turn_server_and_partial_passes_the_checks():
    from megarl.config import Config
    from megarl.config_checks import check_router_replay

    for key in ("multi_turn", "server", "partial"):
        cfg = Config()
        cfg.actor.router_replay = "r3"
        if key == "partial":
            cfg.rollout.partial = True
        else:
            getattr(cfg.rollout, key).enable = True
        check_router_replay(cfg, {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8})


def test_rows_that_do_not_fit_their_tokens_are_refused():
    """A result whose rows do not match its tokens (an engine bug, or a cut that forgot its rows)."""
    r = tag(GenerationResult([1, 2, 3], [4, 5], [0.0, 0.0], "stop", 7), 1)
    assert origin(positions(replace(r, prompt_expert_ids=None))) == [None, None, 1, 1]
    with pytest.raises(ValueError, match="request 7: 2 prompt and 1 response rows"):
        positions(replace(r, expert_ids=r.expert_ids[:1]))
