import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(*args, check=True):
    return subprocess.run([sys.executable, "-m", "qkvflow", *args], cwd=ROOT, capture_output=True, text=True, check=check)


def cli(capsys, *args) -> tuple[int, str, str]:
    """`qkvflow ARGS` in this process: (exit status, stdout, stderr)."""
    from qkvflow.cli import main

    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def test_help_lists_verbs():
    out = run("--help").stdout
    assert "train" in out and "describe" in out


def test_unknown_verb_fails_with_usage():
    proc = run("frobnicate", check=False)
    assert proc.returncode == 2 and "unknown verb 'frobnicate'" in proc.stderr


def test_describe_applies_overrides(capsys):
    rc, out, err = cli(capsys, "describe", "--config_path", str(ROOT / "configs/models/medium_d144.yaml"),
                       "--model.time_embed_dim", "20")  # fmt: skip
    assert rc == 0, err
    out = json.loads(out)
    assert 295e6 < out["total_params"] < 310e6
    assert out["ode_evaluations"] == 24
    assert out["vocab_size"] == 50257  # no data section: Levanter's default tokenizer, gpt2


def test_describe_counts_the_corpus_tokenizers_vocabulary(capsys, corpus_root, tmp_path):
    from transformers import AutoTokenizer

    tokens = len(AutoTokenizer.from_pretrained(str(corpus_root / "pydoc" / "tokenizer")))
    hidden, seq_len = 128, 128  # configs/quickstart.yaml
    rc, out, err = cli(capsys, "describe", "--config_path", str(ROOT / "configs/quickstart.yaml"))
    assert rc == 0, err
    out = json.loads(out)
    assert out["vocab_size"] == tokens == 2048
    assert out["embedding_params"] == (tokens + seq_len) * hidden  # tied token embedding + positions
    assert 3.4e6 < out["total_params"] < 3.6e6  # README: 3.5M parameters
    rc, out, err = cli(capsys, "describe", "--config_path", str(ROOT / "configs/quickstart.yaml"),
                       "--corpus.root", str(tmp_path / "nothing"), "--corpus.vocab_size", "1000")  # fmt: skip
    assert rc == 0 and json.loads(out)["vocab_size"] == 1000
    assert not (tmp_path / "nothing").exists()  # describe builds nothing


HELP = {  # verb: options and sections its --help must name
    "train": ["--stop_after", "--epochs", "--nonfinite", "model", "corpus"],
    "finetune": ["--steps", "--finetune", "pretrained", "lora", "export"],
    "sweep": ["--depths", "--methods", "--steps", "pretrained", "sweep"],
}


@pytest.mark.parametrize("verb", sorted(HELP))
def test_help_is_one_screen_of_options_and_sections(capsys, verb):
    rc, out, err = cli(capsys, verb, "--help")
    assert rc == 0, err
    assert len(out.splitlines()) < 80, f"{verb} --help prints {len(out.splitlines())} lines"
    assert out.startswith(f"usage: qkvflow {verb} --config_path CFG")
    for name in ["--config_path", "data", "trainer", "optimizer", *HELP[verb]]:
        pattern = rf"^  {re.escape(name)}\s" if not name.startswith("--") else rf"^  {re.escape(name)}\b"
        assert re.search(pattern, out, re.MULTILINE), f"{verb} --help does not list {name}"
    assert f"qkvflow {verb} --help-all" in out


def test_help_all_lists_every_key(capsys):
    with pytest.raises(SystemExit) as exit:
        cli(capsys, "train", "--help-all")
    out = capsys.readouterr().out
    assert exit.value.code == 0
    assert "--trainer.checkpointer.base_path" in out and "--model.ode.num_steps" in out
