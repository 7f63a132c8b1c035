"""Every verb that writes a file follows qkvflow.outputs (docs/checkpoints.md, "Where outputs go"): on the command
line, in-process, each refusal is exit 2 with one line, before any work, and leaves the bytes where they were.

The rule itself (rename into place, a failed write, the tracked lists) is tests/test_outputs.py's; here each
verb is seen to apply it. The repository's own folders are used as they are: a broken check would then go on
to load a checkpoint that does not exist and fail there, never write into them.
"""

import argparse
import json
from pathlib import Path

import pytest

from qkvflow import cli, outputs
from tests.train_utils import TINY

ROOT = outputs.ROOT


def _refused(capsys, argv: list[str], *needles: str) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"qkvflow {argv[0]}"), err
    for needle in needles:
        assert needle in err[0], err[0]
    return err[0]


@pytest.fixture
def notes(tmp_path) -> Path:
    path = tmp_path / "notes.txt"
    path.write_text("the user's notes\n")
    return path


def test_generate_never_replaces_an_existing_file_or_a_tracked_one(capsys, corpus_root, tmp_path, notes):
    """Issue 62, item 1: `--output_jsonl notes.txt` on an existing file, and `--output_jsonl README.md` even with
    --overwrite, exit 2 with the file's bytes unchanged (tests/inference/test_generate_cli.py writes one)."""
    readme = ROOT / "README.md"
    before = readme.read_bytes()
    argv = ["generate", "--config_path", TINY, "--corpus.root", str(corpus_root), "--checkpoint", str(tmp_path / "no")]
    argv += ["--prompt", "x", "--output_jsonl"]
    _refused(capsys, [*argv, str(notes)], f"--output_jsonl={str(notes)!r} exists: pass --overwrite to replace it")
    _refused(capsys, [*argv, str(readme), "--overwrite"], "is the repository's tracked file README.md")
    _refused(capsys, [*argv, str(ROOT / "docs" / "out.jsonl"), "--overwrite"], "shipped folder docs/")
    assert notes.read_text() == "the user's notes\n" and readme.read_bytes() == before
    assert not (ROOT / "docs" / "out.jsonl").exists()


@pytest.mark.parametrize("output", ["configs/exp", "docs", "benchmarks/results/exp"])
def test_export_refuses_a_tracked_folder(capsys, tmp_path, monkeypatch, output):
    """Issue 62, item 5: `export --output configs/exp` exits 2 in one line (as `bench compare` refuses it),
    relative to the checkout as a user types it, with --overwrite too."""
    monkeypatch.chdir(ROOT)
    missing = str(tmp_path / "none")
    export = ["export", "--config_path", "configs/quickstart.yaml", "--checkpoint", missing, "--output", output]
    _refused(capsys, export, f"--output={output!r} is inside the repository's shipped folder")
    _refused(capsys, [*export, "--overwrite"], "is inside the repository's shipped folder")
    assert not (ROOT / output).exists() or output == "docs"


def test_bench_and_plan_refuse_an_existing_file_before_any_work(capsys, tmp_path, notes):
    """bench speed --json_out, scaling, quality and exits (their files in --out_dir) and plan --save_hlo: an
    existing file is refused at the start (before any compile, point, training or checkpoint), bytes unchanged."""
    out = tmp_path / "out"
    out.mkdir()
    for name in ("scaling_steps.csv", "quality.md", "exits.json"):
        (out / name).write_text("earlier")
    cases = [
        (
            ["bench", "speed", "--config_path", str(ROOT / "benchmarks/configs/speed.yaml"), "--json_out", str(notes)],
            "--json_out",
        ),  # fmt: skip
        (["bench", "scaling", "--what", "steps", "--out_dir", str(out)], "scaling_steps.csv"),
        (["bench", "quality", "--out_dir", str(out)], "quality.md"),
        (["bench", "exits", "--workdir", str(tmp_path / "none"), "--out_dir", str(out)], "exits.json"),
        (["plan", "--target", "cpu:1", "--save_hlo", str(notes), "--config_path", TINY], "--save_hlo"),
    ]
    for argv, where in cases:
        _refused(capsys, argv, where, "exists: pass --overwrite to replace it")
    assert notes.read_text() == "the user's notes\n"
    assert {p.name: p.read_text() for p in out.iterdir()} == dict.fromkeys(
        ("scaling_steps.csv", "quality.md", "exits.json"), "earlier"
    )
    assert not list(tmp_path.glob("**/.*.tmp-*"))


def test_an_earlier_output_folder_is_replaced_only_with_overwrite(capsys, tmp_path):
    """analyze and bench depth, which replaced an earlier output of theirs silently, now ask for --overwrite."""
    earlier = tmp_path / "clusters"
    earlier.mkdir()
    (earlier / "clusters.json").write_text("{}")
    marker = {"kind": "clusters analysis", "qkvflow_version": "0", "files": ["clusters.json"]}
    (earlier / outputs.MARKER).write_text(json.dumps(marker))
    _refused(capsys, ["analyze", "clusters", "--output", str(earlier)], "pass --overwrite to replace it")
    depth = tmp_path / "depth"
    depth.mkdir()
    (depth / outputs.MARKER).write_text(json.dumps({"kind": "bench depth report", "files": []}))
    _refused(capsys, ["bench", "depth", str(tmp_path / "a.json"), "--out_dir", str(depth)], "pass --overwrite")
    assert (earlier / "clusters.json").read_text() == "{}"


def _argparse_help(parser: argparse.ArgumentParser, option: str) -> str:
    for action in parser._actions:
        if option in action.option_strings:
            return action.help
        if isinstance(action, argparse._SubParsersAction):
            helps = {_argparse_help(p, option) for p in action.choices.values()}
            assert len(helps) == 1, helps
            return helps.pop()
    raise AssertionError(f"{parser.prog} has no {option}")


def test_every_verb_that_writes_files_has_the_same_overwrite():
    """One name and one help text: the argparse verbs use outputs.OVERWRITE_HELP, the config verbs repeat it as
    the field's docstring (what their --help prints)."""
    from draccus.wrappers.docstring import get_attribute_docstring

    from qkvflow.bench import depth_merge, exits, quality
    from qkvflow.bench.comparison import compare
    from qkvflow.bench.performance import scaling, speed
    from qkvflow.cli import analyze, eval, export, generate, plan, tokenizer

    parsers = [analyze._parser(), export._parser(), plan.parser(), speed.parser(), compare._parser()]
    parsers += [depth_merge._parser(), exits._parser(), quality._parser(), scaling._parser()]
    for parser in parsers:
        assert _argparse_help(parser, "--overwrite") == outputs.OVERWRITE_HELP, parser.prog
    for cls in (eval.EvalOptions, generate.GenerateOptions, tokenizer.TokenizerConfig):
        assert get_attribute_docstring(cls, "overwrite").docstring_below == outputs.OVERWRITE_HELP, cls
