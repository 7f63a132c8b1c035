"""`qkvflow tokenizer` (qkvflow.data.tokenizer, qkvflow.data.tokenizer_folder, qkvflow.cli.tokenizer): tokenizers
trained offline on the user's own text, the train/validation jsonl written beside them, bad input, and one
training run on the result."""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import socket
from pathlib import Path

import pytest

for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ[_var] = "1"

from transformers import AutoTokenizer  # noqa: E402

from qkvflow.cli import main as cli_main  # noqa: E402
from qkvflow.data.tokenizer_folder import build_tokenizer_folder  # noqa: E402
from qkvflow.outputs import MARKER  # noqa: E402
from tests.timescale import limit  # noqa: E402
from tests.train_utils import ROOT, cli_in_one_process, train_env  # noqa: E402

EOS = "<|endoftext|>"  # pinned: the bundled corpora, the export and Levanter's framing all use it
WORDS = "the river runs past old stone walls and café naïve Ελληνικά 日本語 слово über 🙂 return x = 1".split()
CHUNK = 700
FRACTION = 0.2
VOCAB = 300


def _sample_text(seed: int, lines: int) -> str:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        out.append(
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 12))) + rng.choice(["\n", "\n", ".\n", "\t;\r\n"])
        )
    return "".join(out)


def _write_sample(folder: Path) -> list[str]:
    """Two .txt files and a .jsonl with another text key: the files the tests train on."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "a.txt").write_text(_sample_text(0, 300), encoding="utf-8")
    (folder / "b.txt").write_text(_sample_text(1, 120), encoding="utf-8")
    with open(folder / "c.jsonl", "w", encoding="utf-8") as f:
        for i in range(12):
            f.write(json.dumps({"body": _sample_text(100 + i, 6), "id": i}, ensure_ascii=i % 2 == 0) + "\n")
    return [str(folder / n) for n in ("a.txt", "b.txt", "c.jsonl")]


def _reference_documents(files: list[str], chunk: int) -> list[str]:
    """The documented reading rule, written out: a .txt file is cut after the first line end past every
    `chunk` characters; a .jsonl line's `body` is one document."""
    docs = []
    for path in files:
        if path.endswith(".jsonl"):
            docs += [json.loads(line)["body"] for line in Path(path).read_text(encoding="utf-8").splitlines()]
            continue
        text, piece = Path(path).read_bytes().decode("utf-8"), ""
        for line in text.splitlines(keepends=True):
            piece += line
            if len(piece) >= chunk:
                docs.append(piece)
                piece = ""
        docs += [piece] if piece else []
    return docs


def _jsonl(path: Path) -> list[str]:
    return [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail any Python-level connection to a non-local host (e.g. a Hugging Face Hub lookup)."""
    connect = socket.socket.connect

    def guarded(self, address):  # type: ignore[no-untyped-def]
        host = address[0] if isinstance(address, tuple) else address
        if isinstance(host, str) and not (host.startswith("127.") or host in ("localhost", "::1") or "/" in host):
            raise AssertionError(f"network access attempted: {address}")
        return connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)


def _build(files, output, **kwargs):
    args = dict(vocab_size=VOCAB, text_key="body", chunk_chars=CHUNK, validation_fraction=FRACTION) | kwargs
    return build_tokenizer_folder(files, str(output), **args)


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("tok")
    files = _write_sample(root / "text")
    bpe, char = root / "bpe", root / "char"
    _build(files, bpe)
    _build(files, char, kind="char", vocab_size=None)
    return {"root": root, "files": files, "bpe": bpe, "char": char}


def _gpt2_byte_symbols() -> set[str]:
    """GPT-2's byte-to-unicode table (Radford et al. 2019, encoder.py's bytes_to_unicode): the 256 symbols."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [256 + i for i, _ in enumerate(b for b in range(256) if b not in printable)]
    return {chr(c) for c in printable + others}


ANY_UTF8 = [
    "plain ascii",
    "",
    " leading and trailing spaces  ",
    "tabs\tand\r\nwindows line ends\n\n\n",
    "never seen: ß Ø ﬁ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 👩‍👩‍👧 \u0301 \u200b \x00\x07\x1b[0m \U0010ffff",
    "".join(chr(c) for c in range(0x20, 0x250)),
]


