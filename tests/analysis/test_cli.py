"""`qkvflow analyze ...` end to end on checkpoints that `load_model` reads, and its bad-input errors."""

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from qkvflow import cli
from qkvflow.cli import analyze
from qkvflow.errors import UserError
from tests.helpers import parse_config

TEXT = "def f(x): return x < 2"


def _run(capsys, *args) -> dict:
    assert cli.main(["analyze", *map(str, args)]) == 0
    return json.loads(capsys.readouterr().out)


def _png(path) -> bool:
    return Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and Path(path).stat().st_size > 5_000


def test_spectra_of_a_diffeqformer_checkpoint(diffeqformer_run, tmp_path, capsys, caplog):
    config, checkpoint = diffeqformer_run
    caplog.set_level(logging.INFO)
    run = ("--config_path", config, "--checkpoint", checkpoint)
    out = _run(capsys, "spectra", *run, "--num_times", 6, "--output", tmp_path)
    assert out["depth"] == "t" and out["points"] == 6 and out["solver_times"] == [0.0, 0.25, 0.5, 0.75]
    assert out["qk_relative_variation"] > 0 and out["ov_relative_variation"] > 0
    assert _png(out["figures"]["qk"]) and _png(out["figures"]["ov"])
    assert json.loads((tmp_path / "spectra.json").read_text())["qk_relative_variation"] == out["qk_relative_variation"]
    grid = _run(capsys, "spectra", *run, "--at_solver_times", "--output", tmp_path / "grid")
    first = "qk_mean_abs_real_first_last"
    assert grid["points"] == 4 and grid[first][0] == pytest.approx(out[first][0])  # both grids start at t = 0
    # Levanter's restore warns "Unknown leaf type" for absent submodules: not shown (qkvflow.cli.startup.console)
    warned = [r.getMessage() for r in caplog.records if r.name.startswith("levanter") and r.levelno >= logging.WARNING]
    assert not warned, warned[:3]


def test_spectra_of_a_levanter_gpt2_checkpoint_runs_over_layers(gpt2_run, tmp_path, capsys):
    config, checkpoint = gpt2_run
    out = _run(capsys, "spectra", "--config_path", config, "--checkpoint", checkpoint, "--output", tmp_path)
    assert out["model"] == "Gpt2LMHeadModel" and out["depth"] == "layer" and out["points"] == 3
    assert out["solver_times"] == [] and _png(out["figures"]["qk"])
    with pytest.raises(UserError, match="--at_solver_times needs an ODE model with a fixed-step solver, not Gpt2"):
        analyze.main(["spectra", "--config_path", config, "--checkpoint", checkpoint, "--at_solver_times"])


def test_lyapunov_of_a_checkpoint_writes_page_and_figures(diffeqformer_run, tmp_path, capsys):
    from qkvflow.analysis.lyapunov import token_lyapunov
    from qkvflow.runs.config import TrainConfig
    from qkvflow.runs.model import load_model

    config, checkpoint = diffeqformer_run
    run = ("--config_path", config, "--checkpoint", checkpoint)
    out = _run(capsys, "lyapunov", *run, "--text", TEXT, "--output", tmp_path)
    assert "".join(out["tokens"]) == TEXT and out["steps"] == 4
    model, tokenizer = load_model(parse_config(config, TrainConfig), checkpoint)
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    np.testing.assert_allclose(out["sensitivity"], token_lyapunov(model, ids).sensitivity, rtol=1e-4, atol=1e-5)
    page = Path(out["html"]).read_text()
    assert page.count("<span") == len(ids) and "&lt;" in page and "x < 2" not in page  # escaped
    assert _png(out["figure"]) and _png(out["attention_maps"])


def test_clusters_command(tmp_path, capsys):
    out = _run(capsys, "clusters", "--seed", 1, "--output", tmp_path)
    assert list(out["runs"]) == ["f0", "f1", "f2", "f3", "f4", "f5"] and out["seed"] == 1
    assert out["runs"]["f0"]["clusters"] < 5 < out["runs"]["f5"]["clusters"]
    assert _png(out["figure"])


BAD = [
    (["--text", ""], "lyapunov: --text is empty"),
    (["--text", "   \n"], "lyapunov: --text is empty"),
    (
        ["--text", " ".join(["word"] * 13)],
        "is {n} tokens long, more than the model's max_seq_len of 12",
    ),  # >= 13 tokens
    (["--text", "x", "--steps", "0"], "--steps 0 is invalid"),
]


