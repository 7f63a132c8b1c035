"""`qkvflow eval` on other text beside a `corpus:` section: `--data.components.<corpus>.source.validation_urls`
(docs/evaluate.md, "Other data"; qkvflow.data.own_files).

The reference is the corpus's own `test` half, evaluated with `--corpus.eval_split test`: the same file under
another name must give the same numbers, and numbers unlike the default validation set's."""

import json
import shutil

import numpy as np
import pytest

from qkvflow.cli import main as cli_main
from qkvflow.data.corpora import prepare_corpus
from qkvflow.errors import UserError
from tests.finetune_utils import TINY_TRAIN, shared_setup

EPS32 = float(np.finfo(np.float32).eps)


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    return shared_setup(tmp_path_factory)


def _loss(capfd, corpora, checkpoint, out, *extra) -> float:
    rc = cli_main([
        "eval", "--config_path", TINY_TRAIN, "--corpus.root", str(corpora), "--checkpoint", str(checkpoint),
        "--output", str(out), *extra,
    ])  # fmt: skip
    err = capfd.readouterr().err
    assert rc == 0, err[-3000:]
    (row,) = json.loads((out / "depth.json").read_text())["rows"]
    return row["loss"]


def test_validation_urls_beside_a_corpus_are_the_files_evaluated(shared, capfd, tmp_path):
    """The override's file is scored (its own token cache, not the corpus's validation cache): a copy of
    the test half gives the test half's loss to float32 round-off of two compilations of one program,
    and not the validation set's. (capfd: building a cache enables faulthandler on stderr.)"""
    corpora, pretrained = shared
    other = tmp_path / "other.jsonl"
    shutil.copyfile(corpora / "pydoc" / "test.jsonl", other)
    validation = _loss(capfd, corpora, pretrained, tmp_path / "validation")
    test_half = _loss(capfd, corpora, pretrained, tmp_path / "test", "--corpus.eval_split", "test")
    own = _loss(capfd, corpora, pretrained, tmp_path / "own",
                "--data.components.pydoc.source.validation_urls", f"[{other}]")  # fmt: skip
    assert own == pytest.approx(test_half, rel=16 * EPS32, abs=0)
    assert abs(own - validation) > 1e-3


def test_own_files_get_a_cache_of_their_own_and_a_built_config_reads_back(corpus_root, tmp_path):
    """The corpus's data config keeps own URLs, puts their cache in a folder named by the file's bytes
    (a changed file, another folder), and applied to its own output gives that output back."""
    from levanter.data.text import DatasetComponent, LmDataConfig, UrlDatasetSourceConfig

    corpus = prepare_corpus("pydoc", str(corpus_root))
    other = tmp_path / "other.jsonl"
    other.write_text('{"text": "one"}\n')
    source = UrlDatasetSourceConfig(validation_urls=[str(other)])
    base = LmDataConfig(components={"pydoc": DatasetComponent(source=source)})
    data = corpus.data_config("pydoc", base)
    source = data.components["pydoc"].source
    assert source.validation_urls == [str(other)] and source.train_urls == corpus.train_urls
    cache = data.components["pydoc"].cache_dir
    assert cache is not None and "levanter_cache_own" in cache
    assert corpus.data_config("pydoc", data) == data
    plain = corpus.data_config("pydoc")
    assert corpus.data_config("pydoc", plain) == plain and plain.components["pydoc"].cache_dir is None
    other.write_text('{"text": "two"}\n')
    assert corpus.data_config("pydoc", base).components["pydoc"].cache_dir != cache


@pytest.mark.parametrize(
    "data, message",
    [
        ({"tokenizer": "my/tokenizer"}, "data.tokenizer='my/tokenizer' is refused"),
        ({"cache_dir": "/elsewhere"}, "data.cache_dir='/elsewhere' is refused"),
        ({"components": {"mine": {}}}, "data.components.mine is refused"),
        ({"components": {"pydoc": {"validation_urls": ["absent.jsonl"]}}}, "'absent.jsonl' is not a file"),
    ],
)
def test_data_keys_that_the_corpus_would_replace_are_refused_in_one_line(corpus_root, data, message):
    from levanter.data.text import DatasetComponent, LmDataConfig, UrlDatasetSourceConfig

    corpus = prepare_corpus("pydoc", str(corpus_root))
    data = dict(data)
    own = data.pop("components", {})
    components = {k: DatasetComponent(source=UrlDatasetSourceConfig(**v)) for k, v in own.items()}
    with pytest.raises(UserError) as error:
        corpus.data_config("pydoc", LmDataConfig(components=components, **data))
    assert message in str(error.value) and "\n" not in str(error.value)
