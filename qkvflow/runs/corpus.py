"""The corpus a run's config names, resolved: `with_corpus` builds the configured offline corpus (training
its tokenizer the first time) and points the config's `data` at its files and tokenizer. Every verb that
reads a run's data goes through it (`train`, `finetune`, `eval`, `generate`, `analyze`, loading a model).
"""

import dataclasses
import os

from qkvflow.data.corpora import check_corpus, prepare_corpus
from qkvflow.errors import UserError
from qkvflow.runs.config import TrainConfig


def with_corpus(config: TrainConfig) -> TrainConfig:
    """Build the configured offline corpus (if any) and point `data` at its files and tokenizer."""
    if config.corpus is None:
        return config
    c = config.corpus
    check_corpus(c)
    try:
        corpus = prepare_corpus(c.name, c.root, vocab_size=c.vocab_size)
    except (ValueError, RuntimeError) as e:  # e.g. a vocabulary size the corpus cannot have
        raise UserError(f"corpus: {e}") from None
    data = corpus.data_config(c.name, config.data, eval_split=c.eval_split)
    return dataclasses.replace(config, data=data)


def announce_corpus(config) -> None:
    """Say which corpus is prepared (building it trains a tokenizer); printed before JAX starts, so by
    every process."""
    if config.corpus is not None:
        print(
            f"preparing corpus {config.corpus.name} in {os.path.join(config.corpus.root, config.corpus.name)} ...",
            flush=True,
        )
