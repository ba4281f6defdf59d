"""Stop strings of the OpenAI endpoint (megarl/rollout/http_openai.py ``first_stop``): the bisection
finds the same token as the prefix-by-prefix scan it replaces, on a byte-level BPE whose multi-byte
characters span several tokens (a prefix's text then ends in an incomplete character), and
``cut_at_stop`` cuts there."""
import random

import pytest

from megarl.rollout.engine import GenerationResult
from megarl.rollout.http_openai import cut_at_stop, first_stop, first_stop_ref

TEXTS = ["héllo wörld, 日本語のテキスト x=3+4 </tool_call> done", "ça va? naïve café — 12 × 7 = 84 ✓",
         "Observation: 東京 is 🗼 big", "<tool_call>{\"name\": \"calc\"}</tool_call>"]


@pytest.fixture(scope="module")
def byte_bpe():
    """(encode, decode) of a small byte-level BPE trained on TEXTS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXTS * 4, trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return (lambda text: tok.encode(text).ids), (lambda ids: tok.decode(ids))


def test_bisection_equals_the_scan(byte_bpe):
    encode, decode = byte_bpe
    rng = random.Random(0)
    seen_partial = hits = 0
    for trial in range(300):
        text = "".join(rng.sample(TEXTS, k=2))
        ids = encode(text)
        seen_partial += any("\ufffd" in decode(ids[:k]) for k in range(1, len(ids)))
        full = decode(ids)
        start = rng.randrange(len(full))
        stop = [full[start:start + rng.randint(1, 6)]] if trial % 4 else ["never here"]
        checked = rng.choice([0, 0, rng.randrange(len(ids))])
        want = first_stop_ref(ids, stop, decode, checked)
        if checked and first_stop_ref(ids[:checked], stop, decode) is not None:
            continue  # first_stop's precondition: the prefixes up to `checked` hold no stop string
        assert first_stop(ids, stop, decode, checked) == want, (text, stop, checked)
        hits += want is not None
    assert seen_partial > 0 and hits > 100  # incomplete characters were crossed, and stops found


def test_cut_at_stop_keeps_the_token_that_completes_it(byte_bpe):
    encode, decode = byte_bpe
    ids = encode("Observation: 東京 is 🗼 big")
    r = GenerationResult([1, 2], ids, [-0.1] * len(ids), "length", 0)
    cut = cut_at_stop(r, ["東京"], decode)
    k = len(cut.response_ids)
    assert cut.finish_reason == "stop" and "東京" in decode(ids[:k]) and "東京" not in decode(ids[:k - 1])
    assert cut.logprobs == r.logprobs[:k]
    assert cut_at_stop(r, ["absent"], decode) is r and cut_at_stop(r, [], decode) is r
