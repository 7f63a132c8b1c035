"""Offline corpora with locally trained tokenizers, laid out for Levanter's data pipeline.

``prepare_corpus(name, root)`` writes ``<root>/<name>/{train,validation}.jsonl`` (one ``{"text": ...}``
document per line), a Hugging Face tokenizer directory ``<root>/<name>/tokenizer`` and a
``manifest.json``; nothing is ever downloaded.

The validation documents are also written as two disjoint halves, ``selection.jsonl`` (even positions)
and ``test.jsonl`` (odd positions), so that a study can choose hyperparameters on one and report on
the other (``EVAL_SPLITS``; `qkvflow bench compare`). Training evaluates on ``validation`` (both
halves) unless the config's ``corpus.eval_split`` says otherwise.

Special tokens: ``<|endoftext|>`` is both bos and eos, and the tokenizer's post-processor already wraps
every encoded text as ``<|endoftext|> text <|endoftext|>``. Levanter's ``BatchTokenizer`` probes
``tokenizer("hi there")``, sees both tokens present and therefore adds nothing itself (otherwise it would
splice ``bos + " "`` and ``" " + eos`` into the raw string, i.e. extra space tokens). So this tokenizer must
keep appending EOS for training; for a prompt that ending means "document over". The copy that
``qkvflow export`` and ``qkvflow finetune`` write (``qkvflow.export.hf_folder.prompt_tokenizer``) keeps the leading
``<|endoftext|>`` and drops the trailing one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from tokenizers import Tokenizer

from qkvflow.data import own_files
from qkvflow.data.tokenizer import CHUNK_CHARS, EOS  # noqa: F401  (EOS: re-exported)
from qkvflow.data.tokenizer import bpe_tokenizer as _bpe_tokenizer
from qkvflow.data.tokenizer import char_tokenizer as _char_tokenizer
from qkvflow.data.tokenizer import chunk as _chunk
from qkvflow.data.tokenizer import wrap as _wrap
from qkvflow.errors import UserError

if TYPE_CHECKING:
    from levanter.data.text import LmDataConfig

NAMES = ("pydoc", "tinyshakespeare")
EVAL_SPLITS = ("validation", "selection", "test")
"""Held-out documents: all of them, the even-positioned half (for choosing), the odd-positioned half (for reporting)."""
DEFAULT_PYDOC_VOCAB = 2048
_FORMAT_VERSION = 2  # bump when the on-disk layout or tokenizer recipe changes (2: selection/test halves)


@dataclass(frozen=True)
class PreparedCorpus:
    """Local files of a prepared corpus, ready for Levanter's ``LmDataConfig`` (`data_config`)."""

    train_urls: list[str]  # jsonl paths, each line {"text": ...}
    validation_urls: list[str]
    tokenizer: str  # local directory loadable with AutoTokenizer.from_pretrained(path) offline

    def data_config(
        self, name: str, base: "LmDataConfig | None" = None, eval_split: str = "validation"
    ) -> "LmDataConfig":
        """`base` (Levanter's `LmDataConfig`; its defaults if None) reading this corpus: one `url`
        component called `name` that evaluates on `eval_split` (`EVAL_SPLITS`), this tokenizer, and the
        token cache inside the corpus folder. The train or validation URLs that `base` sets on the
        component `name` replace the corpus's files of that split (qkvflow.data.own_files, which also
        refuses the `data` keys that the corpus would replace).

        Levanter reuses an existing cache by folder alone (a changed tokenizer only logs a warning), so
        the cache lives inside the corpus folder, which is replaced whenever the corpus is rebuilt; each
        eval split has its own cache folder, so that one split's cache is never read as another's, and
        own files have one named by their contents (`own_files.cache_key`).
        """
        import dataclasses

        from levanter.data.text import DatasetComponent, LmDataConfig, UrlDatasetSourceConfig

        if eval_split not in EVAL_SPLITS:
            raise ValueError(f"eval_split={eval_split!r}: expected one of {', '.join(EVAL_SPLITS)}")
        folder = Path(self.tokenizer).parent
        own_files.own_keys(base, name, self.tokenizer, folder)
        splits = {s: [str(folder / f"{s}.jsonl")] for s in EVAL_SPLITS} | {"validation": list(self.validation_urls)}
        corpus_urls = {"train_urls": [list(self.train_urls)], "validation_urls": list(splits.values())}
        own = own_files.own_urls(base, name, corpus_urls)
        urls = {"train_urls": list(self.train_urls), "validation_urls": splits[eval_split], **own}
        source = UrlDatasetSourceConfig(**urls)
        cache = "levanter_cache" if eval_split == "validation" else f"levanter_cache_{eval_split}"
        component = DatasetComponent(source=source)
        if own:  # a component's own cache folder holds <split>/ directly (Levanter's _component_cache_dir)
            own_cache = folder / "levanter_cache_own" / own_files.cache_key(urls)
            component = dataclasses.replace(component, cache_dir=str(own_cache))
        return dataclasses.replace(
            base or LmDataConfig(),
            tokenizer=self.tokenizer,
            components={name: component},
            train_weights={name: 1.0},
            cache_dir=str(folder / cache),
        )


