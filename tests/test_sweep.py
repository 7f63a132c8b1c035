"""`qkvflow sweep`: the depth x method grid of fine-tune runs, its table and figure, resuming, bad input."""

import csv
import json

import pytest

from qkvflow.cli import main as cli_main
from tests.finetune_utils import base_args, run_cli, shared_setup, url_data
from tests.train_utils import losses


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    return shared_setup(tmp_path_factory)


ROWS = [
    {"M": 1, "method": "lora", "trainable_params": 2304, "total_params": 81632, "train_loss": 7.1, "eval_loss": 7.3, "eval_perplexity": 1480.3, "run_id": "s-lora-M1"},
    {"M": 4, "method": "lora", "trainable_params": 9216, "total_params": 126656, "train_loss": 7.0, "eval_loss": 7.2, "eval_perplexity": 1339.4, "run_id": "s-lora-M4"},
    {"M": 1, "method": "full", "trainable_params": 79328, "total_params": 79328, "train_loss": 6.4, "eval_loss": 6.9, "eval_perplexity": 992.3, "run_id": "s-full-M1"},
    {"M": 4, "method": "full", "trainable_params": 117440, "total_params": 117440, "train_loss": 6.5, "eval_loss": 6.92, "eval_perplexity": 1012.4, "run_id": "s-full-M4"},
]  # fmt: skip


def test_table_and_figure(tmp_path):
    from qkvflow.finetune.sweep import plot_sweep, write_table

    csv_path, md_path = write_table(ROWS, str(tmp_path), "title")
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    assert [(r["M"], r["method"]) for r in rows] == [("1", "lora"), ("4", "lora"), ("1", "full"), ("4", "full")]
    assert rows[0]["trainable_params"] == "2304" and float(rows[3]["eval_perplexity"]) == 1012.4
    md = open(md_path).read().splitlines()
    assert md[2].startswith(
        "| M | method | trainable params | total params | validation loss before | final train loss"
    )
    assert len([line for line in md if line.startswith("| ") and "lora" in line]) == 2
    png = plot_sweep(ROWS, str(tmp_path / "sweep.png"), pretrained_steps=2)
    assert (tmp_path / "sweep.png").stat().st_size > 10_000 and png.endswith("sweep.png")


def test_grid_arguments():
    from qkvflow.cli.sweep import _split_grid_args, parse_depths, parse_methods
    from qkvflow.errors import UserError

    rest, grid = _split_grid_args(
        ["--config_path", "x.yaml", "--depths", "9,12,18,24", "--methods=lora", "--steps", "3"]
    )
    assert rest == ["--config_path", "x.yaml", "--steps", "3"]
    assert parse_depths(grid["depths"]) == [9, 12, 18, 24] and parse_methods(grid["methods"]) == ["lora"]
    with pytest.raises(UserError, match="--depths='0' is invalid"):
        parse_depths(["0"])
    with pytest.raises(UserError, match="--methods='qlora' is invalid: expected one of lora, full"):
        parse_methods(["lora", "qlora"])


def _fake_finished(workdir, depth, method):
    folder = workdir / "checkpoints" / f"tiny-ft-{method}-M{depth}"
    folder.mkdir(parents=True)
    row = next(r for r in ROWS if r["M"] == depth and r["method"] == method)
    summary = {
        "finished": True, "steps": 6, "run_id": folder.name, "pretrained_steps_N": 2,
        "trainable_parameter_count": row["trainable_params"], "parameter_count": row["total_params"],
        "train_loss": row["train_loss"], "eval_loss": row["eval_loss"], "eval_perplexity": row["eval_perplexity"],
    }  # fmt: skip
    (folder / "finetune_summary.json").write_text(json.dumps(summary))


