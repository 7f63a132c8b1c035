"""Tests for qkvflow.data.corpora: offline corpora, local tokenizers, and Levanter consuming them."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ[_var] = "1"
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from pydoc_data.topics import topics  # noqa: E402

from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: E402

from qkvflow.data.corpora import EOS, PreparedCorpus, default_shared_dir, prepare_corpus  # noqa: E402

SHAKESPEARE = default_shared_dir() / "data" / "tinyshakespeare" / "input.txt"
needs_shakespeare = pytest.mark.skipif(
    not SHAKESPEARE.is_file(), reason=f"{SHAKESPEARE} absent (set QKVFLOW_SHARED_DIR to the folder holding data/)"
)


def _docs(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail any Python-level connection to a non-local host (e.g. a Hugging Face Hub lookup)."""
    connect = socket.socket.connect

    def guarded(self: socket.socket, address):  # type: ignore[no-untyped-def]
        host = address[0] if isinstance(address, tuple) else address
        if isinstance(host, str) and not (host.startswith("127.") or host in ("localhost", "::1") or "/" in host):
            raise AssertionError(f"network access attempted: {address}")
        return connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)


@pytest.fixture(scope="module")
def pydoc(tmp_path_factory: pytest.TempPathFactory) -> PreparedCorpus:
    return prepare_corpus("pydoc", str(tmp_path_factory.mktemp("corpora")))


def test_pydoc_split_is_disjoint_deterministic_and_complete(pydoc: PreparedCorpus) -> None:
    train, validation = _docs(pydoc.train_urls[0]), _docs(pydoc.validation_urls[0])
    distinct = []  # one document per distinct text, ordered by the first (sorted) key showing it
    for key in sorted(topics):
        if topics[key] not in distinct:
            distinct.append(topics[key])
    assert len(distinct) < len(topics)  # e.g. "if" and "else" share a page: must not straddle the split
    assert validation == distinct[::10]  # documented rule: index i % 10 == 0 goes to validation
    assert train == [d for i, d in enumerate(distinct) if i % 10]
    assert set(train) | set(validation) == set(topics.values())
    assert not set(train) & set(validation) and len(train) + len(validation) == len(distinct)
    manifest = json.loads((Path(pydoc.tokenizer).parent / "manifest.json").read_text())
    assert manifest["vocab_size"] == 2048
    assert (manifest["train_docs"], manifest["validation_docs"]) == (len(train), len(validation))


def test_selection_and_test_halves_partition_validation(pydoc: PreparedCorpus) -> None:
    """The documented rule: the even-positioned held-out documents choose, the odd-positioned report."""
    folder = Path(pydoc.tokenizer).parent
    validation = _docs(pydoc.validation_urls[0])
    selection, test = _docs(str(folder / "selection.jsonl")), _docs(str(folder / "test.jsonl"))
    assert selection == [d for i, d in enumerate(validation) if i % 2 == 0]
    assert test == [d for i, d in enumerate(validation) if i % 2 == 1]
    assert len(selection) - len(test) in (0, 1) and test and not set(selection) & set(test)
    for split, docs in (("validation", validation), ("selection", selection), ("test", test)):
        data = pydoc.data_config("pydoc", eval_split=split)
        (component,) = data.components.values()
        assert _docs(component.source.validation_urls[0]) == docs
        assert component.source.train_urls == pydoc.train_urls
        caches = {
            pydoc.data_config("pydoc", eval_split=other).cache_dir for other in ("validation", "selection", "test")
        }
        assert len(caches) == 3  # a split's cache is never reused for another split
    with pytest.raises(ValueError, match="eval_split='tset'"):
        pydoc.data_config("pydoc", eval_split="tset")


