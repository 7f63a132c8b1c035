"""Checks of a run's data before anything is built: its files and formats, the tokenizer, the token count.

Part of the checks of `qkvflow.training.preflight`, which calls `check_data` in `check`. Each raises
`UserError` naming the config key or file and what was expected; none writes anything. Local files are
checked for what Levanter's URL data source reads (`FORMATS`), UTF-8 and a first valid record; files
already in the token cache are not read again.
"""

import codecs
import json
import os
import urllib.parse

from qkvflow.errors import UserError

HEAD_BYTES = 1 << 16
"""How much of each local data file is checked for UTF-8 and (jsonl) a first valid record."""

_COMPRESSED = (".gz", ".zst", ".zstd", ".bz2", ".xz", ".lz4", ".parquet", ".arrow")


FORMATS = (".jsonl", ".json", ".parquet")
"""What Levanter's URL data source (`UrlDatasetSourceConfig`, in Levanter 1.2 and marin-levanter 0.2)
reads, by the last or second-to-last extension; `.txt` is not among them (it stops with "Unknown format")."""

FORMAT_NAMES = ".jsonl, .json or .parquet"
SUPPORTED = f"{FORMAT_NAMES} (optionally compressed, e.g. .jsonl.gz)"


def _format(url: str):
    """The format Levanter reads a data file as, from its extensions as Levanter looks at them."""
    root, last = os.path.splitext(url)
    extensions = (last, os.path.splitext(root)[1])
    return next((f for f in (".jsonl", ".txt", ".json", ".parquet") if f in extensions), None)


def _check_format(key: str, url: str, text_key: str) -> None:
    fmt = _format(url)
    if fmt in FORMATS:
        return
    what = "a .txt file, which" if fmt == ".txt" else "not a format"
    raise UserError(
        f"{key}: {url!r} is {what} Levanter's URL data does not read; expected {SUPPORTED}, "
        f"e.g. jsonl with one JSON object per line and the text in its {text_key!r} field"
    )


def _local_path(url: str):
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme in ("", "file"):
        return parsed.path if parsed.scheme else url
    return None  # remote (gs://, hf://, https://): checked by Levanter when read


def _expand(key: str, url: str) -> list:
    """The files a local URL names: Levanter expands braces and globs (fsspec) and reads whatever matches."""
    from levanter.utils.fsspec_utils import expand_glob

    path = _local_path(url)
    if path is None or not any(c in path for c in "*?{["):
        return [url]
    matches = list(expand_glob(path))
    if not matches:
        raise UserError(f"{key}: {url!r} matches no files (expected at least one {FORMAT_NAMES} file)")
    return sorted(matches)


def _text_key(data) -> str:
    fmt = getattr(data, "format", None)
    return getattr(fmt, "text_key", None) or "text"


def _check_file_head(key: str, path: str, text_key: str) -> None:
    """The first HEAD_BYTES of a local data file: UTF-8, and for jsonl one JSON object with the text field."""
    if path.endswith(_COMPRESSED):
        return
    with open(path, "rb") as f:
        head = f.read(HEAD_BYTES)
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        text = decoder.decode(head, final=len(head) < HEAD_BYTES)
    except UnicodeDecodeError as e:
        raise UserError(
            f"{key}: file {path!r} is not UTF-8 text (byte {e.start}: {head[e.start : e.start + 1]!r}); "
            f"expected UTF-8 text in {FORMAT_NAMES} files"
        ) from None
    if not text.strip():
        raise UserError(f"{key}: file {path!r} holds only whitespace (expected at least one document)")
    if path.endswith((".jsonl", ".json")):
        if len(head) == HEAD_BYTES and "\n" not in text:
            return  # the first record is longer than what was read
        first = next((line for line in text.splitlines() if line.strip()), "")
        if path.endswith(".json") and first.lstrip().startswith("["):
            return  # a JSON array (Levanter reads it whole)
        try:
            record = json.loads(first)
        except json.JSONDecodeError as e:
            raise UserError(
                f"{key}: file {path!r} line 1 is not JSON ({e.msg}); expected one JSON object per line"
            ) from None
        _check_record(key, path, 1, record, text_key)


def _check_record(key: str, path: str, line: int, record, text_key: str) -> None:
    if not isinstance(record, dict) or not isinstance(record.get(text_key), str):
        raise UserError(
            f"{key}: file {path!r} line {line} has no string field {text_key!r} "
            f'(expected objects like {{"{text_key}": "..."}}; {key.split(".source.")[0]}.format.text_key names the field)'
        )


def _check_jsonl_lines(key: str, path: str, text_key: str) -> None:
    """Every line of a local jsonl file, streamed: Levanter's reader parses each line as one JSON
    object (blank lines included) and fails deep inside its cache builder on the first bad one."""
    offset = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UserError(
                    f"{key}: file {path!r} is not UTF-8 text (line {number}, byte {offset + e.start}); "
                    f"expected UTF-8 text"
                ) from None
            offset += len(raw)
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                what = (
                    "is blank" if not line.strip() else f"is not JSON ({e.msg.removesuffix(' at')} at column {e.colno})"
                )
                raise UserError(
                    f"{key}: file {path!r} line {number} {what}; expected one JSON object per line"
                ) from None
            _check_record(key, path, number, record, text_key)