def test_bpe_is_lossless_on_any_utf8_and_has_the_asked_vocabulary(sample: dict) -> None:
    tok = AutoTokenizer.from_pretrained(str(sample["bpe"]), local_files_only=True)
    assert len(tok) == VOCAB  # 256 bytes + EOS + 43 merges: the text has many more pairs than that
    assert tok.bos_token == tok.eos_token == EOS and tok.eos_token_id == tok.convert_tokens_to_ids(EOS) == 0
    assert _gpt2_byte_symbols() <= set(tok.get_vocab())  # every byte can be written
    rng = random.Random(7)
    surrogates = range(0xD800, 0xE000)
    randoms = [
        "".join(chr(c) for c in rng.choices([c for c in range(0x110000) if c not in surrogates][::97], k=60))
        for _ in range(20)
    ]
    validation = _jsonl(sample["bpe"] / "validation.jsonl")  # not seen by the BPE trainer
    for text in ANY_UTF8 + randoms + validation:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
        assert tok(text)["input_ids"] == [0, *ids, 0]  # transformers' framing: EOS text EOS
    n_bytes = sum(len(d.encode()) for d in validation)  # what byte-level BPE without merges would give
    assert sum(len(tok(d, add_special_tokens=False)["input_ids"]) for d in validation) < n_bytes / 1.5


def test_a_text_that_runs_out_of_merges_gets_a_smaller_bpe_vocabulary_and_says_so(tmp_path: Path, capsys) -> None:
    (tmp_path / "tiny.txt").write_text("ab ab ab\n", encoding="utf-8")
    rc = cli_main(["tokenizer", "--files", str(tmp_path / "tiny.txt"), "--vocab_size", "400", "--output", str(tmp_path / "out"),
                   "--validation_fraction", "0"])  # fmt: skip
    out = capsys.readouterr().out
    # pre-tokens "ab", " ab", " ab", "\n": merges a+b, Ġ+ab ... at most 4 merges; the vocabulary stops there
    n = len(AutoTokenizer.from_pretrained(str(tmp_path / "out")))
    assert rc == 0 and 257 < n <= 257 + 4
    assert f"  note: the text ran out of pairs to merge at {n} of the 400 tokens asked for\n" in out


def test_char_tokenizer_is_the_sorted_alphabet_and_round_trips(sample: dict, tmp_path: Path) -> None:
    docs = _reference_documents(sample["files"], CHUNK)
    chars = sorted(set("".join(docs)) | {" "})
    tok = AutoTokenizer.from_pretrained(str(sample["char"]), local_files_only=True)
    assert tok.get_vocab() == {c: i for i, c in enumerate(chars)} | {EOS: len(chars)}
    assert tok.bos_token_id == tok.eos_token_id == len(chars)
    for doc in docs:
        ids = tok(doc, add_special_tokens=False)["input_ids"]
        assert ids == [chars.index(c) for c in doc] and tok.decode(ids) == doc
    with pytest.raises(
        Exception, match="Missing \\[UNK\\] token"
    ):  # outside the alphabet: an error, never a silent token
        tok("Z" if "Z" not in chars else "\u2603", add_special_tokens=False)

    # A text without a space still gets " " (Levanter writes `text + " " + eos`); vocab_size is a cap.
    (tmp_path / "nospace.txt").write_text("日本語\n", encoding="utf-8")
    for cap in (None, 6, 99):
        out = tmp_path / f"cap{cap}"
        build_tokenizer_folder(
            [str(tmp_path / "nospace.txt")], str(out), kind="char", vocab_size=cap, validation_fraction=0
        )
        vocab = AutoTokenizer.from_pretrained(str(out)).get_vocab()
        assert vocab == {"\n": 0, " ": 1, "日": 2, "本": 3, "語": 4, EOS: 5}


def test_documents_split_and_jsonl_follow_the_documented_rule(sample: dict) -> None:
    docs = _reference_documents(sample["files"], CHUNK)
    assert len(docs) > 20 and all(len(d) < CHUNK + 200 for d in docs)
    keys = [int.from_bytes(hashlib.blake2b(f"0:{d}".encode(), digest_size=8).digest(), "big") for d in docs]
    held = sorted(range(len(docs)), key=lambda i: (keys[i], i))[: math.ceil(FRACTION * len(docs))]
    for folder in (sample["bpe"], sample["char"]):
        assert _jsonl(folder / "validation.jsonl") == [docs[i] for i in sorted(held)]
        assert _jsonl(folder / "train.jsonl") == [d for i, d in enumerate(docs) if i not in held]
        sources = json.loads((folder / "sources.json").read_text())
        assert (sources["train_documents"], sources["validation_documents"]) == (len(docs) - len(held), len(held))
        assert json.loads((folder / MARKER).read_text())["files"] == sorted(
            [
                "sources.json",
                "special_tokens_map.json",
                "tokenizer.json",
                "tokenizer_config.json",
                "train.jsonl",
                "validation.jsonl",
            ]
        )


