"""`qkvflow bench depth`: several studies' depth curves as one report (qkvflow.bench.depth_merge)."""

import json
from pathlib import Path

import pytest

from qkvflow.bench import depth_merge
from qkvflow.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def _row(solver, grid, nfe, loss, minus, trained=False):
    return {"solver": solver, "grid": grid, "steps": None, "tolerance": None, "trained": trained, "nfe": nfe,
            "loss": {"mean": loss, "ci95": [loss - 0.1, loss + 0.1]},
            "minus_trained": {"mean": minus, "ci95": None if trained else [minus - 0.01, minus + 0.01]}}  # fmt: skip


def _report(models, iters=300, seeds=(0, 1, 2), title="t"):
    return {"study": "s", "title": title, "iters": iters, "seeds": list(seeds), "grids": {}, "models": models}


BASE_A = [_row("euler", "N=2", 2.0, 2.60, 0.20), _row("euler", "N=4 (trained)", 4.0, 2.40, 0.0, trained=True)]
BASE_B = [_row("euler", "N=4 (trained)", 4.0, 2.4004, 0.0, trained=True), _row("rk4", "N=4", 16.0, 2.70, 0.30)]
RECIPE_1 = [_row("euler", "N=4 (trained)", 4.0, 2.45, 0.0, trained=True), _row("euler", "N=8", 8.0, 2.451, 0.001)]
RECIPE_2 = [_row("rk4", "N=4", 16.0, 2.47, 0.02)]


def _write(tmp_path, name, report):
    path = tmp_path / f"{name}_depth.json"
    path.write_text(json.dumps(report))
    return str(path)


def test_merge_takes_every_model_and_the_union_of_a_shared_models_grids(tmp_path, capsys):
    a = _write(tmp_path, "a", _report({"ode": BASE_A, "one": RECIPE_1}))
    b = _write(tmp_path, "b", _report({"ode": BASE_B, "two": RECIPE_2}))
    out = tmp_path / "merged"
    assert cli_main(["bench", "depth", a, b, "--out_dir", str(out), "--name", "all", "--title", "T"]) == 0
    merged = json.loads((out / "all.json").read_text())
    # the shared baseline: A's rows, then B's grid A lacks (its N=4 row is A's: 0.0004 apart, within 1e-3)
    assert merged["models"] == {"ode": [BASE_A[0], BASE_A[1], BASE_B[1]], "one": RECIPE_1, "two": RECIPE_2}
    assert merged["model_sources"] == {"ode": [a, b], "one": [a], "two": [b]}
    assert (merged["title"], merged["iters"], merged["seeds"], merged["sources"]) == ("T", 300, [0, 1, 2], [a, b])
    assert merged["tolerance"] == 1e-3  # the default, pinned
    table = (out / "all.md").read_text()
    assert table.count("\n| ") == 1 + 3 + 2 + 1  # the header, then one line per merged row
    assert "| ode | rk4 | N=4 | 16.0 | 2.7000 |" in table and "| two | rk4 | N=4 | 16.0 | 2.4700 |" in table
    assert (out / "all.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert all(f"bench depth: wrote {out / f'all.{ext}'}" in printed for ext in ("json", "md", "png"))


@pytest.mark.parametrize(
    "second, extra, message",
    [
        (_report({"ode": BASE_B}, iters=2000), [], "iters=2000, but {a} has 300: merge reports of one budget"),
        (_report({"ode": BASE_B}, seeds=(0, 1)), [], "seeds=[0, 1], but {a} has [0, 1, 2]"),
        (
            _report({"ode": [_row("euler", "N=2", 2.0, 2.603, 0.203)]}),
            [],
            "model 'ode' at euler N=2 has test loss 2.6030, 2.6000 in {a}: more than --tolerance=0.001 apart",
        ),
        ({"models": {}}, [], "not a bench compare depth report: expected the keys models, iters and seeds"),
        (_report([]), [], "not a bench compare depth report"),
    ],
    ids=["iters", "seeds", "not-the-same-model", "not-a-report", "models-not-a-mapping"],
)
def test_reports_that_do_not_merge_are_refused_in_one_line(tmp_path, capsys, second, extra, message):
    a = _write(tmp_path, "a", _report({"ode": BASE_A}))
    b = _write(tmp_path, "b", second)
    out = tmp_path / "merged"
    assert cli_main(["bench", "depth", a, b, "--out_dir", str(out), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"qkvflow bench: error: {b}: ") and message.format(a=a) in err, err
    assert len(err.splitlines()) == 1 and not out.exists()


def test_a_wider_tolerance_merges_runs_of_one_config_from_two_machines(tmp_path):
    a = _write(tmp_path, "a", _report({"ode": BASE_A}))
    b = _write(tmp_path, "b", _report({"ode": [_row("euler", "N=2", 2.0, 2.603, 0.203)]}))
    merged = depth_merge.merge({a: json.loads(Path(a).read_text()), b: json.loads(Path(b).read_text())}, 0.005)
    assert merged["models"]["ode"] == BASE_A and merged["tolerance"] == 0.005


def test_unreadable_report_and_foreign_output_folder_are_refused(tmp_path, capsys):
    a = _write(tmp_path, "a", _report({"ode": BASE_A}))
    broken = tmp_path / "broken_depth.json"
    broken.write_text("{not json")
    assert cli_main(["bench", "depth", a, str(broken), "--out_dir", str(tmp_path / "m")]) == 2
    assert f"{broken}: cannot read a depth report (JSONDecodeError)" in capsys.readouterr().err
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    assert cli_main(["bench", "depth", a, "--out_dir", str(mine)]) == 2
    assert "is not empty and was not written by qkvflow" in capsys.readouterr().err
    assert (mine / "notes.txt").read_text() == "keep" and sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    # the folder holding a report it reads is not replaced either
    assert cli_main(["bench", "depth", a, "--out_dir", str(tmp_path)]) == 2
    assert "is or holds a report it reads" in capsys.readouterr().err and Path(a).is_file()


@pytest.mark.parametrize("name", sorted(p.name for p in RESULTS.glob("depth_dial_all_*.json")))
def test_shipped_merged_reports_regenerate_from_their_sources(name):
    """docs/results.md quotes these: each is exactly what `qkvflow bench depth` makes of its sources today."""
    shipped = json.loads((RESULTS / name).read_text())
    sources = {p: json.loads((ROOT / p).read_text()) for p in shipped["sources"]}
    assert depth_merge.merge(sources, shipped["tolerance"], shipped["title"]) == shipped


def test_there_are_shipped_merged_reports():
    assert len(list(RESULTS.glob("depth_dial_all_*.json"))) >= 2
