"""The vocabulary a training config's model is built with, found without building or downloading
anything (`qkvflow describe`, `qkvflow plan`): `vocab_size` if the config has one, else the `corpus:`
tokenizer's size (computed), else `data.tokenizer` read from a local folder or the Hugging Face cache,
else, for the default `gpt2`, GPT-2's 50,257 tokens."""

import os

from qkvflow.data.corpora import check_corpus, corpus_vocab_size
from qkvflow.errors import UserError

GPT2_VOCAB = 50257


def vocabulary(config) -> tuple[int, str]:
    """(size, where it came from) of the vocabulary to count embeddings with."""
    if config.vocab_size is not None:
        if isinstance(config.vocab_size, bool) or config.vocab_size < 1:
            raise UserError(f"vocab_size={config.vocab_size!r} is invalid: expected null or an integer >= 1")
        return config.vocab_size, "vocab_size"
    if config.corpus is not None:
        c = config.corpus
        check_corpus(c)
        try:
            return corpus_vocab_size(c.name, vocab_size=c.vocab_size), f"corpus {c.name}"
        except (ValueError, FileNotFoundError) as e:
            raise UserError(f"corpus: {e}") from None
    name = getattr(config.data, "tokenizer", None)
    if name is None:
        raise UserError("data has no tokenizer to count the vocabulary with: pass --vocab_size N")
    from transformers import AutoTokenizer

    try:
        return len(AutoTokenizer.from_pretrained(name, local_files_only=True)), f"data.tokenizer {name}"
    except Exception as e:  # noqa: BLE001 (HF raises OSError, ValueError, ...)
        if os.path.isdir(name):
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise UserError(
                f"data.tokenizer={name!r} could not be loaded ({first}); expected a tokenizer folder"
            ) from None
        if name == "gpt2":
            return GPT2_VOCAB, "GPT-2's vocabulary (data.tokenizer gpt2, not in the local Hugging Face cache)"
        raise UserError(
            f"data.tokenizer={name!r} is not in the local Hugging Face cache: pass --vocab_size N "
            "(describe downloads nothing)"
        ) from None
