"""A held-out validation split for Hugging Face datasets that ship only a train split.

OpenWebText (`Skylion007/openwebtext`) has no validation split; the paper held out 0.0005 of its
documents. YAML (a source of Levanter's `LmDataConfig`):

    data:
      components:
        owt:
          source:
            type: hf_heldout
            id: Skylion007/openwebtext
            validation_fraction: 0.0005

The rule: with `validation_fraction = f > 0`, both the "train" and the "validation" split are read
from the dataset's train split, and a document goes to validation iff

    int(blake2b(f"{split_seed}:{content}", digest_size=8)) / 2**64 < f

where `content` is the document's text (the format's `text_key`), or its JSON for non-text formats.
The assignment depends on the content alone (not on sharding, streaming or order), so the two sets
are disjoint, cover every document, are the same on every run and machine, and identical
documents always land on the same side. With f = 0 this is exactly Levanter's `hf` source
(`HfDatasetSourceConfig`).

Levanter's own `num_validation_sequences` holds out sequences of the tokenized stream instead, so a
document can be cut between the two sets; this rule keeps whole documents apart, as the paper did.

Levanter caches each split under `cache_dir/<component>/<split>` and reuses a cache by folder name:
change `cache_dir` when you change `validation_fraction` or `split_seed`.
"""

import hashlib
import itertools
import json
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

from levanter.data.sharded_datasource import ShardedDataSource
from levanter.data.text import HfDatasetSourceConfig, LmDatasetSourceConfigBase, TextLmDatasetFormat

from qkvflow.errors import check as _check


def in_validation(content: str, fraction: float, seed: int = 0) -> bool:
    """Whether a document with this content is held out (see the module docstring)."""
    digest = hashlib.blake2b(f"{seed}:{content}".encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < fraction


class HeldOutSplitDataSource(ShardedDataSource[dict]):
    """The documents of `source` on one side of the held-out rule: those in validation if
    `validation`, else the rest. Rows (for resuming a cache build) count the kept documents."""

    def __init__(
        self,
        source: ShardedDataSource[dict],
        *,
        fraction: float,
        seed: int = 0,
        validation: bool,
        text_key: Optional[str] = "text",
    ):
        self.source, self.fraction, self.seed = source, fraction, seed
        self.validation, self.text_key = validation, text_key

    @property
    def shard_names(self) -> Sequence[str]:
        return self.source.shard_names

    def _content(self, doc: dict) -> str:
        if self.text_key is not None:
            return str(doc[self.text_key])
        return json.dumps(doc, sort_keys=True, default=str)

    def _keep(self, doc: dict) -> bool:
        return in_validation(self._content(doc), self.fraction, self.seed) == self.validation

    def open_shard_at_row(self, shard_name: str, row: int) -> Iterator[dict]:
        kept = filter(self._keep, self.source.open_shard_at_row(shard_name, 0))
        return itertools.islice(kept, row, None)


@LmDatasetSourceConfigBase.register_subclass("hf_heldout")
@dataclass(frozen=True)
class HeldOutHfDatasetSourceConfig(HfDatasetSourceConfig):
    """Levanter's Hugging Face source plus a validation split held out of the train split."""

    validation_fraction: float = 0.0
    """Fraction of the train split's documents held out as validation (0: use the dataset's own
    validation split, if any, as Levanter does). The paper: 0.0005 for OpenWebText."""
    split_seed: int = 0
    """Salt of the held-out hash; another seed gives another, equally reproducible split."""

    def __post_init__(self):
        f = self.validation_fraction
        _check(0.0 <= f < 1.0, "data.validation_fraction", f, "a fraction with 0 <= f < 1")

    def get_shard_source(self, split) -> Optional[ShardedDataSource[dict]]:
        if self.validation_fraction == 0 or split not in ("train", "validation"):
            return super().get_shard_source(split)
        source = super().get_shard_source("train")
        if source is None:
            return None
        text_key = self.format.text_key if isinstance(self.format, TextLmDatasetFormat) else None
        return HeldOutSplitDataSource(
            source,
            fraction=self.validation_fraction,
            seed=self.split_seed,
            validation=split == "validation",
            text_key=text_key,
        )
