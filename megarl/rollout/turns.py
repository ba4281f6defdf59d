"""Token ids of the context a multi-turn conversation appends between assistant turns.

After an assistant turn ends (the model sampled a tool-call end token, or its
end of turn before a simulated user replies), the conversation goes on with
text the model did not sample: the close of the assistant turn, the tool (or
user) messages, and the opening of the next assistant turn. Those are rendered
by the tokenizer's own chat template and tokenized **alone**, then appended to
the sampled ids as they are: nothing already in the sequence is decoded and
re-encoded, so the trained ids are exactly the ids the engine sampled plus
these.

How the delta is found, for any template: render a fixed conversation whose
assistant content is a sentinel string, without and with the new messages (and
the generation prompt); the text after the sentinel in the second rendering is
what follows an assistant turn's content. A template that renders the earlier
turns differently once later messages exist (the rendering with messages does
not start with the one without) is refused with a one-line error.
"""
from __future__ import annotations

from megarl.errors import ConfigError

SENTINEL = "\u2063megarl-assistant-content\u2063"  # invisible separators: no template rewrites them
_BASE = [{"role": "user", "content": "u"}, {"role": "assistant", "content": SENTINEL}]


class TurnRenderer:
    """``ids_after_assistant(messages)``: the ids that follow an assistant turn's sampled content."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        if getattr(tokenizer, "chat_template", None) is None:
            raise ConfigError("rollout.multi_turn: the tokenizer has no chat_template to render tool and user "
                              "turns with; use a chat model's tokenizer (model.tokenizer)")
        text = self._render(_BASE, generation_prompt=False)
        if text.count(SENTINEL) != 1:
            raise ConfigError("rollout.multi_turn: the chat template does not render assistant content verbatim")
        self.head = text[: text.index(SENTINEL) + len(SENTINEL)]

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def text_after_assistant(self, messages: list[dict]) -> str:
        """Close of the assistant turn + ``messages`` (role tool or user) + the next assistant's opening."""
        full = self._render(_BASE + list(messages), generation_prompt=True)
        if not full.startswith(self.head):
            raise ConfigError("rollout.multi_turn: the chat template renders earlier turns differently once later "
                              "messages follow; such a template cannot be extended token-in/token-out")
        return full[len(self.head):]

    def ids_after_assistant(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.encode(self.text_after_assistant(messages), add_special_tokens=False)

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def truncate(self, text: str, max_tokens: int) -> str:
        """``text`` cut to at most ``max_tokens`` tokens, saying how many were dropped."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) <= max_tokens:
            return text
        kept = self.tokenizer.decode(ids[:max_tokens])
        return f"{kept}\n[tool output truncated: {len(ids) - max_tokens} of {len(ids)} tokens dropped]"


def single_token_id(tokenizer, marker: str, key: str) -> int:
    """The id of ``marker`` when the tokenizer has it as one token (what a stop id needs), else a ConfigError."""
    ids = tokenizer.encode(marker, add_special_tokens=False)
    if len(ids) != 1:
        raise ConfigError(f"{key}={marker!r} is {len(ids)} tokens for this tokenizer; the engine stops on one token "
                          f"id: add it as a special token (Qwen2.5/Qwen3 tokenizers have '</tool_call>')")
    return ids[0]