def test_validation_text_stays_out_of_bpe_training(sample: dict) -> None:
    """The BPE merges are those of a tokenizer trained on the train split alone (train.jsonl, as
    written), and not those of one trained on every document: held-out text never shapes the tokenizer."""
    from qkvflow.data.tokenizer import bpe_tokenizer

    def merges(docs):
        return json.loads(bpe_tokenizer(docs, VOCAB).to_str())["model"]["merges"]

    shipped = json.loads((sample["bpe"] / "tokenizer.json").read_text(encoding="utf-8"))["model"]["merges"]
    assert shipped == merges(_jsonl(sample["bpe"] / "train.jsonl"))
    assert shipped != merges(_reference_documents(sample["files"], CHUNK))  # the split changes the merges


def test_same_files_give_a_byte_identical_tokenizer(sample: dict, tmp_path: Path) -> None:
    for kind, folder in (("bpe", sample["bpe"]), ("char", sample["char"])):
        again = tmp_path / kind
        _build(sample["files"], again, kind=kind, vocab_size=VOCAB if kind == "bpe" else None)
        for name in (
            "tokenizer.json",
            "tokenizer_config.json",
            "special_tokens_map.json",
            "train.jsonl",
            "validation.jsonl",
        ):
            assert (again / name).read_bytes() == (folder / name).read_bytes(), (kind, name)
    # (another process, with other hash seeds: the end-to-end test below compares its CLI build too)


def test_levanter_loads_it_and_frames_documents_with_eos(sample: dict) -> None:
    from levanter.data.text._batch_tokenizer import BatchTokenizer
    from levanter.tokenizers import load_tokenizer
    from transformers import PreTrainedTokenizerFast

    docs = _jsonl(sample["bpe"] / "validation.jsonl")[:3] + ["naïve 🙂"]
    for folder in (sample["bpe"], sample["char"]):
        hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        tok = load_tokenizer(str(folder))
        assert len(tok) == len(hf) and tok.bos_token_id == tok.eos_token_id == hf.convert_tokens_to_ids(EOS)
        assert isinstance(tok.as_hf_tokenizer(), PreTrainedTokenizerFast)
        eos = tok.eos_token_id
        batch = BatchTokenizer(tok)([{"text": d} for d in docs])
        for doc, row in zip(docs, batch):  # Levanter's definition: [bos] + encode(text + " " + eos)
            assert row["input_ids"] == [eos, *hf(doc + " ", add_special_tokens=False)["input_ids"], eos]
            assert hf.decode(row["input_ids"][1:-1]) == doc + " "