def _is_jsonl(path: str) -> bool:
    """Read by Levanter line by line: .jsonl, or .json that does not start with '[' or a lone '{'."""
    if path.endswith(".jsonl"):
        return True
    if not path.endswith(".json"):
        return False
    with open(path, "rb") as f:
        first_two = f.read(2)
    return first_two[:1] == b"{" and first_two not in (b"{\n", b"{\r")


def _cached(data, name: str, component, split: str) -> bool:
    """Whether Levanter's finished cache of a component's `split` exists (then it reads the cache,
    not the files)."""
    cache = getattr(component, "cache_dir", None) or (data.cache_dir and os.path.join(data.cache_dir, name))
    local = cache and _local_path(cache)
    return bool(local) and os.path.isfile(os.path.join(local, split, "shard_ledger.json"))


def _check_url_files(data, name: str, component, text_key: str) -> bool:
    """The local files of a component's `url` source; whether it names any."""
    source = component.source
    seen = False
    for key, split in (("train_urls", "train"), ("validation_urls", "validation")):
        scan = not _cached(data, name, component, split)
        for i, url in enumerate(getattr(source, key, ()) or ()):
            seen = True
            where = f"data.components.{name}.source.{key}[{i}]"
            for file in _expand(where, url):
                path = _local_path(file)
                if path is None:
                    _check_format(where, file, text_key)
                    continue
                if not os.path.exists(path):
                    raise UserError(f"{where}: file {path!r} does not exist (expected a {FORMAT_NAMES} file)")
                if os.path.isdir(path):
                    raise UserError(
                        f"{where}: {path!r} is a folder (expected a {FORMAT_NAMES} file, or a glob like {path}/*.jsonl)"
                    )
                _check_format(where, path, text_key)
                if os.path.getsize(path) == 0:
                    raise UserError(f"{where}: file {path!r} is empty (expected at least one document)")
                _check_file_head(where, path, text_key)
                if scan and _is_jsonl(path):
                    _check_jsonl_lines(where, path, text_key)
    return seen


def check_data(data) -> None:
    """Levanter's `LmDataConfig`: at least one component with training data, the local files of its
    `url` sources readable in a format Levanter reads, and a tokenizer."""
    from levanter.data.text import DatasetComponent, UrlDatasetSourceConfig

    components = data.components or {}
    if not components:
        raise UserError(
            "data.components is empty: expected a dataset (data.components.<name>.source with train_urls, or a "
            "Hugging Face id) or an offline corpus (corpus.name)"
        )
    has_train = False
    for name, component in components.items():
        if not isinstance(component, DatasetComponent):
            has_train = True  # other component kinds are Levanter's to check
            continue
        source = component.source
        if isinstance(source, UrlDatasetSourceConfig):
            _check_url_files(data, name, component, _text_key(component))
            has_train |= bool(source.train_urls) or _cached(data, name, component, "train")
        else:
            has_train |= source is not None or _cached(data, name, component, "train")
    if not has_train:
        raise UserError(
            "data: no component has training data: expected data.components.<name>.source.train_urls, a Hugging "
            "Face dataset (source.id) or an offline corpus (corpus.name)"
        )
    tokenizer = getattr(data, "tokenizer", None)
    if not tokenizer:
        raise UserError("data.tokenizer is not set (expected a Hugging Face tokenizer name or folder)")
    if (tokenizer.startswith((".", "/")) or os.sep in tokenizer) and not os.path.exists(tokenizer):
        raise UserError(f"data.tokenizer: {tokenizer!r} does not exist (expected a Hugging Face tokenizer folder)")


def check_data_size(tokens: dict, seq_len: int) -> None:
    """Each split must hold at least one sequence after tokenization. Levanter cuts a split's token
    stream into sequences of exactly `seq_len` tokens and drops the remainder, so a shorter split is an
    empty dataset: evaluation fails with an IndexError, and training has nothing to loop over, whatever
    `epochs` says. Run once the caches are built (`tokens`: split -> number of tokens)."""
    for split, count in tokens.items():
        if count < seq_len:
            skip = ", or remove its validation_urls to skip evaluation" if split == "validation" else ""
            raise UserError(
                f"data: the {split} split holds {count} tokens, fewer than one sequence of model.max_seq_len={seq_len} "
                f"tokens; add {split} data (data.components.<name>.source.{split}_urls) or lower model.max_seq_len{skip}"
            )


def load_tokenizer(data):
    """`data.the_tokenizer`, with a one-line error if it cannot be loaded."""
    try:
        return data.the_tokenizer
    except Exception as e:  # noqa: BLE001 (HF raises OSError, ValueError, EnvironmentError, ...)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise UserError(
            f"data.tokenizer={data.tokenizer!r} could not be loaded ({first}); "
            "expected a Hugging Face tokenizer name or folder"
        ) from None
