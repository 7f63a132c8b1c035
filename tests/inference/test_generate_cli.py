"""`qkvflow generate` on the command line: bad input as one line, and greedy text from a real checkpoint."""

import json

import pytest

from qkvflow import cli
from tests.inference.util import greedy_reference, round_off
from tests.train_utils import TINY, train

CONTEXT = 32  # tests/configs/tiny_train.yaml: model.max_seq_len


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, corpus_root):
    """A tiny DiffEqFormer trained 3 steps (Euler, N = 2) on the pydoc corpus."""
    workdir = tmp_path_factory.mktemp("generate")
    result = train(workdir, corpus_root, "--trainer.num_train_steps", "3")
    assert result.returncode == 0, result.stderr[-2000:]
    return workdir


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
    one_error_line(capsys, args(corpus_root, missing, "--prompt", ""), "--prompt is empty")
    one_error_line(
        capsys, args(corpus_root, missing, "--prompt", "x", "--temperature", "-0.5"), "temperature=-0.5 is invalid"
    )
    one_error_line(
        capsys,
        args(corpus_root, missing, "--prompt", "x", "--model.ode.solver", "dopri5"),
        "model.ode.solver=dopri5 is adaptive: KV-cached decoding needs a fixed-step solver",
    )
    long_prompt = "word " * 40
    one_error_line(
        capsys, args(corpus_root, missing, "--prompt", long_prompt), "more than the model's context max_seq_len=32"
    )


def test_greedy_cli_equals_uncached_argmax(capsys, corpus_root, run_dir):
    from qkvflow.cli.generate import read_config
    from qkvflow.training.checkpoints import load_model

    checkpoint = run_dir / "checkpoints" / "tiny"
    out = run_dir / "out.jsonl"
    prompt, new = "The function", 8
    argv = args(corpus_root, checkpoint, "--prompt", prompt, "--max_new_tokens", str(new), "--temperature", "0")
    assert cli.main([*argv, "--output_jsonl", str(out)]) == 0
    printed = capsys.readouterr().out
    record = json.loads(out.read_text().splitlines()[0])

    config = read_config(argv[1:])
    model, tokenizer = load_model(config, str(checkpoint))
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    expected, margin = greedy_reference(model, ids, new, context=CONTEXT)
    assert margin > round_off(2, 32, 1.0)
    assert record["tokens"] == expected
    assert printed == tokenizer.decode(expected) + "\n"
    assert record["prompt"] == prompt and record["finish_reason"] == "length"