def _tokenizer_cli(capsys, *args: str) -> tuple[int, str, str]:
    rc = cli_main(["tokenizer", *args])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def _bad_files(tmp: Path) -> dict:
    tmp.mkdir()
    (tmp / "empty.txt").write_bytes(b"")
    (tmp / "blank.txt").write_text(" \n\t\n")
    (tmp / "latin1.txt").write_bytes("hello\ncaf".encode() + "é".encode("latin-1") + b"\n")
    (tmp / "latin1.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf' + "é".encode("latin-1") + b'"}\n')
    (tmp / "nokey.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    (tmp / "notjson.jsonl").write_text('{"text": "ok"}\n{"text": oops}\n')
    (tmp / "hole.jsonl").write_text('{"text": "ok"}\n\n{"text": "ok"}\n')
    (tmp / "empty_texts.jsonl").write_text('{"text": ""}\n{"text": "  "}\n')
    (tmp / "notes.md").write_text("# notes\n")
    (tmp / "good.txt").write_text("some good text\n" * 20)
    (tmp / "one.txt").write_text("one line\n")
    (tmp / "two.txt").write_text("two short\nlines\n")  # one document at the default --chunk_chars
    return {n: str(tmp / n) for n in os.listdir(tmp)}


BAD = [  # (files, extra args, the one line after "qkvflow tokenizer: error: ")
    (["missing.txt"], [], "--files: '{missing.txt}' does not exist (expected a .txt or .jsonl file)"),
    (["empty.txt"], [], "--files: '{empty.txt}' is empty (expected UTF-8 text)"),
    (["blank.txt"], [], "--files: '{blank.txt}' holds only whitespace (expected text)"),
    (["good.txt", "latin1.txt"], [], "--files: '{latin1.txt}' is not UTF-8 text (line 2, byte offset 9: b'\\xe9')"),
    (["latin1.jsonl"], [], "--files: '{latin1.jsonl}' is not UTF-8 text (line 2, byte offset 28: b'\\xe9')"),
    (["notes.md"], [], "--files: '{notes.md}' has an unknown extension: expected .txt (plain text, one document) or .jsonl (one JSON object per line)"),
    (["nokey.jsonl"], [], "--files: '{nokey.jsonl}' line 2 has no string field 'text' (expected objects like {{\"text\": \"...\"}}; --text_key names the field)"),
    (["good.txt", "nokey.jsonl"], ["--text_key", "body"], "--files: '{nokey.jsonl}' line 1 has no string field 'body' (expected objects like {{\"body\": \"...\"}}; --text_key names the field)"),
    (["notjson.jsonl"], [], "--files: '{notjson.jsonl}' line 2 is not JSON (Expecting value at column 10); expected one JSON object per line"),
    (["hole.jsonl"], [], "--files: '{hole.jsonl}' line 2 is blank; expected one JSON object per line"),
    (["empty_texts.jsonl"], [], "--files: '{empty_texts.jsonl}' holds no text (every 'text' field is empty or whitespace)"),
    (["good.txt"], ["--vocab_size", "256"], "--vocab_size 256 is smaller than the byte alphabet: byte-level BPE needs at least 257 tokens (256 bytes and <|endoftext|>)"),
    (["good.txt"], ["--kind", "char", "--vocab_size", "9", "--validation_fraction", "0"], "--vocab_size 9 is too small for a character-level tokenizer: the text has 10 distinct characters (with ' '), so it needs 11 tokens with <|endoftext|>; pass at least that or leave --vocab_size out"),
    (["good.txt"], ["--kind", "word"], "--kind 'word' is invalid: expected one of bpe, char"),
    (["good.txt"], ["--validation_fraction", "1"], "--validation_fraction 1.0 is invalid: expected a number in [0, 1)"),
    (["one.txt"], [], "--validation_fraction 0.05 leaves no training text: the files hold 1 document; pass --validation_fraction 0, or more text (a .txt file is cut into documents only at line ends, and these hold one line each)"),
    (["two.txt"], [], "--validation_fraction 0.05 leaves no training text: the files hold 1 document; pass --validation_fraction 0, more text, or a smaller --chunk_chars (a .txt file is cut into documents at line ends)"),
    ([], [], "--files is empty: expected one or more .txt or .jsonl files"),
]  # fmt: skip


@pytest.mark.parametrize("files, extra, expected", BAD, ids=[f"{b[0][-1] if b[0] else 'none'}{b[1][:2]}" for b in BAD])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path: Path, capsys, files, extra, expected) -> None:
    paths = _bad_files(tmp_path / "in")
    paths["missing.txt"] = str(tmp_path / "in" / "missing.txt")
    out = tmp_path / "out"
    args = ["--files", *[paths[f] for f in files], *extra, "--output", str(out)]
    rc, stdout, err = _tokenizer_cli(capsys, *args)
    for name, path in paths.items():
        expected = expected.replace("{" + name + "}", path)
    assert rc == 2 and err == f"qkvflow tokenizer: error: {expected.replace('{{', '{').replace('}}', '}')}\n"
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["in"]  # no temporary folder left


def test_output_is_never_a_folder_of_yours(tmp_path: Path, capsys) -> None:
    text = tmp_path / "t.txt"
    text.write_text("some text to train on\n" * 30)
    text = [str(text), "--chunk_chars", "100"]  # 7 documents: 1 for validation
    out = tmp_path / "out"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    rc, _, err = _tokenizer_cli(capsys, "--files", *text, "--output", str(out))
    assert rc == 2 and err == (
        f"qkvflow tokenizer: error: --output={str(out)!r} is not empty and was not written by qkvflow (it has no readable "
        f"{MARKER}): refusing to replace it; remove it yourself or choose another --output\n"
    )
    assert [p.name for p in out.iterdir()] == ["thesis.tex"]

    out = tmp_path / "ours"
    assert _tokenizer_cli(capsys, "--files", *text, "--output", str(out))[0] == 0
    before = (out / "tokenizer.json").read_bytes()
    rc, _, err = _tokenizer_cli(capsys, "--files", *text, "--output", str(out), "--vocab_size", "260")
    assert rc == 2 and err.endswith("holds an earlier qkvflow tokenizer: pass --overwrite to replace it\n")
    assert (out / "tokenizer.json").read_bytes() == before
    (out / "levanter_cache" / "own_text").mkdir(parents=True)  # what training on it leaves there
    rc, _, err = _tokenizer_cli(capsys, "--files", *text, "--output", str(out), "--overwrite")
    assert rc == 2 and err == (
        f"qkvflow tokenizer: error: --output {str(out)!r} holds levanter_cache/, Levanter's token cache made with the "
        f"tokenizer there: remove it yourself (rm -r {out}/levanter_cache) before rebuilding the tokenizer, or choose "
        "another --output\n"
    )
    (out / "levanter_cache" / "own_text").rmdir()
    (out / "levanter_cache").rmdir()
    assert _tokenizer_cli(capsys, "--files", *text, "--output", str(out), "--vocab_size", "260", "--overwrite")[0] == 0
    assert len(AutoTokenizer.from_pretrained(str(out))) == 260
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ours", "out", "t.txt"]


