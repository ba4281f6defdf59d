"""OpenAI request checks and response shapes for the HTTP endpoint (``http_server.py``).

Responses carry two megarl fields besides OpenAI's: ``prompt_token_ids`` (the
ids the turn was sampled after) and per choice ``token_ids`` (the ids sampled),
so a client can check what the trainer will receive.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace

from megarl.rollout.engine import GenerationResult

MAX_CHOICES = 16  # n per call


class ApiError(Exception):
    """An OpenAI-shaped error answer."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Call:
    """A checked request: chat (``messages``) or completion (``prompt``)."""

    messages: list[dict]
    prompt: str | list[int] | None
    n: int
    max_tokens: int | None
    stop: list[str]
    logprobs: bool | int
    stream: bool
    tools: list | None


def _int(body: dict, key: str, low: int, high: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ApiError(400, f"{key} must be an integer {bound}, got {value!r}", param=key)
    return value


def parse_chat(body: dict, model_name: str, temperature: float, completion: bool = False) -> Call:
    """``body`` checked; every problem is one ApiError naming the field."""
    if body.get("model") != model_name:
        raise ApiError(404, f"the model {body.get('model')!r} does not exist; this endpoint serves {model_name!r}",
                       param="model", code="model_not_found")
    t = body.get("temperature")
    if t is not None and (not isinstance(t, (int, float)) or abs(float(t) - temperature) > 1e-6):
        raise ApiError(400, f"temperature={t!r}: the rollout samples at temperature {temperature} "
                            "(rollout.temperature); leave it out or send that value", param="temperature")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise ApiError(400, "stop must be a string or a list of up to 4 non-empty strings", param="stop")
    max_tokens = _int(body, "max_completion_tokens", 1)
    max_tokens = max_tokens if max_tokens is not None else _int(body, "max_tokens", 1)
    n = _int(body, "n", 1, MAX_CHOICES) or 1
    if completion:
        prompt = body.get("prompt")
        ok = isinstance(prompt, str) and prompt or \
            isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt)
        if not ok:
            raise ApiError(400, "prompt must be a non-empty string or a list of token ids", param="prompt")
        logprobs = _int(body, "logprobs", 0, 5)
        return Call([], prompt, n, max_tokens, stop, logprobs is not None, bool(body.get("stream")), None)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or \
            not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise ApiError(400, "messages must be a non-empty list of objects with a 'role'", param="messages")
    tools = body.get("tools")
    return Call(messages, None, n, max_tokens, stop, bool(body.get("logprobs")), bool(body.get("stream")), tools)


def first_stop(ids: list[int], stop: list[str], decode, checked: int = 0) -> int | None:
    """The smallest k > ``checked`` such that ``decode(ids[:k])`` holds a stop string, or None; the
    prefixes up to ``checked`` tokens are known to hold none. A longer prefix's text extends a shorter
    one's (but for an incomplete character at its end, which no stop string holds), so a stop string once
    found stays: one decode of all ``ids`` answers "none" and a bisection finds k in log(len) decodes
    (:func:`first_stop_ref` is the scan it equals)."""
    def hit(k: int) -> bool:
        text = decode(ids[:k])
        return any(s in text for s in stop)

    if not stop or len(ids) <= checked or not hit(len(ids)):
        return None
    low, high = checked, len(ids)  # hit(high); no hit at low (or low = checked)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if hit(mid) else (mid, high)
    return high


def first_stop_ref(ids: list[int], stop: list[str], decode, checked: int = 0) -> int | None:
    """Reference of :func:`first_stop`: every prefix in turn."""
    return next((k for k in range(checked + 1, len(ids) + 1) if any(s in decode(ids[:k]) for s in stop)), None)


def cut_at_stop(r: GenerationResult, stop: list[str], decode) -> GenerationResult:
    """``r`` cut after the first token whose text completes a stop string (finish "stop")."""
    k = first_stop(list(r.response_ids), stop, decode)
    if k is None:
        return r
    experts = None if r.expert_ids is None else r.expert_ids[:k]  # MoE, recorded: one row per token
    return replace(r, response_ids=r.response_ids[:k], logprobs=r.logprobs[:k], finish_reason="stop",
                   expert_ids=experts)


def token_logprob(state, token_id: int, logprob: float) -> dict:
    """One token's entry of a chat answer's ``logprobs.content``."""
    token = state.decode([token_id])
    return {"token": token, "logprob": float(logprob), "bytes": list(token.encode()), "top_logprobs": []}


def _token_logprobs(state, r: GenerationResult) -> list[dict]:
    return [token_logprob(state, i, lp) for i, lp in zip(r.response_ids, r.logprobs)]


def assistant_message(text: str, parser, call_id: str) -> dict:
    """A sampled turn's text (end-of-turn tokens removed) as an OpenAI assistant message: the text
    before ``<tool_call>`` as its content and the calls ``parser`` finds as ``tool_calls`` (ids
    ``call_<call_id>_<j>``), or the whole text as its content when there are none."""
    calls, _problems = parser(text)
    if not calls:
        return {"role": "assistant", "content": text}
    head = text[:text.index("<tool_call>")] if "<tool_call>" in text else ""
    tool_calls = [{"id": f"call_{call_id}_{j}", "type": "function",
                   "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for j, c in enumerate(calls)]
    return {"role": "assistant", "content": head or None, "tool_calls": tool_calls}


def choice_message(state, r: GenerationResult) -> tuple[dict, str]:
    """The assistant message of one choice and its finish reason (tool calls parsed by megarl's parser)."""
    text = state.decode(r.response_ids)
    for eos in state.tokenizer.convert_ids_to_tokens(state.eos_ids):
        text = text.replace(eos, "")
    message = assistant_message(text, state.parser, str(r.key))
    if "tool_calls" in message:
        return message, "tool_calls"
    return message, "length" if r.finish_reason == "length" else "stop"


def chat_body(state, results: list[GenerationResult], prompt_len: int, logprobs: bool, rid: str,
              created: int) -> dict:
    choices = []
    for j, r in enumerate(results):
        message, finish = choice_message(state, r)
        choices.append({"index": j, "message": message, "finish_reason": finish, "token_ids": list(r.response_ids),
                        "logprobs": {"content": _token_logprobs(state, r)} if logprobs else None})
    sampled = sum(len(r.response_ids) for r in results)
    return {"id": rid, "object": "chat.completion", "created": created, "model": state.model_name,
            "choices": choices, "prompt_token_ids": results[0].prompt_ids if results else [],
            "usage": {"prompt_tokens": prompt_len, "completion_tokens": sampled, "total_tokens": prompt_len + sampled}}


def completion_body(state, results: list[GenerationResult], prompt_len: int, logprobs: bool, rid: str,
                    created: int) -> dict:
    choices = []
    for j, r in enumerate(results):
        lps = None
        if logprobs:
            tokens = [state.decode([i]) for i in r.response_ids]
            offsets = [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
            lps = {"tokens": tokens, "token_logprobs": [float(x) for x in r.logprobs],
                   "top_logprobs": [{} for _ in tokens], "text_offset": offsets}
        choices.append({"index": j, "text": state.decode(r.response_ids), "logprobs": lps,
                        "finish_reason": "length" if r.finish_reason == "length" else "stop",
                        "token_ids": list(r.response_ids)})
    sampled = sum(len(r.response_ids) for r in results)
    return {"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
            "choices": choices, "prompt_token_ids": results[0].prompt_ids if results else [],
            "usage": {"prompt_tokens": prompt_len, "completion_tokens": sampled, "total_tokens": prompt_len + sampled}}
