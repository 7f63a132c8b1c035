"""A user's own files read with a prepared corpus's tokenizer: the `data.*` keys kept beside `corpus:`.

A config with a `corpus:` section has its `data` built by `PreparedCorpus.data_config`: one component
named after the corpus, the corpus's tokenizer and a token cache inside the corpus folder. Of what the
config or the command line set under `data`, the rule is:

* `data.components.<corpus>.source.train_urls` and `.validation_urls` replace the corpus's files of that
  split (`qkvflow eval ... --data.components.pydoc.source.validation_urls '[other.jsonl]'` scores
  other.jsonl). Their token cache is a folder of its own inside the corpus folder, named by a sha256 of
  the URLs and of the bytes of every local file they match, because Levanter reuses a cache by its folder
  alone: a cache shared with the corpus's files would be read as these files' tokens.
* `data.tokenizer`, `data.cache_dir` and other components would be replaced by the corpus's, so they are
  refused in one line (`own_keys`), never dropped in silence.
* every other `data.*` key (shuffle, batching, ...) is kept as it is.
"""

from __future__ import annotations

import glob
import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

from qkvflow.errors import UserError

if TYPE_CHECKING:
    from levanter.data.text import LmDataConfig

SPLITS = ("train_urls", "validation_urls")


def own_urls(base: "LmDataConfig | None", name: str, corpus: dict[str, list[list[str]]]) -> dict[str, list[str]]:
    """The URL lists that `base` sets on the corpus's component `name`, by field of `SPLITS`, other than
    the corpus's own lists of that field (`corpus`; so a data config built from the corpus is read back
    as it was built) and empty ones (Levanter's default)."""
    from levanter.data.text import UrlDatasetSourceConfig

    component = (base.components or {}).get(name) if base is not None else None
    source = getattr(component, "source", None)
    if component is None or source is None:
        return {}
    if not isinstance(source, UrlDatasetSourceConfig):
        raise UserError(
            f"data.components.{name}.source: beside corpus: {name} only train_urls and validation_urls "
            f"of a url source are read (got a {type(source).__name__})"
        )
    urls = {key: list(getattr(source, key)) for key in SPLITS}
    return {key: value for key, value in urls.items() if value and value not in corpus.get(key, [])}


def own_keys(base: "LmDataConfig | None", name: str, tokenizer: str, folder: Path) -> None:
    """UserError naming the first `data` key of `base` that the corpus `name` would replace: a tokenizer
    other than Levanter's default and the corpus's own, a cache folder outside the corpus folder, or a
    component other than `name`."""
    from levanter.data.text import LmDataConfig

    if base is None:
        return
    default = LmDataConfig()
    how = (
        f"beside corpus: {name} the data is the corpus's, read with its tokenizer; other text is evaluated with "
        f"--data.components.{name}.source.validation_urls '[file.jsonl]', "
        "or drop corpus: and give a whole data: section"
    )
    if base.tokenizer not in (default.tokenizer, tokenizer):
        raise UserError(f"data.tokenizer={base.tokenizer!r} is refused: {how}")
    cache = base.cache_dir
    if cache not in (None, default.cache_dir) and not Path(cache).resolve().is_relative_to(folder.resolve()):
        raise UserError(f"data.cache_dir={cache!r} is refused: {how}")
    others = sorted(set(base.components or {}) - {name})
    if others:
        raise UserError(f"data.components.{others[0]} is refused: {how}")


def cache_key(urls: dict[str, list[str]]) -> str:
    """sha256 (16 hex digits) of the URL lists and of the bytes of every local file they match (a
    glob pattern expanded, sorted); a local path that matches no file is refused in one line."""
    digest = hashlib.sha256()
    for key in SPLITS:
        for url in urls.get(key, []):
            digest.update(f"{key}\0{url}\0".encode())
            if "://" in url and not url.startswith("file://"):
                continue  # a remote file: keyed by its URL
            path = url.removeprefix("file://")
            matches = sorted(glob.glob(path, recursive=True)) if any(c in path for c in "*?[") else [path]
            files = [m for m in matches if os.path.isfile(m)]
            if not files:
                raise UserError(f"data.components.*.source.{key}: {url!r} is not a file (relative to {os.getcwd()})")
            for f in files:
                digest.update(os.path.abspath(f).encode() + b"\0")
                with open(f, "rb") as stream:
                    for block in iter(lambda: stream.read(1 << 20), b""):
                        digest.update(block)
    return digest.hexdigest()[:16]