def test_finished_runs_are_skipped_and_tabulated(tmp_path, shared, capsys):
    corpora, pretrained = shared
    for depth in (1, 4):
        for method in ("lora", "full"):
            _fake_finished(tmp_path, depth, method)
    out = tmp_path / "out"
    args = ["sweep", *base_args(tmp_path, corpora, pretrained), "--depths", "1,4", "--sweep.out_dir", str(out)]
    assert cli_main(args) == 0
    printed = capsys.readouterr().out
    assert printed.count("finished before, skipped") == 4 and "fine-tuning (" not in printed
    with open(out / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["M"], r["method"], r["eval_perplexity"]) for r in rows] == [
        ("1", "lora", "1480.3"),
        ("4", "lora", "1339.4"),
        ("1", "full", "992.3"),
        ("4", "full", "1012.4"),
    ]
    assert (out / "sweep.png").stat().st_size > 10_000 and (out / "sweep.md").exists()


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--methods", "lora,qlora"], "--methods='qlora' is invalid: expected one of lora, full"),
        (["--depths", "4,0"], "--depths='0' is invalid: expected integers >= 1"),
        (["--depths"], "--depths needs a value"),
    ],
    ids=["method", "depth", "no-value"],
)
def test_bad_grid_fails_in_one_line(tmp_path, shared, capsys, extra, message):
    corpora, pretrained = shared
    assert cli_main(["sweep", *base_args(tmp_path, corpora, pretrained), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.slow
def test_two_by_two_grid_end_to_end_and_rerun(tmp_path, shared):
    """M = N/2 and M = 2N (N = 2), LoRA and full: four fine-tune runs on a small repetitive text
    (train = validation); each lowers the validation loss; a rerun trains nothing."""
    from tests.test_finetune import LORA_LR, REPEATED

    corpora, pretrained = shared
    data = tmp_path / "small.jsonl"
    data.write_text("".join(json.dumps({"text": REPEATED}) + "\n" for _ in range(48)))
    args = [
        *base_args(tmp_path, corpora, pretrained), "--depths", "1,4", "--methods", "lora,full",
        *url_data(data, corpora / "pydoc" / "tokenizer", tmp_path / "cache"),
        "--optimizer.learning_rate", LORA_LR,
    ]  # fmt: skip
    proc = run_cli("sweep", tmp_path, *args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "sweeps" / "tiny-ft" / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["M"], r["method"]) for r in rows] == [("1", "lora"), ("4", "lora"), ("1", "full"), ("4", "full")]
    for r in rows:
        assert len(losses(tmp_path, r["run_id"])) == 6
        assert float(r["eval_loss"]) < float(r["initial_eval_loss"]), r
        assert float(r["eval_perplexity"]) > 1
    params = {(r["M"], r["method"]): int(r["trainable_params"]) for r in rows}
    assert params[("1", "lora")] < params[("4", "lora")] < params[("1", "full")] < params[("4", "full")]
    assert (tmp_path / "sweeps" / "tiny-ft" / "sweep.png").stat().st_size > 10_000
    print(open(tmp_path / "sweeps" / "tiny-ft" / "sweep.md").read())
    again = run_cli("sweep", tmp_path, *args)
    assert again.returncode == 0 and again.stdout.count("finished before, skipped") == 4, again.stderr[-2000:]


def test_outputs_that_are_not_qkvflows_are_refused_before_any_training(tmp_path, capsys, monkeypatch):
    """sweep.out_dir and the fine-tune exports replace only qkvflow's own earlier outputs; both are
    checked before anything trains (no pretrained checkpoint is even needed to get there)."""
    import qkvflow.finetune.run

    monkeypatch.setattr(qkvflow.finetune.run, "check_values", lambda config: pytest.fail("got past the output checks"))
    monkeypatch.chdir(tmp_path)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "results.csv").write_text("mine")
    (theirs / "tiny-ft").mkdir()
    (theirs / "tiny-ft" / "weights.bin").write_text("mine too")
    args = base_args(tmp_path, tmp_path / "corpora", tmp_path / "no-checkpoint")
    cases = [
        (
            "sweep",
            ["--sweep.out_dir", str(theirs)],
            f"sweep.out_dir={str(theirs)!r} is not empty and was not written by qkvflow",
        ),
        ("sweep", ["--sweep.out_dir", "."], "sweep.out_dir='.' is or holds the current folder"),
        (
            "sweep",
            ["--sweep.out_dir", "/proc/qkvflow-test/sweep"],
            "sweep.out_dir='/proc/qkvflow-test/sweep' cannot be written",
        ),
        (
            "finetune",
            ["--export.hf_dir", str(theirs)],
            f"export.hf_dir={str(theirs / 'tiny-ft')!r} is not empty and was not written",
        ),
        (
            "finetune",
            ["--export.peft_dir", str(theirs / "results.csv")],
            "export.peft_dir=" + repr(str(theirs / "results.csv" / "tiny-ft")) + " is inside",
        ),
        (
            "finetune",
            ["--trainer.log_dir", "/proc/qkvflow-test/logs"],
            "trainer.log_dir='/proc/qkvflow-test/logs' cannot be written",
        ),
    ]
    for verb, extra, message in cases:
        assert cli_main([verb, *args, *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err and "Traceback" not in err, err
    assert (theirs / "results.csv").read_text() == "mine" and (
        theirs / "tiny-ft" / "weights.bin"
    ).read_text() == "mine too"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["theirs"]
