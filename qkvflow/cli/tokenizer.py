"""`qkvflow tokenizer`: train a tokenizer on your own text, offline, and write it with the text as
train/validation jsonl, ready for `qkvflow train --config_path configs/own_text.yaml`.

    qkvflow tokenizer --files a.txt b.jsonl --vocab_size 8192 --output DIR [--kind bpe|char] [--text_key text]
        [--validation_fraction 0.05] [--chunk_chars 10000] [--write_data false] [--overwrite]

What is read, how documents are split and what `vocab_size` means for each kind: `qkvflow.data.tokenizer`.
DIR must be absent, empty, or (with --overwrite) an earlier output of this command holding nothing else;
it is written into a temporary sibling and swapped in when complete (`qkvflow.outputs`).
"""

import json
import os
import shlex
from dataclasses import dataclass, field
from typing import Optional

from qkvflow.cli.startup import usage
from qkvflow.data.tokenizer import CHUNK_CHARS, EOS
from qkvflow.data.tokenizer_folder import build_tokenizer_folder
from qkvflow.errors import UserError
from qkvflow.runs import configfile

LIST_OPTIONS = ("--files",)
FLAGS = ("--overwrite", "--write_data")


@dataclass
class TokenizerConfig:
    files: list[str] = field(default_factory=list)
    """The text to train on: .txt files (each one document, cut at line ends into pieces of chunk_chars)
    and .jsonl files (one JSON object per line, the document in its text_key field)."""
    output: Optional[str] = None
    """The folder to write: the tokenizer (loads with AutoTokenizer.from_pretrained and Levanter's
    data.tokenizer), train.jsonl, validation.jsonl and sources.json."""
    vocab_size: Optional[int] = None
    """bpe: tokens in all (256 bytes, <|endoftext|> and merges; fewer if the text runs out of merges),
    default 8192. char: a cap; the vocabulary is the text's distinct characters, ' ' and <|endoftext|>."""
    kind: str = "bpe"
    """bpe (byte-level BPE: any UTF-8 text encodes) or char (one token per character of the text)."""
    text_key: str = "text"
    """The field of each .jsonl object that holds the document."""
    chunk_chars: int = CHUNK_CHARS
    """.txt files are cut after the first line end past every this many characters (0: one document per file)."""
    validation_fraction: float = 0.05
    """The share of documents (rounded up) written to validation.jsonl, chosen by a hash of their text; 0: none."""
    write_data: bool = True
    """Write train.jsonl and validation.jsonl (false: the tokenizer only, trained on all the text)."""
    overwrite: bool = False
    """Replace an existing output file or an earlier qkvflow output folder (refused without it)."""


def draccus_args(argv: list[str]) -> list[str]:
    """argv as draccus reads it: `--files a b c` (the values up to the next `--option`) becomes one YAML
    list, and a bare `--overwrite` / `--write_data` gets the value `true`."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg in LIST_OPTIONS:
            values = []
            while i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                values.append(argv[i + 1])
                i += 1
            out += [arg, json.dumps(values)]
        elif arg.startswith(tuple(f"{o}=" for o in LIST_OPTIONS)):
            key, value = arg.split("=", 1)
            out += [key, value if value.lstrip().startswith("[") else json.dumps([value])]
        elif arg in FLAGS and (i + 1 == len(argv) or argv[i + 1].startswith("--")):
            out += [arg, "true"]
        else:
            out.append(arg)
        i += 1
    return out


def run(config: TokenizerConfig, say=print) -> dict:
    if not config.output:
        raise UserError("--output is missing: expected the folder to write the tokenizer (and the jsonl) to")
    built = build_tokenizer_folder(
        config.files, config.output, vocab_size=config.vocab_size, kind=config.kind, text_key=config.text_key,
        chunk_chars=config.chunk_chars, validation_fraction=config.validation_fraction,
        write_data=config.write_data, overwrite=config.overwrite, say=say,
    )  # fmt: skip
    kind = "byte-level BPE" if built.kind == "bpe" else "character-level"
    say(f"wrote {built.output}:")
    say(f"  tokenizer: {built.vocab_size} tokens ({kind}); {EOS} is id {built.eos_id} (bos and eos)")
    if built.kind == "bpe" and built.requested_vocab_size not in (None, built.vocab_size):
        say(
            f"  note: the text ran out of pairs to merge at {built.vocab_size} of the {built.requested_vocab_size} tokens asked for"
        )
    if config.write_data:
        say(f"  train.jsonl: {built.train_documents} documents")
        if built.validation_documents:
            say(f"  validation.jsonl: {built.validation_documents} documents")
    if config.write_data:
        say("next: qkvflow train --config_path configs/own_text.yaml" + _paths_hint(built))
    else:
        say(f"next: set data.tokenizer to {built.output} in a training config")
    return {"output": built.output, "vocab_size": built.vocab_size, "files": built.files}


def _paths_hint(built) -> str:
    """The overrides that point configs/own_text.yaml (written for --output cache/own_text) at this output."""
    out = built.output
    if os.path.normpath(out) == os.path.join("cache", "own_text") and built.validation_documents:
        return ""
    train = f"[{os.path.join(out, 'train.jsonl')}]"
    valid = f"[{os.path.join(out, 'validation.jsonl')}]" if built.validation_documents else "[]"
    return (
        f" --data.tokenizer {shlex.quote(out)} --data.cache_dir {shlex.quote(os.path.join(out, 'levanter_cache'))}"
        f" --data.components.own_text.source.train_urls {shlex.quote(train)}"
        f" --data.components.own_text.source.validation_urls {shlex.quote(valid)}"
    )


def main(argv: list[str]) -> int:
    if usage.wants_help(argv):
        print(usage.short_help("qkvflow tokenizer", TokenizerConfig, __doc__.split("\n\n")[0]).replace(
            "--config_path CFG [--dotted.key value ...]", "--files A.txt B.jsonl --output DIR [--vocab_size N] [--kind bpe|char]"
        ))  # fmt: skip
        return 0
    config = configfile.parse(TokenizerConfig, draccus_args(usage.full_listing_args(argv)), "tokenizer")
    run(config, say=lambda line: print(line, flush=True))
    return 0