def test_pydoc_tokenizer_loads_offline_and_round_trips(pydoc: PreparedCorpus) -> None:
    tok = AutoTokenizer.from_pretrained(pydoc.tokenizer)
    assert len(tok) == 2048
    assert tok.bos_token == tok.eos_token == EOS
    assert tok.bos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids(EOS)
    unseen = _docs(pydoc.validation_urls[0])  # not used to train the tokenizer
    for doc in unseen + ["naïve “quotes” — 1 + 1 == 2\n\n  indented\tTAB"]:
        ids = tok(doc)["input_ids"]
        assert ids[0] == ids[-1] == tok.eos_token_id and tok.eos_token_id not in ids[1:-1]
        assert tok.decode(ids, skip_special_tokens=True) == doc
        assert tok.decode(tok(doc, add_special_tokens=False)["input_ids"]) == doc
    n_chars = sum(map(len, unseen))
    n_tokens = sum(len(tok(d, add_special_tokens=False)["input_ids"]) for d in unseen)
    assert n_tokens < n_chars / 2.5  # merges were learned, not a byte-level fallback


def test_pydoc_second_call_is_a_cache_hit_and_rebuilds_on_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = prepare_corpus("pydoc", str(tmp_path), vocab_size=300)
    out = tmp_path / "pydoc"
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    assert prepare_corpus("pydoc", str(tmp_path), vocab_size=300) == first
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == stamps

    with monkeypatch.context() as m:  # a rebuild dying halfway leaves the old corpus untouched
        m.setattr(PreTrainedTokenizerFast, "save_pretrained", lambda *a, **k: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            prepare_corpus("pydoc", str(tmp_path), vocab_size=320)
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == stamps
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pydoc"]

    prepare_corpus("pydoc", str(tmp_path), vocab_size=320)  # different key -> rebuilt
    assert len(AutoTokenizer.from_pretrained(first.tokenizer)) == 320

    assert sorted(p.name for p in tmp_path.iterdir()) == ["pydoc"]  # no temp/stale dirs left


def test_a_folder_that_is_not_a_build_of_the_corpus_is_never_replaced(tmp_path: Path) -> None:
    """A `pydoc` folder without a manifest naming the corpus is not provably ours: refused, untouched."""
    from qkvflow.errors import UserError

    for manifest in (None, '{"name": "tinyshakespeare", "format_version": 1}', "{not json"):
        out = tmp_path / "pydoc"
        out.mkdir()
        (out / "thesis.tex").write_text("years of work")
        if manifest is not None:
            (out / "manifest.json").write_text(manifest)
        before = {p.name: p.read_bytes() for p in out.iterdir()}
        with pytest.raises(UserError, match=f"corpus: {out} exists but is not a qkvflow build of the pydoc corpus"):
            prepare_corpus("pydoc", str(tmp_path), vocab_size=300)
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
        assert sorted(p.name for p in tmp_path.iterdir()) == ["pydoc"]
        for p in out.iterdir():
            p.unlink()
        out.rmdir()


@needs_shakespeare
def test_tinyshakespeare_char_level(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QKVFLOW_SHARED_DIR", str(SHAKESPEARE.parents[2]))
    corpus = prepare_corpus("tinyshakespeare", str(tmp_path))
    text = SHAKESPEARE.read_text(encoding="utf-8")
    n = int(len(text) * 0.9)
    train, validation = _docs(corpus.train_urls[0]), _docs(corpus.validation_urls[0])
    assert "".join(train) == text[:n] and "".join(validation) == text[n:]
    assert len(train) > 50 and all(len(d) >= 10_000 and d.endswith("\n") for d in train[:-1])

    tok = AutoTokenizer.from_pretrained(corpus.tokenizer)
    chars = sorted(set(text))
    assert len(chars) == 65 and len(tok) == 66
    assert tok.convert_ids_to_tokens(list(range(65))) == chars  # nanoGPT's stoi ordering
    assert tok.eos_token_id == tok.bos_token_id == 65
    ids = tok(text[n:], add_special_tokens=False)["input_ids"]
    assert ids == [chars.index(c) for c in text[n:]]  # exactly one token per character
    assert tok.decode(ids) == text[n:]
    assert tok.decode(tok(" a  b\n\n")["input_ids"], skip_special_tokens=True) == " a  b\n\n"


def test_missing_shakespeare_and_unknown_name_raise(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="QKVFLOW_SHARED_DIR") as err:
        prepare_corpus("tinyshakespeare", str(tmp_path / "out"), shared_dir=str(tmp_path))
    assert str(tmp_path / "data" / "tinyshakespeare" / "input.txt") in str(err.value)
    with pytest.raises(ValueError, match="pydoc, tinyshakespeare"):
        prepare_corpus("wikitext", str(tmp_path))
    assert not (tmp_path / "out").exists() and not (tmp_path / "wikitext").exists()


@pytest.mark.slow  # ~90 s; every training test also reads the pydoc corpus through Levanter
def test_levanter_reads_pydoc_offline(pydoc: PreparedCorpus, tmp_path: Path) -> None:
    """The corpus as `qkvflow train` hands it to Levanter (`corpus:` -> one url component of an
    LmDataConfig, qkvflow.runs.corpus.with_corpus): the cache builds offline and its examples are the
    documents' tokens in order, nothing inserted or dropped."""
    import dataclasses

    import haliax as hax
    import jax
    from levanter.data.text import LmDataConfig, UrlDatasetSourceConfig
    from levanter.schedule import BatchSchedule

    from qkvflow.runs.config import CorpusConfig, TrainConfig
    from qkvflow.runs.corpus import with_corpus

    root = str(Path(pydoc.tokenizer).parents[1])  # the fixture's corpus root (a cache hit below)
    config = with_corpus(TrainConfig(data=LmDataConfig(shuffle=False), corpus=CorpusConfig(name="pydoc", root=root)))
    ((name, component),) = config.data.components.items()
    assert name == "pydoc" and isinstance(component.source, UrlDatasetSourceConfig)
    assert component.source.train_urls == list(pydoc.train_urls)
    assert component.source.validation_urls == list(pydoc.validation_urls)
    assert config.data.tokenizer == pydoc.tokenizer
    data = dataclasses.replace(config.data, cache_dir=str(tmp_path / "cache"))
    data.build_caches("train")
    assert (tmp_path / "cache" / "pydoc" / "train" / "shard_ledger.json").is_file()

    # the finished cache is now loaded from disk: the component's token dataset, in document order
    Pos = hax.Axis("position", 64)
    (split,) = data.train_sets(Pos, key=jax.random.PRNGKey(0)).values()
    dataset = split.as_sync_dataset()
    tok = AutoTokenizer.from_pretrained(pydoc.tokenizer)  # the HF tokenizer Levanter's MarinTokenizer wraps
    docs = _docs(pydoc.train_urls[0])
    # every document framed as EOS ... EOS by the tokenizer itself, so Levanter splices in nothing
    stream = [i for doc in docs for i in tok(doc)["input_ids"]]
    assert len(dataset) == len(stream) // 64
    first = dataset[0].tokens.tolist()
    assert first == stream[:64] and first[0] == tok.eos_token_id
    assert docs[0].startswith(tok.decode(first, skip_special_tokens=True))
    last = len(dataset) - 1  # no token inserted or dropped anywhere before the last example
    assert dataset[last].tokens.tolist() == stream[64 * last : 64 * (last + 1)]

    # what the trainer reads (train_set): marin-levanter's mixture visits blocks of the component in a
    # random order even with shuffle: false and one component; every example is still one of the above
    train = data.train_set(Pos, BatchSchedule(8), key=jax.random.PRNGKey(0)).as_sync_dataset()
    examples = {tuple(stream[64 * k : 64 * (k + 1)]) for k in range(len(dataset))}
    assert all(tuple(train[k].tokens.array.tolist()) in examples for k in (0, 1, len(dataset) - 1))
