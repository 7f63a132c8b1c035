"""The tokenizer an export writes encodes a prompt as training framed a document's start: ``[bos] + text``.

Levanter's BatchTokenizer puts BOS first whatever the tokenizer's templates say, so the exported copy
must too (GPT-2's tokenizer adds none), and must not end a prompt with EOS (qkvflow's corpus tokenizers
frame every text as ``<eos> text <eos>``). Each case here builds a small word-level tokenizer in the
test, with the template of one real tokenizer family.
"""

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from qkvflow.export.hf_folder import prompt_tokenizer
from qkvflow.inference.generate import frame_prompt

WORDS = ["<unk>", "<s>", "</s>", "<|endoftext|>", "hi", "there", "friend"]
ID = {w: i for i, w in enumerate(WORDS)}


def word_tokenizer(post_processor, bos, eos) -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.WordLevel(ID, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = post_processor
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos, unk_token="<unk>")


def gpt2_like():
    """GPT-2: BOS = EOS = <|endoftext|>, a ByteLevel post-processor that adds no special token."""
    return word_tokenizer(processors.ByteLevel(trim_offsets=False), "<|endoftext|>", "<|endoftext|>")


def corpus_like():
    """qkvflow's own-text tokenizers: <eos> text <eos>, BOS = EOS."""
    eos = "</s>"
    template = processors.TemplateProcessing(single=f"{eos} $A {eos}", special_tokens=[(eos, ID[eos])])
    return word_tokenizer(template, eos, eos)


def llama_like():
    """Llama: <s> text, EOS not appended: already framed as training frames a document."""
    template = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", ID["<s>"])])
    return word_tokenizer(template, "<s>", "</s>")


def ids(tokenizer, text="hi there friend"):
    return tokenizer(text)["input_ids"]


@pytest.mark.parametrize(
    "make,bos",
    [(gpt2_like, "<|endoftext|>"), (corpus_like, "</s>"), (llama_like, "<s>")],
    ids=["gpt2-adds-no-bos", "corpus-appends-eos", "llama-already-framed"],
)
def test_a_prompt_is_bos_then_the_text(make, bos, tmp_path):
    original = make()
    before = ids(original)
    exported = prompt_tokenizer(original)
    expected = [ID[bos], ID["hi"], ID["there"], ID["friend"]]
    assert ids(exported) == expected == frame_prompt(original, "hi there friend")
    assert ids(original) == before  # the caller's tokenizer is not changed
    exported.save_pretrained(tmp_path)  # what a user of the export loads
    assert ids(AutoTokenizer.from_pretrained(str(tmp_path))) == expected


def test_an_already_framed_tokenizer_is_returned_as_it_is():
    tokenizer = llama_like()
    assert prompt_tokenizer(tokenizer) is tokenizer


def test_a_tokenizer_without_bos_gets_only_its_trailing_eos_dropped():
    eos = "</s>"
    template = processors.TemplateProcessing(single=f"$A {eos}", special_tokens=[(eos, ID[eos])])
    tokenizer = word_tokenizer(template, None, eos)
    assert ids(prompt_tokenizer(tokenizer)) == [ID["hi"], ID["there"], ID["friend"]]
