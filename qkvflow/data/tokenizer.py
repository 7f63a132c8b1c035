"""Tokenizers trained offline on your own text: reading ``.txt`` and ``.jsonl`` files into documents,
splitting them into train and validation, and training a tokenizer on them. Writing the result as a folder
for Levanter's data pipeline (``qkvflow tokenizer``) is ``qkvflow.data.tokenizer_folder``: it writes a
qkvflow output, under the rules of ``qkvflow.outputs``, a layer above this one.

Documents. A ``.jsonl`` line is one JSON object whose ``text_key`` field (a string) is one document. A ``.txt``
file is one document, cut after the first line end past every ``chunk_chars`` characters (``chunk``; joined
they give the file back exactly) so that one long file still gives a validation split; ``chunk_chars=0``
keeps each file whole. Levanter frames each document as ``[bos] + encode(text + " " + eos)``
(``levanter.data.text._batch_tokenizer.BatchTokenizer``), so a document's end is marked in training.

Split. With ``validation_fraction = f > 0`` the ``ceil(f * N)`` documents (of N) with the smallest key
``blake2b(f"{seed}:{text}", digest_size=8)`` (big-endian; ties by position) go to validation, the rest to
train, both in file order. The key is the one of ``qkvflow.data.heldout``; taking the smallest keys
instead of thresholding them gives a split of exactly that size, at least one document, however small the
text. The result depends on the files' contents only.

Tokenizers (both with ``<|endoftext|>`` as bos and eos, as GPT-2 and qkvflow's bundled corpora):

* ``bpe``: GPT-2 style byte-level BPE (HF ``tokenizers``) trained on the train documents. All 256 byte
  symbols are in the vocabulary, so any UTF-8 text encodes and decodes back exactly. ``vocab_size``
  counts the 256 bytes, ``<|endoftext|>`` and the merges; it is reached exactly unless the text runs out
  of pairs to merge first (a small text), in which case the vocabulary is smaller (reported).
* ``char``: one token per character: ids ``0..K-1`` are the sorted distinct characters of all documents
  (validation included, so that every document encodes) plus ``" "`` (Levanter puts one before
  ``<|endoftext|>``), id ``K`` is ``<|endoftext|>``. ``vocab_size`` is a cap: the vocabulary is always
  ``K + 1`` tokens, and a cap below that is an error. A character outside the alphabet cannot be encoded.

The bundled corpora (``qkvflow.data.corpora``) build their tokenizers with the same functions.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from qkvflow.errors import UserError

if TYPE_CHECKING:  # imported where used: transformers imports torch (~5 s), which training never needs
    from transformers import PreTrainedTokenizerFast

EOS = "<|endoftext|>"
KINDS = ("bpe", "char")
BYTES = 256
MIN_BPE_VOCAB = BYTES + 1  # every byte symbol and <|endoftext|>
DEFAULT_BPE_VOCAB = 8192
CHUNK_CHARS = 10_000
EXTENSIONS = (".txt", ".jsonl")
SEPARATOR = " "  # what Levanter's BatchTokenizer puts between a document and <|endoftext|>


# --- tokenizer recipes (shared with qkvflow.data.corpora) -------------------------------------------


def bpe_tokenizer(docs: Iterable[str], vocab_size: int) -> Tokenizer:
    """GPT-2 style byte-level BPE trained on ``docs`` (all 256 bytes kept, so any text encodes)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(docs, trainer)
    return tok


def char_tokenizer(chars: Sequence[str]) -> Tokenizer:
    """One token per character; characters outside ``chars`` raise an error when encoded."""
    vocab = {c: i for i, c in enumerate(chars)} | {EOS: len(chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))  # "<unk>" is absent on purpose
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # join tokens without inserting spaces
    return tok


def wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    """Mark ``EOS`` special, frame every text with it and wrap as a transformers tokenizer.

    The post-processor (``EOS text EOS``) serves ``tokenizer(text)`` in transformers; Levanter encodes
    without special tokens and adds bos and eos itself (see the module docstring)."""
    tok.add_special_tokens([EOS])
    eos = (EOS, tok.token_to_id(EOS))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{EOS} $A {EOS}", pair=f"{EOS} $A {EOS} $B:1 {EOS}:1", special_tokens=[eos]
    )
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOS, eos_token=EOS, clean_up_tokenization_spaces=False,
        model_input_names=["input_ids", "attention_mask"],  # no token_type_ids in Levanter's cache
    )  # fmt: skip


def chunk(text: str, size: int = CHUNK_CHARS) -> list[str]:
    """Cut ``text`` after the first line end past every ``size`` characters; ``"".join`` restores it."""
    chunks: list[str] = []
    current: list[str] = []
    length = 0
    for line in text.splitlines(keepends=True):
        current.append(line)
        length += len(line)
        if length >= size:
            chunks.append("".join(current))
            current, length = [], 0
    if current:
        chunks.append("".join(current))
    return chunks


# --- reading the user's files ----------------------------------------------------------------------


