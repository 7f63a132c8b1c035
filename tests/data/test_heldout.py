"""Tests for qkvflow.data.heldout: a validation split held out of a train-only HF dataset.

The dataset is a local folder of jsonl, which `datasets.load_dataset` (and so Levanter's
WrappedHFDataSource) reads offline as a dataset with only a train split.
"""

import hashlib
import json
import os
from pathlib import Path

import pytest

for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ[_var] = "1"

from levanter.data.sharded_datasource import ShardedDataSource  # noqa: E402
from levanter.data.text import HfDatasetSourceConfig  # noqa: E402

from qkvflow.data.heldout import HeldOutHfDatasetSourceConfig, HeldOutSplitDataSource  # noqa: E402
from qkvflow.errors import ConfigError  # noqa: E402

N_DOCS = 400


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory) -> str:
    """A train-only dataset: two jsonl shards of distinct documents."""
    root = tmp_path_factory.mktemp("train_only")
    for shard in range(2):
        with open(root / f"train-{shard}.jsonl", "w") as f:
            for i in range(shard, N_DOCS, 2):
                f.write(json.dumps({"text": f"document {i}: " + "lorem ipsum " * (i % 5)}) + "\n")
    return str(root)


def _texts(source: ShardedDataSource[dict]) -> list[str]:
    return [doc["text"] for shard in source.shard_names for doc in source.open_shard(shard)]


def _splits(config) -> tuple[list[str], list[str]]:
    return _texts(config.get_shard_source("train")), _texts(config.get_shard_source("validation"))


def test_split_is_disjoint_complete_and_about_the_fraction(dataset_dir: str) -> None:
    config = HeldOutHfDatasetSourceConfig(id=dataset_dir, validation_fraction=0.2)
    train, validation = _splits(config)
    everything = _texts(HfDatasetSourceConfig(id=dataset_dir).get_shard_source("train"))
    assert len(everything) == N_DOCS
    assert not set(train) & set(validation)
    assert sorted(train + validation) == sorted(everything)

    # The rule of the module docstring, written out: exactly these documents are held out.
    def held_out(text: str) -> bool:
        digest = hashlib.blake2b(f"0:{text}".encode("utf-8"), digest_size=8).digest()
        return int.from_bytes(digest, "big") / 2**64 < 0.2

    assert sorted(validation) == sorted(t for t in everything if held_out(t))
    # and the rule is a fair coin: Binomial(400, 0.2) has mean 80, sd 8; +-4 sd.
    assert 48 <= len(validation) <= 112


def test_split_is_deterministic_and_follows_the_seed(dataset_dir: str) -> None:
    first = _splits(HeldOutHfDatasetSourceConfig(id=dataset_dir, validation_fraction=0.2))
    again = _splits(HeldOutHfDatasetSourceConfig(id=dataset_dir, validation_fraction=0.2))
    assert first == again
    other_seed = _splits(HeldOutHfDatasetSourceConfig(id=dataset_dir, validation_fraction=0.2, split_seed=1))
    assert set(other_seed[1]) != set(first[1])


def test_zero_fraction_behaves_like_levanter(dataset_dir: str) -> None:
    ours = HeldOutHfDatasetSourceConfig(id=dataset_dir)
    levanter = HfDatasetSourceConfig(id=dataset_dir)
    assert ours.get_shard_source("validation") is None  # no validation split in the dataset
    assert levanter.get_shard_source("validation") is None
    assert type(ours.get_shard_source("train")) is type(levanter.get_shard_source("train"))
    assert _texts(ours.get_shard_source("train")) == _texts(levanter.get_shard_source("train"))


@pytest.mark.parametrize("fraction", [-0.1, 1.0, 1.5, float("nan")])
def test_bad_fraction_raises(fraction: float) -> None:
    with pytest.raises(ValueError, match="data.validation_fraction"):
        HeldOutHfDatasetSourceConfig(id="unused", validation_fraction=fraction)
    with pytest.raises(ConfigError):
        HeldOutHfDatasetSourceConfig(id="unused", validation_fraction=fraction)


class _FakeSource(ShardedDataSource[dict]):
    def __init__(self, shards: dict[str, list[dict]]):
        self.shards = shards

    @property
    def shard_names(self) -> list[str]:
        return list(self.shards)

    def open_shard_at_row(self, shard_name: str, row: int):
        return iter(self.shards[shard_name][row:])


def test_rows_count_kept_documents_for_resumed_reads() -> None:
    """Levanter resumes a cache build at a row of the (filtered) source: rows index kept docs."""
    source = _FakeSource({"a": [{"text": f"doc {i}"} for i in range(200)]})
    held = HeldOutSplitDataSource(source, fraction=0.5, seed=3, validation=True)
    kept = list(held.open_shard("a"))
    assert 0 < len(kept) < 200
    assert list(held.open_shard_at_row("a", 7)) == kept[7:]


def test_non_text_formats_hash_the_whole_document() -> None:
    docs = [{"messages": [{"role": "user", "content": f"hi {i}"}]} for i in range(100)]
    source = _FakeSource({"a": docs})
    sides = [
        list(HeldOutSplitDataSource(source, fraction=0.3, validation=v, text_key=None).open_shard("a"))
        for v in (False, True)
    ]
    assert len(sides[0]) + len(sides[1]) == 100 and sides[1]
    assert all(doc not in sides[0] for doc in sides[1])


def test_yaml_selects_the_held_out_config(tmp_path: Path) -> None:
    import draccus

    from qkvflow.runs.config import TrainConfig
    from tests.helpers import parse_config

    path = tmp_path / "c.yaml"
    head = "data:\n  cache_dir: cache/owt\n  components:\n    owt:\n      source:\n        type: hf_heldout\n"
    path.write_text(head + "        id: Skylion007/openwebtext\n        validation_fraction: 0.0005\n")
    data = parse_config(path, TrainConfig).data.components["owt"].source
    assert isinstance(data, HeldOutHfDatasetSourceConfig)
    assert (data.id, data.validation_fraction, data.split_seed) == ("Skylion007/openwebtext", 0.0005, 0)

    path.write_text(head + "        id: Skylion007/openwebtext\n        validation_fraction: 2.0\n")
    with pytest.raises(draccus.utils.DecodingError):
        parse_config(path, TrainConfig)
