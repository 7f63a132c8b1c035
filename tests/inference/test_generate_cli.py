"""`qkvflow generate` on the command line: bad input as one line, and greedy text from a real checkpoint."""

import json
import os

import equinox as eqx
import pytest

from qkvflow import cli
from tests.inference.util import greedy_reference, on_grid, round_off, training_framed
from tests.train_utils import TINY, reference_run

CONTEXT = 32  # tests/configs/tiny_train.yaml: model.max_seq_len


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The session's tiny DiffEqFormer trained 8 steps (Euler, N = 2) on the pydoc corpus
    (tests/train_utils.reference_run, shared with test_train and test_faults; read only here):
    (its corpus folder, its checkpoint folder)."""
    corpora, workdir, proc = reference_run(tmp_path_factory)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return corpora, workdir / "checkpoints" / "tiny"


def args(corpus_root, checkpoint, *extra):
    return [
        "generate",
        "--config_path",
        TINY,
        "--corpus.root",
        str(corpus_root),
        "--checkpoint",
        str(checkpoint),
        *extra,
    ]


def one_error_line(capsys, argv, expected):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("qkvflow generate: error: ") and expected in err[0], err[0]


def test_bad_input_is_one_line(capsys, corpus_root, tmp_path):
    missing = tmp_path / "none"
    missing.mkdir()  # empty: each refusal below comes before the checkpoint is read (a missing one is refused first)
    one_error_line(capsys, args(corpus_root, missing, "--prompt", ""), "--prompt is empty")
    one_error_line(
        capsys, args(corpus_root, missing, "--prompt", "x", "--temperature", "-0.5"), "temperature=-0.5 is invalid"
    )
    one_error_line(
        capsys,
        args(corpus_root, missing, "--prompt", "x", "--model.ode.solver", "dopri5"),
        "model.ode.solver=dopri5 is adaptive: KV-cached decoding needs a fixed-step solver",
    )
    one_error_line(capsys, args(corpus_root, missing, "--prompt", "x", "--steps", "2,4"), "expected one grid N'")
    one_error_line(capsys, args(corpus_root, missing, "--prompt", "x", "--steps", "N/4"), "--steps N/4 is invalid")
    one_error_line(  # generate decodes on one grid: the message says so (issue 56, item 8)
        capsys,
        args(corpus_root, missing, "--prompt", "x", "--steps", "2.5N"),
        "--steps '2.5N' is invalid: expected one grid N'",
    )
    # --output_jsonl is checked before any work (issue 56, item 2): the checkpoint is never reached
    for path, reason in [
        (tmp_path, "is a folder: expected the path of a file to write"),
        (missing / "out.jsonl", f"is inside the run folder of --checkpoint {str(missing)!r}"),
    ]:
        argv = args(corpus_root, missing, "--prompt", "x", "--output_jsonl", str(path))
        one_error_line(capsys, argv, f"--output_jsonl={str(path)!r} {reason}")
    one_error_line(
        capsys,
        args(corpus_root, missing, "--prompt", "x", "--auto_tolerance", "0.5"),
        "--auto_tolerance: only with --steps auto",
    )
    long_prompt = "word " * 40
    one_error_line(
        capsys, args(corpus_root, missing, "--prompt", long_prompt), "more than the model's context max_seq_len=32"
    )


def test_greedy_cli_equals_uncached_argmax(capsys, trained, tmp_path):
    from qkvflow.cli.generate import read_config
    from qkvflow.runs.model import load_model

    corpus_root, checkpoint = trained
    out = tmp_path / "out.jsonl"
    prompt, new = "The function", 8
    argv = args(corpus_root, checkpoint, "--prompt", prompt, "--max_new_tokens", str(new), "--temperature", "0")
    assert cli.main([*argv, "--output_jsonl", str(out)]) == 0
    printed = capsys.readouterr().out
    record = json.loads(out.read_text().splitlines()[0])

    config = read_config(argv[1:])
    model, tokenizer = load_model(config, str(checkpoint))
    ids = training_framed(tokenizer, prompt)
    expected, margin = greedy_reference(model, ids, new, context=CONTEXT)
    assert margin > round_off(2, 32, 1.0)
    assert record["tokens"] == expected
    assert printed == tokenizer.decode(expected) + "\n"
    assert record["prompt"] == prompt and record["finish_reason"] == "length"


def test_output_jsonl_replaces_an_existing_file_only_with_overwrite_and_whole(capsys, trained, tmp_path):
    """Issue 62, item 1: onto an existing file generate exits 2 before decoding and the bytes stay; with
    --overwrite the file holds the new records, renamed into place (a hard link to the old file keeps the old
    bytes, which an in-place write would have truncated), and no temporary file is left beside it."""
    corpus_root, checkpoint = trained
    out, link = tmp_path / "notes.txt", tmp_path / "link.txt"
    out.write_text("the user's notes\n")
    os.link(out, link)
    argv = [*args(corpus_root, checkpoint, "--prompt", "The function", "--max_new_tokens", "4"), "--output_jsonl"]
    one_error_line(capsys, [*argv, str(out)], f"--output_jsonl={str(out)!r} exists: pass --overwrite to replace it")
    assert out.read_text() == "the user's notes\n"
    assert cli.main([*argv, str(out), "--overwrite"]) == 0
    record = json.loads(out.read_text())
    assert capsys.readouterr().out == record["completion"] + "\n" and len(record["tokens"]) == 4
    assert link.read_text() == "the user's notes\n" and sorted(os.listdir(tmp_path)) == ["link.txt", "notes.txt"]


def test_steps_auto_decodes_on_the_grid_the_rule_chooses(capfd, trained, tmp_path, monkeypatch):
    """`--steps auto` scores the candidates (N' = 1, 2, 4, 8 of the trained N = 2) on --auto_split's data, picks
    the fewest evaluations within --auto_tolerance of the lowest loss, says so on stderr, and decodes on that
    grid (whose use of N' tests/inference/test_cached_decoding.py checks). The losses are set here, above the
    finest grid's real one, so that the rule's choice is none of the cheapest grid, the best one, the
    trained one or the default tolerance's: N' = 4, worked out below from the table."""
    from qkvflow.cli.generate import read_config
    from qkvflow.evaluation import evaluate as evaluation
    from qkvflow.inference import generate as decoding
    from qkvflow.runs.model import load_model

    above = {1: 1.0, 2: 0.5, 4: 0.015, 8: 0.0}  # nats above the finest grid's loss
    tolerance = 0.02
    lowest = min(above.values())
    rule = min((n for n in above if above[n] <= lowest + tolerance), key=lambda n: n)  # Euler: n evaluations
    assert rule not in (min(above), min(above, key=above.get), 2) and rule != min(
        (n for n in above if above[n] <= lowest + 0.01), key=lambda n: n
    )

    grids, splits = [], []
    real, score = decoding.generate, evaluation.score_grids

    def scored(config, *args):
        splits.append(config.corpus.eval_split)
        rows, examples = score(config, *args)
        finest = [r["loss"] for r in rows if r["steps"] == 8][0]
        return [dict(r, loss=finest + above[r["steps"]]) for r in rows], examples

    monkeypatch.setattr(
        decoding, "generate", lambda *a, steps=None, **k: grids.append(steps) or real(*a, steps=steps, **k)
    )
    monkeypatch.setattr(evaluation, "score_grids", scored)
    corpus_root, checkpoint = trained
    prompt, new = "The function", 8
    argv = args(corpus_root, checkpoint, "--prompt", prompt, "--max_new_tokens", str(new))
    out = tmp_path / "out.jsonl"
    auto = [*"--steps auto --auto_grids 1,2,4,8 --auto_split selection --auto_tolerance".split(), str(tolerance)]
    assert cli.main([*argv, *auto, "--output_jsonl", str(out)]) == 0
    captured = capfd.readouterr()
    assert captured.err.count(f"steps auto: euler N={rule} ({rule} vector-field evaluations") == 1, captured.err
    assert f"on the selection split), the fewest evaluations within {tolerance:g} nats" in captured.err
    assert grids == [rule] and splits == ["selection"]

    config = read_config(argv[1:])
    model, tokenizer = load_model(config, str(checkpoint))
    ids = training_framed(tokenizer, prompt)
    expected, margin = greedy_reference(on_grid(model, rule), ids, new, context=CONTEXT)
    assert margin > round_off(rule, 32, 1.0)
    assert json.loads(out.read_text())["tokens"] == expected
    assert captured.out == tokenizer.decode(expected) + "\n"


def test_stream_prints_the_same_text_as_the_completion(capfd, trained, tmp_path):
    """--stream true prints the completion piece by piece as it is decoded; what reaches stdout is the
    text printed without it (and written to the JSONL), and the same ending newline."""
    corpus_root, checkpoint = trained
    argv = args(corpus_root, checkpoint, "--prompt", "The function", "--max_new_tokens", "8", "--temperature", "0")
    out = tmp_path / "out.jsonl"
    assert cli.main([*argv, "--output_jsonl", str(out)]) == 0
    plain = capfd.readouterr().out
    assert cli.main([*argv, "--stream", "true"]) == 0
    streamed = capfd.readouterr().out
    completion = json.loads(out.read_text())["completion"]
    assert streamed == plain == completion + "\n"
    assert len(completion) > 0


def test_stream_honours_stop_and_is_a_bare_flag(capfd, trained, tmp_path):
    """Issue 31: `--stream` (bare, as the README lists it) with `--stop S` prints exactly the completion that
    --output_jsonl holds, cut before the first S; nothing past S reaches stdout. S is two characters from the
    middle of the unstopped completion, so decode rounds follow its first occurrence
    (test_streamer_never_sends_past_a_stop checks the streamer itself on a scripted engine)."""
    from qkvflow.cli.generate import read_config
    from qkvflow.inference.completions import tokenizer_of

    corpus_root, checkpoint = trained
    argv = args(corpus_root, checkpoint, "--prompt", "The function", "--max_new_tokens", "24", "--temperature", "0")
    full = tmp_path / "full.jsonl"
    assert cli.main([*argv, "--output_jsonl", str(full)]) == 0
    capfd.readouterr()
    record = json.loads(full.read_text())
    tokenizer = tokenizer_of(read_config(argv[1:]))
    text = record["completion"]
    assert tokenizer.decode(record["tokens"]) == text and len(text) > 12
    stop = text[len(text) // 2 : len(text) // 2 + 2].replace("\\", "")  # cut at its first occurrence
    expected = text[: text.find(stop)]

    out = tmp_path / "out.jsonl"
    escaped = stop.replace("\n", "\\n").replace("\t", "\\t")  # as a shell user writes it (`\n`: a newline)
    assert cli.main([*argv, "--stop", escaped, "--stream", "--output_jsonl", str(out)]) == 0
    streamed = capfd.readouterr().out
    assert json.loads(out.read_text())["completion"] == expected
    assert streamed == expected + "\n"


LLAMA_YAML = """corpus:
  name: pydoc
  root: {root}
model:
  type: llama
  max_seq_len: 32
  hidden_dim: 32
  intermediate_dim: 64
  num_heads: 2
  num_kv_heads: 2
  num_layers: 2
trainer:
  mp: p=f32,c=f32
"""


class Causal(eqx.Module):
    """A Levanter model called with a causal mask (without one its attention sees every position)."""

    model: eqx.Module

    def __call__(self, input_ids):
        from levanter.layers.attention_mask import AttentionMask

        return self.model(input_ids, attn_mask=AttentionMask.causal())


def test_greedy_cli_on_a_llama_baseline_equals_uncached_argmax(capfd, corpus_root, tmp_path):
    """Levanter's Llama (the baseline `qkvflow train` builds for model.type llama), freshly initialised
    and saved as a checkpoint: the CLI's greedy tokens are the argmax of its full-sequence causal logits."""
    from qkvflow.cli.generate import read_config
    from qkvflow.runs.model import load_model
    from tests.finetune_utils import save_fresh_checkpoint

    config_path = tmp_path / "llama.yaml"
    config_path.write_text(LLAMA_YAML.format(root=corpus_root))
    checkpoint = save_fresh_checkpoint(tmp_path / "ckpt", corpus_root, str(config_path))
    out = tmp_path / "out.jsonl"
    prompt, new = "The function", 8
    argv = ["generate", "--config_path", str(config_path), "--checkpoint", str(checkpoint), "--prompt", prompt,
            "--max_new_tokens", str(new), "--temperature", "0"]  # fmt: skip
    assert cli.main([*argv, "--output_jsonl", str(out)]) == 0, capfd.readouterr().err
    record = json.loads(out.read_text())

    config = read_config(argv[1:])
    model, tokenizer = load_model(config, str(checkpoint))
    assert type(model).__name__ == "LlamaLMHeadModel"
    ids = training_framed(tokenizer, prompt)
    expected, margin = greedy_reference(Causal(model), ids, new, CONTEXT)
    assert margin > round_off(2, 32, 1.0)
    assert record["tokens"] == expected


class _ScriptedEngine:
    """Stands in for the engine as the streamer reads it: `results[request][0].token_list`, grown by hand."""

    def __init__(self):
        self.results = {}

    def emit(self, tokens):
        from types import SimpleNamespace

        self.results[0] = {0: SimpleNamespace(token_list=list(tokens))}


def test_streamer_never_sends_past_a_stop():
    """The streamer's text is always a prefix of the final completion: cut at a stop string, holding back an
    ending that may still become one, and cut at a stop token; `flush` sends the rest of the final text."""
    from qkvflow.inference.generate import SamplingOptions, _streamer, finish
    from tests.inference.util import CharTokenizer

    tok = CharTokenizer()
    ids = lambda text: tok(text)["input_ids"]  # noqa: E731
    for options, arrivals in [
        (SamplingOptions(stop=("cd",)), ["ab", "abc", "abcde", "abcdefgh"]),  # "c" held until "cd" shows
        (SamplingOptions(stop=("xyz",)), ["abx", "abxy", "abxyq", "abxyqrs"]),  # a prefix that did not become it
        (SamplingOptions(stop_token_ids=(ids("!")[0],)), ["ab", "ab!cd", "ab!cdef"]),
    ]:
        engine, sent = _ScriptedEngine(), []
        streamer = _streamer(engine, tok, [0], lambda i, text, sent=sent: sent.append(text), options)
        for text in arrivals:
            engine.emit(ids(text))
            streamer(0)
            final = finish(tok, "p", ids(text), options).text
            assert final.startswith("".join(sent)), (options, text, sent)
        streamer.flush(0, final)
        assert "".join(sent) == final, (options, sent, final)