def check_files(files: Sequence[str]) -> None:
    """What can be checked without reading: at least one file, each exists, is a file of a known
    extension and is not empty."""
    if not files:
        raise UserError("--files is empty: expected one or more .txt or .jsonl files")
    for path in files:
        if not os.path.exists(path):
            raise UserError(f"--files: {path!r} does not exist (expected a .txt or .jsonl file)")
        if not os.path.isfile(path):
            raise UserError(f"--files: {path!r} is not a file (expected a .txt or .jsonl file)")
        if not path.endswith(EXTENSIONS):
            raise UserError(
                f"--files: {path!r} has an unknown extension: expected .txt (plain text, one document) "
                "or .jsonl (one JSON object per line)"
            )
        if os.path.getsize(path) == 0:
            raise UserError(f"--files: {path!r} is empty (expected UTF-8 text)")


def _decode(path: str, raw: bytes, offset: int = 0, line: int | None = None) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1 if line is None else line
        raise UserError(
            f"--files: {path!r} is not UTF-8 text (line {line}, byte offset {offset + e.start}: {raw[e.start : e.start + 1]!r})"
        ) from None


def _txt_documents(path: str, chunk_chars: int) -> Iterator[str]:
    with open(path, "rb") as f:
        raw = f.read()
    text = _decode(path, raw, line=None)
    if not text.strip():
        raise UserError(f"--files: {path!r} holds only whitespace (expected text)")
    yield from (chunk(text, chunk_chars) if chunk_chars > 0 else [text])


def _jsonl_documents(path: str, text_key: str) -> Iterator[str]:
    offset, seen = 0, False
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            line = _decode(path, raw, offset, number)
            offset += len(raw)
            where = f"--files: {path!r} line {number}"
            if not line.strip():
                raise UserError(f"{where} is blank; expected one JSON object per line")
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(
                    f"{where} is not JSON ({e.msg} at column {e.colno}); expected one JSON object per line"
                ) from None
            if not isinstance(record, dict) or not isinstance(record.get(text_key), str):
                raise UserError(
                    f'{where} has no string field {text_key!r} (expected objects like {{"{text_key}": "..."}}; '
                    "--text_key names the field)"
                )
            seen = seen or bool(record[text_key].strip())
            yield record[text_key]
    if not seen:
        raise UserError(f"--files: {path!r} holds no text (every {text_key!r} field is empty or whitespace)")


def documents(files: Sequence[str], *, text_key: str = "text", chunk_chars: int = CHUNK_CHARS) -> Iterator[str]:
    """The documents of ``files`` in order (see the module docstring), checked as they are read:
    bad input raises ``UserError`` naming the file (and line and byte offset)."""
    for path in files:
        if path.endswith(".jsonl"):
            yield from _jsonl_documents(path, text_key)
        else:
            yield from _txt_documents(path, chunk_chars)


def split_key(text: str, seed: int = 0) -> int:
    """The document's key for the train/validation split (``qkvflow.data.heldout``'s hash)."""
    return int.from_bytes(hashlib.blake2b(f"{seed}:{text}".encode("utf-8"), digest_size=8).digest(), "big")


def validation_indices(keys: Sequence[int], fraction: float) -> frozenset[int]:
    """Positions of the ``ceil(fraction * len(keys))`` smallest keys (ties by position)."""
    if fraction <= 0:
        return frozenset()
    count = math.ceil(fraction * len(keys))
    return frozenset(sorted(range(len(keys)), key=lambda i: (keys[i], i))[:count])


# --- training ---------------------------------------------------------------------------------------


def check_vocab_size(kind: str, vocab_size: int | None) -> None:
    if kind not in KINDS:
        raise UserError(f"--kind {kind!r} is invalid: expected one of {', '.join(KINDS)}")
    if vocab_size is None:
        return
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise UserError(f"--vocab_size {vocab_size!r} is invalid: expected an integer >= 1")
    if kind == "bpe" and vocab_size < MIN_BPE_VOCAB:
        raise UserError(
            f"--vocab_size {vocab_size} is smaller than the byte alphabet: byte-level BPE needs at least "
            f"{MIN_BPE_VOCAB} tokens ({BYTES} bytes and {EOS})"
        )


def alphabet(docs: Iterable[str]) -> list[str]:
    """The sorted distinct characters of ``docs`` and ``SEPARATOR``: a character tokenizer's tokens."""
    chars = {SEPARATOR}
    for doc in docs:
        chars.update(doc)
    return sorted(chars)


def train_tokenizer(docs: Iterable[str], vocab_size: int | None = None, kind: str = "bpe") -> PreTrainedTokenizerFast:
    """A ``kind`` tokenizer for ``docs`` (see the module docstring for what ``vocab_size`` means for each
    kind; None: 8192 for ``bpe``, the alphabet's size for ``char``)."""
    check_vocab_size(kind, vocab_size)
    if kind == "bpe":
        return wrap(bpe_tokenizer(docs, DEFAULT_BPE_VOCAB if vocab_size is None else vocab_size))
    chars = alphabet(docs)
    if vocab_size is not None and vocab_size < len(chars) + 1:
        raise UserError(
            f"--vocab_size {vocab_size} is too small for a character-level tokenizer: the text has {len(chars)} "
            f"distinct characters (with {SEPARATOR!r}), so it needs {len(chars) + 1} tokens with {EOS}; "
            "pass at least that or leave --vocab_size out"
        )
    return wrap(char_tokenizer(chars))
