"""What `qkvflow plan` reads: a training config, and the vocabulary to build the model with."""

from dataclasses import dataclass
from typing import Optional

from qkvflow.data.vocabulary import vocabulary as describe_vocabulary
from qkvflow.runs.config import TrainConfig


@dataclass
class PlanConfig(TrainConfig):
    vocab_size: Optional[int] = None
    """Vocabulary to build the model with; by default the one `qkvflow describe` finds (the corpus's
    tokenizer, `data.tokenizer` from a local folder or cache, GPT-2's), or a bench config's."""
    bench: Optional[dict] = None
    """A `qkvflow bench` config's own section: its `vocab_size` is used when --vocab_size is not given
    (its `batch` is not: set --trainer.train_batch_size)."""


def vocabulary(config: PlanConfig) -> int:
    if config.vocab_size is None and (config.bench or {}).get("vocab_size"):
        return int(config.bench["vocab_size"])
    return describe_vocabulary(config)[0]
