"""The tokenizer folder of your own text, laid out for Levanter's data pipeline: what `qkvflow tokenizer`
writes and a run's `data.tokenizer` (and its `data.components`) then names.

``build_tokenizer_folder(files, output, ...)`` reads ``.txt`` and ``.jsonl`` files, splits their documents
into train and validation, trains a tokenizer on them and writes ``output`` as one folder:

* ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``: a Hugging Face tokenizer that
  ``transformers.AutoTokenizer.from_pretrained(output)`` and Levanter's ``levanter.tokenizers.load_tokenizer``
  (what ``data.tokenizer: output`` uses) load offline;
* ``train.jsonl``, ``validation.jsonl``: one ``{"text": ...}`` document per line, what Levanter's ``url``
  data source reads (it does not read ``.txt``);
* ``sources.json``: the files read (with their sha256), the settings and the counts; and the
  ``qkvflow_output.json`` marker (``qkvflow.outputs``) that makes the folder replaceable by a later run.

How documents are read and split and what ``vocab_size`` means for each kind of tokenizer:
``qkvflow.data.tokenizer``, whose functions this module calls. It sits here, above ``qkvflow.data``, because
the folder is a qkvflow output and is written by the output rules of ``qkvflow.outputs``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from qkvflow import outputs
from qkvflow.data.tokenizer import (
    CHUNK_CHARS,
    EOS,
    check_files,
    check_vocab_size,
    documents,
    split_key,
    train_tokenizer,
    validation_indices,
)
from qkvflow.errors import UserError

KIND = "tokenizer"  # the kind of output in qkvflow_output.json
LEVANTER_CACHE = "levanter_cache"  # where configs/own_text.yaml puts Levanter's token cache


def _more_documents(files: Sequence[str]) -> str:
    """Advice for files that hold too few documents: a smaller --chunk_chars helps only where a .txt
    file has line ends to cut at."""
    cuttable = False
    for path in files:
        if not path.endswith(".jsonl"):
            with open(path, "rb") as f:
                cuttable = cuttable or b"\n" in f.read().strip()
    if cuttable:
        return "more text, or a smaller --chunk_chars (a .txt file is cut into documents at line ends)"
    return "or more text (a .txt file is cut into documents only at line ends, and these hold one line each)"


@dataclass(frozen=True)
class Built:
    """What `build_tokenizer_folder` wrote."""

    output: str
    kind: str
    vocab_size: int  # tokens in the tokenizer
    requested_vocab_size: int | None
    eos_id: int
    train_documents: int
    validation_documents: int
    files: list[str]  # written, relative to output


def _write_jsonl(path: str, docs: Iterable[str]) -> tuple[int, int]:
    count = chars = 0
    with open(path, "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")
            count, chars = count + 1, chars + len(doc)
    return count, chars


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_output(output: str, *, overwrite: bool) -> None:
    """``output`` may be written: absent, empty, or an earlier output of this command (with
    ``overwrite``) that holds nothing else, Levanter's token cache included (it was made with the old
    tokenizer: the user removes it, qkvflow never does)."""
    cache = os.path.join(str(output), LEVANTER_CACHE)
    if os.path.isdir(cache) and outputs.read_marker(str(output)) is not None:
        raise UserError(
            f"--output {str(output)!r} holds {LEVANTER_CACHE}/, Levanter's token cache made with the tokenizer "
            f"there: remove it yourself (rm -r {cache}) before rebuilding the tokenizer, or choose another --output"
        )
    outputs.check_replaceable(output, kind=KIND, key="--output", overwrite=overwrite)
    outputs.check_writable(output, "--output", beside=True)


def build_tokenizer_folder(
    files: Sequence[str],
    output: str,
    *,
    vocab_size: int | None = None,
    kind: str = "bpe",
    text_key: str = "text",
    chunk_chars: int = CHUNK_CHARS,
    validation_fraction: float = 0.05,
    write_data: bool = True,
    overwrite: bool = False,
    say=lambda line: None,
) -> Built:
    """Read ``files``, split, train and write ``output`` (see the module docstring). Every check on the
    arguments, the output folder and the files runs before anything is written; ``output`` is written
    into a temporary sibling and swapped in when complete (``qkvflow.outputs.replacing``)."""
    check_vocab_size(kind, vocab_size)
    if isinstance(chunk_chars, bool) or not isinstance(chunk_chars, int) or chunk_chars < 0:
        raise UserError(
            f"--chunk_chars {chunk_chars!r} is invalid: expected an integer >= 0 (0: one document per .txt file)"
        )
    if not 0 <= validation_fraction < 1:
        raise UserError(f"--validation_fraction {validation_fraction!r} is invalid: expected a number in [0, 1)")
    if not write_data:
        validation_fraction = 0.0  # the split only chooses the tokenizer's training text
    files = list(files)
    check_files(files)
    check_output(output, overwrite=overwrite)

    def docs() -> Iterator[str]:
        return documents(files, text_key=text_key, chunk_chars=chunk_chars)

    say(f"reading {len(files)} file{'s' if len(files) != 1 else ''} ...")
    keys = [split_key(doc) for doc in docs()]  # also checks every file before anything is written
    held_out = validation_indices(keys, validation_fraction)
    if len(held_out) >= len(keys):
        raise UserError(
            f"--validation_fraction {validation_fraction} leaves no training text: the files hold {len(keys)} "
            f"document{'s' if len(keys) != 1 else ''}; pass --validation_fraction 0, {_more_documents(files)}"
        )
    train_docs = lambda: (d for i, d in enumerate(docs()) if i not in held_out)  # noqa: E731
    described = "byte-level BPE" if kind == "bpe" else "character-level"
    say(f"training a {described} tokenizer on {len(keys) - len(held_out)} train documents ...")
    tokenizer = train_tokenizer(train_docs() if kind == "bpe" else docs(), vocab_size, kind)
    with outputs.replacing(output, kind=KIND, key="--output", overwrite=overwrite) as folder:
        tokenizer.save_pretrained(folder)
        counts: dict[str, Any] = {}
        if write_data:
            counts["train"] = _write_jsonl(os.path.join(folder, "train.jsonl"), train_docs())
            if held_out:
                valid = (d for i, d in enumerate(docs()) if i in held_out)
                counts["validation"] = _write_jsonl(os.path.join(folder, "validation.jsonl"), valid)
        sources = {
            "kind": kind,
            "vocab_size": len(tokenizer),
            "requested_vocab_size": vocab_size,
            "eos_token": EOS,
            "text_key": text_key,
            "chunk_chars": chunk_chars,
            "validation_fraction": validation_fraction,
            "documents": len(keys),
            "train_documents": len(keys) - len(held_out),
            "validation_documents": len(held_out),
            "characters": {split: chars for split, (_, chars) in counts.items()},
            "files": [{"path": path, "sha256": _sha256(path)} for path in files],
        }
        with open(os.path.join(folder, "sources.json"), "w") as f:
            json.dump(sources, f, indent=1)
            f.write("\n")
        written = sorted(os.listdir(folder))
    return Built(
        output=str(output), kind=kind, vocab_size=len(tokenizer), requested_vocab_size=vocab_size,
        eos_id=tokenizer.eos_token_id, train_documents=len(keys) - len(held_out),
        validation_documents=len(held_out), files=written + [outputs.MARKER],
    )  # fmt: skip