@pytest.mark.parametrize("args,message", BAD, ids=["empty", "blank", "too-long", "steps"])
def test_lyapunov_bad_text_is_a_user_error(diffeqformer_run, args, message):
    from qkvflow.runs.config import TrainConfig
    from qkvflow.runs.corpus import with_corpus

    config, checkpoint = diffeqformer_run
    tokenizer = with_corpus(parse_config(config, TrainConfig)).data.the_tokenizer
    n = len(tokenizer.encode(args[1], add_special_tokens=False))  # Levanter's MarinTokenizer
    with pytest.raises(UserError, match=message.format(n=n)):
        analyze.main(["lyapunov", "--config_path", config, "--checkpoint", checkpoint, *args])


def test_lyapunov_refuses_a_discrete_model_in_one_line(gpt2_run, capsys):
    config, checkpoint = gpt2_run
    with pytest.raises(UserError, match="lyapunov needs an ODE model, whose weights are functions of t .* Gpt2Config"):
        analyze.main(["lyapunov", "--config_path", config, "--checkpoint", checkpoint, "--text", "x"])
    assert cli.main(["analyze", "lyapunov", "--config_path", config, "--checkpoint", checkpoint, "--text", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("qkvflow analyze: error: lyapunov needs")


def test_an_unwritable_output_is_refused_before_the_analysis(tmp_path, capsys, monkeypatch):
    import qkvflow.analysis.clusters

    monkeypatch.setattr(qkvflow.analysis.clusters, "analyze_clusters", lambda *a, **k: pytest.fail("ran the analysis"))
    (tmp_path / "file.txt").write_text("x")
    for output, reason in [
        ("/proc/qkvflow-test/analysis", "cannot be written"),
        (str(tmp_path / "file.txt"), "is a file"),
    ]:
        assert cli.main(["analyze", "clusters", "--output", output]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"qkvflow analyze: error: --output={output!r} {reason}"), err


def test_output_follows_the_output_folder_rules(tmp_path, capsys, monkeypatch):
    """--output is replaced only when it is absent, empty or (with --overwrite) an earlier output of the same
    analysis (qkvflow.outputs); a user's folder, the current folder and another analysis's output are refused
    before the analysis runs, and every file in them survives."""
    out = tmp_path / "out"
    first = _run(capsys, "clusters", "--output", out)
    assert sorted(p.name for p in out.iterdir()) == ["clusters.json", "clusters.png", "qkvflow_output.json"]
    assert first["json"] == str(out / "clusters.json") and json.loads(Path(first["json"]).read_text())["seed"] == 0
    assert (
        cli.main(["analyze", "clusters", "--seed", "1", "--output", str(out)]) == 2
    )  # issue 62: only with --overwrite
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds an earlier qkvflow clusters analysis: pass --overwrite to replace it" in err
    assert json.loads((out / "clusters.json").read_text())["seed"] == 0
    assert _run(capsys, "clusters", "--seed", 1, "--output", out, "--overwrite")["seed"] == 1  # its own: replaced
    assert json.loads((out / "clusters.json").read_text())["seed"] == 1

    import qkvflow.analysis.clusters

    monkeypatch.setattr(qkvflow.analysis.clusters, "analyze_clusters", lambda *a, **k: pytest.fail("ran the analysis"))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "spectra.json").write_text("my numbers")
    (out / "notes.txt").write_text("my notes")
    for output, reason in [
        (str(mine), "is not empty and was not written by qkvflow"),
        (".", "is or holds the current folder"),
        (str(out), "holds 'notes.txt', which qkvflow did not write"),
    ]:
        monkeypatch.chdir(mine if output == "." else tmp_path)
        assert cli.main(["analyze", "clusters", "--output", output]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"qkvflow analyze: error: --output={output!r} {reason}"), err
    (out / "notes.txt").unlink()
    with pytest.raises(UserError, match="holds a qkvflow clusters analysis, not a spectra analysis"):
        analyze.main(["spectra", "--config_path", "c.yaml", "--checkpoint", "ckpt", "--output", str(out)])
    assert (mine / "spectra.json").read_text() == "my numbers" and json.loads((out / "clusters.json").read_text())
