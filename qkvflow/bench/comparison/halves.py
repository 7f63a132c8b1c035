"""Selection and test halves of a study's own data, for `qkvflow bench compare` on a base config with a
`data:` section instead of a bundled `corpus:` (any folder made by `qkvflow tokenizer`, or any jsonl files
with a tokenizer).

A bundled corpus ships its halves (`qkvflow.data.corpora`: the validation documents at even positions
are `selection`, those at odd positions `test`). The same rule is applied here to each `url` component's
validation documents, in the order of its `validation_urls` and of their lines: line 0, 2, 4, ... (the
blank lines skipped) go to `<workdir>/data/<component>.selection.jsonl`, lines 1, 3, 5, ... to
`<component>.test.jsonl`, copied verbatim (so the component's `format` still reads them). The halves
depend on the files' contents only, and are disjoint.

A run of the study evaluates on one half (`point_at`): each component's `validation_urls` replaced by
that half, and a token cache of the half's own (`<workdir>/data/cache_<half>`). Relative paths of the
base config (the tokenizer, the jsonl files) are taken from the folder the study is started in, where
`qkvflow train --config_path BASE` would read them.
"""

import copy
import os
from pathlib import Path

from qkvflow.errors import UserError

HALVES = ("selection", "test")


def _local(path: str) -> str:
    """`path` made absolute when it is a local path that exists from here (else as given: a hub id)."""
    return os.path.abspath(path) if "://" not in path and os.path.exists(path) else path


def check(base_file: str, config: dict) -> dict:
    """`config` (a study's base config with a `data:` section) with its local paths made absolute;
    UserError in one line naming `base_file` and the key unless every component is a `url` source
    whose validation files are local jsonl files with at least two documents in all."""
    data = config.get("data")
    where = f"bench compare: base {base_file}"
    if not isinstance(data, dict) or not isinstance(data.get("components"), dict) or not data["components"]:
        raise UserError(
            f"{where}: expected a `corpus:` section or a `data:` section with `components` "
            "(e.g. the one configs/own_text.yaml has for a `qkvflow tokenizer` folder)"
        )
    config = copy.deepcopy(config)
    data = config["data"]
    if isinstance(data.get("tokenizer"), str):
        data["tokenizer"] = _local(data["tokenizer"])
    for name, component in data["components"].items():
        source = component.get("source") if isinstance(component, dict) else None
        key = f"data.components.{name}.source"
        if not isinstance(source, dict) or source.get("type") != "url":
            raise UserError(f"{where}: {key}: expected `type: url` with train_urls and validation_urls (jsonl files)")
        urls = source.get("validation_urls")
        if not isinstance(urls, list) or not urls:
            raise UserError(f"{where}: {key}.validation_urls is empty: its selection and test halves come from it")
        for field in ("train_urls", "validation_urls"):
            source[field] = [_local(str(u)) for u in source.get(field) or []]
        for url in source["validation_urls"]:
            if "://" in url or not url.endswith(".jsonl") or not os.path.isfile(url):
                raise UserError(
                    f"{where}: {key}.validation_urls: {url!r} is not a local .jsonl file: expected the "
                    "validation.jsonl of a `qkvflow tokenizer` folder or another jsonl file"
                )
        documents = len(_documents(source["validation_urls"]))
        if documents < 2:
            raise UserError(
                f"{where}: {key}.validation_urls hold {documents} document(s): expected at least 2, one for each "
                "of the selection and test halves"
            )
    return config


def _documents(urls: list[str]) -> list[bytes]:
    lines = []
    for url in urls:
        with open(url, "rb") as f:
            lines += [line if line.endswith(b"\n") else line + b"\n" for line in f if line.strip()]
    return lines


def write(config: dict, workdir: Path) -> None:
    """Write each component's halves into `<workdir>/data` (the study's own folder); a rewrite of the same
    files gives the same bytes, each file replaced whole."""
    folder = Path(workdir) / "data"
    folder.mkdir(exist_ok=True)
    for name, component in config["data"]["components"].items():
        documents = _documents(component["source"]["validation_urls"])
        for half, part in zip(HALVES, (documents[0::2], documents[1::2])):
            path = folder / f"{name}.{half}.jsonl"
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(b"".join(part))
            os.replace(tmp, path)


def point_at(config: dict, workdir: Path, half: str) -> dict:
    """`config` evaluating on `half` of each component's validation documents, with that half's token cache."""
    config = copy.deepcopy(config)
    data = config["data"]
    folder = Path(workdir) / "data"
    for name, component in data["components"].items():
        component["source"]["validation_urls"] = [str(folder / f"{name}.{half}.jsonl")]
        component.pop("cache_dir", None)
    data["cache_dir"] = str(folder / f"cache_{half}")
    return config
