"""Sampling options: seeds, stop strings and stop tokens, top-k. One tiny model, one engine shape."""

import numpy as np
import pytest

from qkvflow.inference.decoders import decoder_for
from qkvflow.inference.generate import SamplingOptions, generate
from qkvflow.inference.sampling import top_k_mask
from tests.inference.util import CharTokenizer, ode_model

TOK = CharTokenizer()
PROMPTS = ["Hello", "abc"]


@pytest.fixture(scope="module")
def decoder():
    return decoder_for(ode_model("gpt2", "euler", 2))


def run(decoder, prompts=PROMPTS, **options):
    return generate(None, TOK, prompts, SamplingOptions(**options), decoder=decoder)


def test_same_seed_same_text_other_seed_other_text(decoder):
    hot = dict(max_new_tokens=10, temperature=5.0)
    a = run(decoder, seed=1, **hot)
    b = run(decoder, seed=1, **hot)
    c = run(decoder, seed=2, **hot)
    assert [x.tokens for x in a] == [x.tokens for x in b]
    # 61 tokens at a high temperature: 20 draws agreeing by chance is (about) impossible
    assert [x.tokens for x in a] != [x.tokens for x in c]
    greedy = run(decoder, max_new_tokens=10)
    assert [x.tokens for x in a] != [x.tokens for x in greedy]


def test_stop_token_ends_and_is_excluded(decoder):
    full = run(decoder, max_new_tokens=10)[0]
    stop = full.tokens[3]  # the first occurrence decides where it ends
    first = full.tokens.index(stop)
    out = run(decoder, max_new_tokens=10, stop_token_ids=(stop,))[0]
    assert out.tokens == full.tokens[:first]
    assert out.text == TOK.decode(full.tokens[:first])
    assert out.finish_reason == "stop"


def test_stop_string_ends_and_is_excluded(decoder):
    full = run(decoder, max_new_tokens=10)[0]
    stop = full.text[4:6]
    out = run(decoder, max_new_tokens=10, stop=(stop,))[0]
    assert out.text == full.text[: full.text.find(stop)]
    assert out.finish_reason == "stop"
    # a string that never appears changes nothing
    none = run(decoder, max_new_tokens=10, stop=("\x7f",))[0]
    assert none.text == full.text and none.finish_reason == "length"


def test_top_k_one_is_greedy(decoder):
    greedy = run(decoder, max_new_tokens=6)
    sampled = run(decoder, max_new_tokens=6, temperature=5.0, top_k=1, seed=3)
    assert [x.tokens for x in sampled] == [x.tokens for x in greedy]


def test_top_k_mask_keeps_the_k_largest():
    logits = np.array([[0.5, -1.0, 3.0, 2.0, 0.0]], dtype=np.float32)
    masked = np.asarray(top_k_mask(logits, 2))
    expected = np.array([[-np.inf, -np.inf, 3.0, 2.0, -np.inf]], dtype=np.float32)
    np.testing.assert_array_equal(masked, expected)


def test_more_prompts_than_engine_slots_are_all_decoded(decoder):
    """The engine admits only what fits its slots in one `generate` call (the rest would come back
    empty); `generate` decodes the prompts in batches of max_seqs."""
    from qkvflow.inference.generate import EngineSizes

    wide = run(decoder, max_new_tokens=6)
    narrow = generate(
        None, TOK, PROMPTS, SamplingOptions(max_new_tokens=6), decoder=decoder, sizes=EngineSizes(max_seqs=1)
    )
    assert [x.tokens for x in narrow] == [x.tokens for x in wide]
    assert all(len(x.tokens) == 6 for x in narrow)