def default_shared_dir() -> Path:
    """``$QKVFLOW_SHARED_DIR`` if set, else the ``shared`` folder beside the project root."""
    env = os.environ.get("QKVFLOW_SHARED_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2].parent / "shared"


def prepare_corpus(
    name: str, root: str, *, vocab_size: int | None = None, shared_dir: str | None = None
) -> PreparedCorpus:
    """Build (or reuse) the corpus ``name`` under ``<root>/<name>`` and return its paths.

    * ``pydoc``: CPython's ``pydoc_data.topics.topics``, one document per distinct topic text (keys that
      share a text, like "if"/"else", would otherwise leak across the split), ordered by first key;
      every 10th document (index ``i % 10 == 0``) goes to validation. A byte-level BPE
      tokenizer (``vocab_size``, default 2048, counting ``<|endoftext|>``) is trained on train only.
    * ``tinyshakespeare``: ``<shared_dir>/data/tinyshakespeare/input.txt``. nanoGPT split: first 90% of
      characters train, the rest validation, each cut into ~10k-character documents at line ends so that
      concatenating them gives the split back exactly. Character-level tokenizer: ids 0..64 are the
      sorted characters of the whole file (nanoGPT's ``stoi``), id 65 is ``<|endoftext|>``.

    Reuses existing output when ``manifest.json`` matches (source sha256, vocab size, format version);
    otherwise builds in a temporary directory and renames it into place, so a partial build is never used.
    An existing ``<root>/<name>`` is replaced only if it is an earlier build of this corpus (its
    ``manifest.json`` names it); any other folder there raises ``UserError`` and is left alone.
    """
    vocab = corpus_vocab_size(name, vocab_size=vocab_size, shared_dir=shared_dir)
    if name == "pydoc":
        train, validation, digest = _pydoc_source()
        build: Callable[[], Tokenizer] = partial(_bpe_tokenizer, train, vocab)
    else:
        train, validation, digest, chars = _shakespeare_source(shared_dir)
        build = partial(_char_tokenizer, chars)

    out = Path(root).resolve() / name
    key = {"name": name, "format_version": _FORMAT_VERSION, "source_sha256": digest, "vocab_size": vocab}
    if not _is_cached(out, key):
        _check_replaceable(out, name)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=out.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private
        try:
            _write_jsonl(tmp / "train.jsonl", train)
            _write_jsonl(tmp / "validation.jsonl", validation)
            _write_jsonl(tmp / "selection.jsonl", validation[0::2])
            _write_jsonl(tmp / "test.jsonl", validation[1::2])
            hf = _wrap(build())
            if len(hf) != vocab:
                raise RuntimeError(f"{name}: tokenizer has {len(hf)} tokens, expected {vocab}")
            hf.save_pretrained(str(tmp / "tokenizer"))
            manifest = {**key, "train_docs": len(train), "validation_docs": len(validation)}
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")  # written last
            try:
                _publish(tmp, out, name)
            except OSError:
                if not _is_cached(out, key):  # else a concurrent identical build published first
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone already if it was published
    return PreparedCorpus([str(out / "train.jsonl")], [str(out / "validation.jsonl")], str(out / "tokenizer"))


def corpus_vocab_size(name: str, *, vocab_size: int | None = None, shared_dir: str | None = None) -> int:
    """The number of tokens of the tokenizer ``prepare_corpus(name, ..., vocab_size=vocab_size)`` builds,
    without building anything (``qkvflow describe`` counts embeddings with it)."""
    if name == "pydoc":
        return DEFAULT_PYDOC_VOCAB if vocab_size is None else vocab_size
    if name == "tinyshakespeare":
        vocab = len(_shakespeare_source(shared_dir)[3]) + 1
        if vocab_size not in (None, vocab):
            raise ValueError(f"tinyshakespeare is character-level: vocab_size must be {vocab}, got {vocab_size}")
        return vocab
    raise ValueError(f"unknown corpus {name!r}; expected one of {', '.join(NAMES)}")


def _pydoc_source() -> tuple[list[str], list[str], str]:
    from pydoc_data.topics import topics

    digest = hashlib.sha256(json.dumps(topics, sort_keys=True).encode()).hexdigest()
    docs = list(dict.fromkeys(topics[k] for k in sorted(topics)))  # some keys share a text ("if", "else")
    return [d for i, d in enumerate(docs) if i % 10], docs[::10], digest


def _shakespeare_source(shared_dir: str | None) -> tuple[list[str], list[str], str, list[str]]:
    path = Path(shared_dir or default_shared_dir()) / "data" / "tinyshakespeare" / "input.txt"
    if not path.is_file():
        raise FileNotFoundError(
            f"tinyshakespeare source not found at {path}; pass shared_dir= or set QKVFLOW_SHARED_DIR"
        )
    raw = path.read_bytes()
    text = raw.decode("utf-8")
    n = int(len(text) * 0.9)
    return _chunk(text[:n]), _chunk(text[n:]), hashlib.sha256(raw).hexdigest(), sorted(set(text))


def _write_jsonl(path: Path, docs: list[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")


def _is_cached(out: Path, key: dict[str, Any]) -> bool:
    try:
        manifest = json.loads((out / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    files = ("train.jsonl", "validation.jsonl", "selection.jsonl", "test.jsonl", "tokenizer/tokenizer.json")
    return all(manifest.get(k) == v for k, v in key.items()) and all((out / f).is_file() for f in files)


def _check_replaceable(out: Path, name: str) -> None:
    """``out`` may be replaced only if it is absent or an earlier build of corpus ``name`` (what
    ``prepare_corpus`` writes: a ``manifest.json`` naming the corpus, written last)."""
    if not os.path.lexists(out):
        return
    try:
        manifest = json.loads((out / "manifest.json").read_text())
    except (OSError, ValueError):
        manifest = None
    if (
        os.path.islink(out)
        or not isinstance(manifest, dict)
        or manifest.get("name") != name
        or "format_version" not in manifest
    ):
        raise UserError(
            f"corpus: {out} exists but is not a qkvflow build of the {name} corpus (no manifest.json naming it): "
            "refusing to replace it; move it away or choose another corpus.root"
        )


def _publish(tmp: Path, out: Path, name: str) -> None:
    """Swap the finished ``tmp`` directory in for ``out`` using directory renames (``out`` was
    checked by ``_check_replaceable``, and is checked again here, just before it is moved aside)."""
    _check_replaceable(out, name)
    if out.exists():
        stale = Path(tempfile.mkdtemp(prefix=f".{out.name}.stale-", dir=out.parent))
        os.replace(out, stale / out.name)
        shutil.rmtree(stale, ignore_errors=True)
    os.replace(tmp, out)


def check_corpus(c) -> None:
    """UserError unless the `corpus:` section names a known corpus and a usable vocabulary size."""
    if c.name not in NAMES:
        raise UserError(f"corpus.name={c.name!r} is invalid: expected one of {', '.join(NAMES)}")
    if c.eval_split not in EVAL_SPLITS:
        raise UserError(f"corpus.eval_split={c.eval_split!r} is invalid: expected one of {', '.join(EVAL_SPLITS)}")
    if c.vocab_size is not None and (isinstance(c.vocab_size, bool) or c.vocab_size < 1):
        raise UserError(f"corpus.vocab_size={c.vocab_size!r} is invalid: expected null or an integer >= 1")