def test_own_text_trains_offline_end_to_end(sample: dict, tmp_path: Path) -> None:
    """`qkvflow tokenizer` then `qkvflow train --config_path configs/own_text.yaml` (its default paths),
    one after the other in one new process (tests/train_utils.cli_in_one_process) with the Hugging Face
    hub switched off; a tiny model, 4 steps."""
    env = train_env(1, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    tiny = ["--model.hidden_dim", "32", "--model.num_heads", "2", "--model.max_seq_len", "32", "--model.time_embed_dim", "8",
            "--model.num_frequencies", "16", "--model.ode.num_steps", "2", "--trainer.num_train_steps", "4",
            "--trainer.train_batch_size", "4", "--trainer.steps_per_eval", "4", "--trainer.max_eval_batches", "1",
            "--trainer.per_device_eval_parallelism", "4", "--log_every", "1", "--optimizer.learning_rate", "1e-2",
            "--optimizer.warmup", "0", "--trainer.log_jaxprs", "false", "--trainer.log_xla_hlo", "false"]  # fmt: skip
    cases = {
        "tokenizer": ["tokenizer", "--files", *sample["files"], "--text_key", "body", "--vocab_size", str(VOCAB),
                      "--chunk_chars", str(CHUNK), "--validation_fraction", str(FRACTION), "--output", "cache/own_text"],
        "train": ["train", "--config_path", str(ROOT / "configs" / "own_text.yaml"), *tiny],
    }  # fmt: skip
    results = cli_in_one_process(cases, env, cwd=tmp_path, timeout=limit(600))
    code, stdout, stderr = results["tokenizer"]
    assert code == 0, stderr
    assert stdout.splitlines()[-1] == "next: qkvflow train --config_path configs/own_text.yaml"
    folder = tmp_path / "cache" / "own_text"
    assert (folder / "tokenizer.json").read_bytes() == (
        sample["bpe"] / "tokenizer.json"
    ).read_bytes()  # another process

    code, stdout, stderr = results["train"]
    assert code == 0, stderr[-3000:]
    lines = stdout.splitlines()
    losses = [float(line.split()[3]) for line in lines if line.startswith("step ")]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert any(line.startswith("eval after step 4: loss ") for line in lines)
    assert (folder / "levanter_cache").is_dir() and (tmp_path / "checkpoints" / "own_text").is_dir()


def test_command_line_forms_and_a_config_file_give_the_same_output(sample: dict, tmp_path: Path, capsys) -> None:
    from qkvflow.cli.tokenizer import draccus_args

    assert draccus_args(["--files", "a.txt", "b c.jsonl", "--overwrite", "--output=o", "--write_data"]) == [
        "--files", '["a.txt", "b c.jsonl"]', "--overwrite", "true", "--output=o", "--write_data", "true",
    ]  # fmt: skip
    assert draccus_args(["--files=a.txt", "--overwrite", "false"]) == ["--files", '["a.txt"]', "--overwrite", "false"]
    config = tmp_path / "tok.yaml"
    config.write_text(json.dumps({"files": sample["files"], "vocab_size": VOCAB, "text_key": "body", "chunk_chars": CHUNK,
                                  "validation_fraction": FRACTION, "output": str(tmp_path / "from_yaml")}))  # fmt: skip
    assert _tokenizer_cli(capsys, "--config_path", str(config))[0] == 0
    assert (tmp_path / "from_yaml" / "tokenizer.json").read_bytes() == (sample["bpe"] / "tokenizer.json").read_bytes()
    rc, out, _ = _tokenizer_cli(capsys, "--help")
    assert rc == 0 and out.startswith("usage: qkvflow tokenizer --files A.txt B.jsonl --output DIR")
    for option in (
        "--files",
        "--output",
        "--vocab_size",
        "--kind",
        "--text_key",
        "--validation_fraction",
        "--overwrite",
    ):
        assert f"\n  {option} " in out
