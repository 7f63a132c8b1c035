"""`bench compare`: the learning-rate grid's edge and `--extend_grid`, a `--models` subset without the baseline,
and the work folder and report folder it refuses (issues 56 and 57). Training and evaluation are the
deterministic stand-in of test_compare.py (`FakeRuns`)."""

import json
import math
import shutil
import subprocess

import pytest
import yaml

from qkvflow import outputs
from qkvflow.bench.comparison import compare
from qkvflow.errors import UserError
from tests.bench.test_compare import FakeRuns, _main


@pytest.fixture
def study(tmp_path):
    base = {"corpus": {"name": "pydoc"}, "model": {"type": "gpt2"}, "trainer": {"train_batch_size": 2}}
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    spec = {"base": "base.yaml", "baseline": "gpt2", "iters": 5, "learning_rates": [1e-3, 2e-3], "seeds": [0, 1],
            "models": {"gpt2": {"model": {"type": "gpt2", "hidden_dim": 8}},
                       "ode": {"model": {"type": "diffeqformer_gpt2"}}}}  # fmt: skip
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(spec))
    return tmp_path


class Falling(FakeRuns):
    """Selection and test losses that fall monotonically with the learning rate (ode), or rise with it (gpt2):
    every choice is at an edge of every grid. `best` puts ode's minimum at a rate instead."""

    def __init__(self, best=None):
        super().__init__()
        self.best = best

    def loss(self, model, lr, seed, split):
        slope = 0.1 * math.log2(lr / 1e-3)
        shape = abs(math.log2(lr / self.best)) * 0.1 if (model == "ode" and self.best) else -slope
        return 2.0 + (shape if model == "ode" else slope) + 0.01 * seed + (0.05 if split == "test" else 0.0)


def _trained(fake, model):
    return sorted({float(c.split("-lr")[1].split("-s")[0]) for c in fake.calls if c.startswith(f"train {model}-")})


def _result(study, name="study"):
    return json.loads((study / "out" / f"{name}.json").read_text())


def test_a_choice_at_the_grids_edge_is_marked(study, monkeypatch):
    """Without --extend_grid nothing is added; both choices are at an edge (ode the highest, gpt2 the lowest)."""
    fake = Falling()
    assert _main(study, monkeypatch, fake) == 0
    result = _result(study)
    assert {m: (e["best_learning_rate"], e["edge"]) for m, e in result["models"].items()} == {
        "gpt2": (1e-3, "lowest"), "ode": (2e-3, "highest"),
    }  # fmt: skip
    assert _trained(fake, "ode") == [1e-3, 2e-3] and result["models"]["ode"]["added_learning_rates"] == []
    table = (study / "out" / "study.md").read_text()
    assert "| 0.002 (at the grid's edge) |" in table and "| 0.001 (at the grid's edge) |" in table
    assert "ode (highest of [0.001, 0.002])" in table and "--extend_grid" in table
    # an interior choice is not marked: ode's minimum at 2e-3 inside [1e-3, 2e-3, 4e-3]
    fake = Falling(best=2e-3)
    assert _main(study, monkeypatch, fake, "--learning_rates", "1e-3,2e-3,4e-3", "--name", "wide") == 0
    ode = _result(study, "wide")["models"]["ode"]
    assert (ode["best_learning_rate"], ode["edge"]) == (2e-3, None)
    assert "ode (" not in (study / "out" / "wide.md").read_text()


def test_extend_grid_adds_rates_beyond_the_edge_until_its_limit_and_reads_finished_runs_back(study, monkeypatch):
    """Selection losses falling monotonically: --extend_grid 2 adds 4e-3, then 8e-3, and stops at its limit,
    still at the edge; gpt2's rising losses add 5e-4 and 2.5e-4 below. A second invocation with a limit of 3
    trains only the third rate of each and reads every other run back."""
    fake = Falling()
    assert _main(study, monkeypatch, fake, "--extend_grid", "2") == 0
    assert _trained(fake, "ode") == [1e-3, 2e-3, 4e-3, 8e-3] and _trained(fake, "gpt2") == [2.5e-4, 5e-4, 1e-3, 2e-3]
    ode, gpt2 = _result(study)["models"]["ode"], _result(study)["models"]["gpt2"]
    assert (ode["best_learning_rate"], ode["edge"], ode["added_learning_rates"]) == (8e-3, "highest", [4e-3, 8e-3])
    assert ode["learning_rates"] == [1e-3, 2e-3, 4e-3, 8e-3] and set(ode["selection"]) == {
        "0.001",
        "0.002",
        "0.004",
        "0.008",
    }
    assert (gpt2["best_learning_rate"], gpt2["added_learning_rates"]) == (2.5e-4, [5e-4, 2.5e-4])
    assert ode["extend_limit_reached"] and gpt2["extend_limit_reached"]
    assert ode["test"]["per_seed"] == {str(s): pytest.approx(2.0 - 0.3 + 0.01 * s + 0.05) for s in (0, 1)}
    assert (
        "Added by --extend_grid: gpt2 [0.0005, 0.00025], ode [0.004, 0.008]. "
        "Stopped at the limit, still at the edge: gpt2, ode." in (study / "out" / "study.md").read_text()
    )
    again = Falling()
    assert _main(study, monkeypatch, again, "--extend_grid", "3") == 0
    assert [c for c in again.calls if c.startswith("train")] == [f"train gpt2-lr0.000125-s{s}" for s in (0, 1)] + [
        f"train ode-lr0.016-s{s}" for s in (0, 1)
    ]
    assert _result(study)["models"]["ode"]["best_learning_rate"] == 1.6e-2


def test_extend_grid_stops_once_the_choice_is_interior(study, monkeypatch):
    """ode's loss is lowest at 4e-3: 4e-3 is added (chosen, at the edge), then 8e-3, and 4e-3 is interior."""
    fake = Falling(best=4e-3)
    assert _main(study, monkeypatch, fake, "--extend_grid", "--models", "ode") == 0  # the default limit, 3
    ode = _result(study)["models"]["ode"]
    assert (ode["best_learning_rate"], ode["edge"], ode["added_learning_rates"]) == (4e-3, None, [4e-3, 8e-3])
    assert not ode["extend_limit_reached"] and (
        "ode [0.004, 0.008]. Stopped at the limit, still at the edge: gpt2." in (study / "out" / "study.md").read_text()
    )  # gpt2, the baseline that joined, rises with the rate: three rates added, all below
    assert _trained(fake, "ode") == [1e-3, 2e-3, 4e-3, 8e-3]
    with pytest.raises(SystemExit):
        _main(study, monkeypatch, FakeRuns(), "--extend_grid", "0")


def test_a_choice_that_becomes_interior_with_the_last_rate_allowed_is_not_at_the_limit(study, monkeypatch):
    """--extend_grid 1 and ode's minimum at 2e-3: 2e-3 is the highest of [1e-3, 2e-3], so 4e-3 is added (the
    one rate allowed) and 2e-3 is then interior. The limit was used up but did not stop the search at an
    edge: ode is not marked. gpt2 (rising) is still at its lowest edge after its one added rate: marked."""
    assert _main(study, monkeypatch, Falling(best=2e-3), "--extend_grid", "1", "--models", "ode") == 0
    ode, gpt2 = _result(study)["models"]["ode"], _result(study)["models"]["gpt2"]
    assert (ode["best_learning_rate"], ode["edge"], ode["added_learning_rates"]) == (2e-3, None, [4e-3])
    assert ode["extend_limit_reached"] is False
    assert (gpt2["edge"], gpt2["added_learning_rates"], gpt2["extend_limit_reached"]) == ("lowest", [5e-4], True)
    assert "Stopped at the limit, still at the edge: gpt2." in (study / "out" / "study.md").read_text()


def test_a_subset_without_the_baseline_trains_it_in_a_new_work_folder(study, monkeypatch, capsys):
    fake = FakeRuns()
    assert _main(study, monkeypatch, fake, "--models", "ode") == 0
    assert _trained(fake, "gpt2") == [1e-3, 2e-3] and _trained(fake, "ode") == [1e-3, 2e-3]
    out = capsys.readouterr().out
    assert (
        "--models leaves out the baseline gpt2: it joins them, and 4 of its 4 runs are not in "
        f"{study / 'work' / 'results'} and are trained" in out
    )
    result = _result(study)
    assert list(result["models"]) == ["gpt2", "ode"] and result["models"]["ode"]["difference_to_baseline"][
        "mean"
    ] == pytest.approx(-0.1)


def test_a_subset_without_the_baseline_reads_its_finished_runs_back(study, monkeypatch, capsys):
    assert _main(study, monkeypatch, FakeRuns(), "--models", "gpt2") == 0
    capsys.readouterr()
    added = FakeRuns()
    assert _main(study, monkeypatch, added, "--models", "ode", "--name", "added") == 0
    assert added.calls and not any("gpt2" in c for c in added.calls)  # neither trained nor tested again
    assert "it joins them, and its 4 runs are read back from" in capsys.readouterr().out
    assert list(_result(study, "added")["models"]) == ["gpt2", "ode"]


def test_an_out_dir_that_is_or_holds_the_work_folder_is_refused_before_any_run(study, monkeypatch):
    """Issue 56, M14: both absent, so only the --workdir protection can refuse them at the start (otherwise the
    study would train, and the report fail only at the end)."""
    for out, work in ((study / "x", study / "x"), (study / "y", study / "y" / "work")):
        fake = FakeRuns()
        with pytest.raises(UserError, match="--out_dir=.* is or holds --workdir") as e:
            _main(study, monkeypatch, fake, "--out_dir", str(out), "--workdir", str(work))
        assert "\n" not in str(e.value) and fake.calls == [] and not out.exists()


def test_an_out_dir_or_workdir_inside_the_repositorys_shipped_folders_is_refused(study, monkeypatch, tmp_path):
    """Issue 56 item 3: benchmarks/results/mine, as benchmarks/results itself; nothing is written there. The
    repository is a stand-in (a broken check must not write into the real one); SHIPPED is git's list."""
    repo = tmp_path / "repo"
    for name in ("benchmarks/results", "docs", "qkvflow"):
        (repo / name).mkdir(parents=True)
    (repo / "pyproject.toml").write_text("")
    monkeypatch.setattr(outputs, "ROOT", repo)
    for key, folder in (
        ("--out_dir", "benchmarks/results/mine"),
        ("--workdir", "docs/study"),
        ("--out_dir", "qkvflow"),
    ):
        fake = FakeRuns()
        with pytest.raises(UserError, match=f"{key}=.* is inside the repository's shipped folder") as e:
            _main(study, monkeypatch, fake, key, str(repo / folder))
        assert "\n" not in str(e.value) and fake.calls == [] and not any((repo / folder).glob("*"))
    assert _main(study, monkeypatch, FakeRuns(), "--out_dir", str(repo / "work" / "report")) == 0  # outside them
    if shutil.which("git") and (compare.ROOT / ".git").exists():  # the list is git's
        tracked = subprocess.run(["git", "-C", str(compare.ROOT), "ls-tree", "-d", "--name-only", "HEAD"],
                                 capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
        assert sorted(outputs.SHIPPED) == sorted(tracked)


def test_a_typo_in_a_models_config_leaves_the_work_folder_unclaimed(study, monkeypatch):
    """Issue 56 item 5: a misspelled type is refused in one line naming the model before study.json, the
    configs or the data halves are written; the corrected study then starts in the same folder."""
    spec = yaml.safe_load((study / "study.yaml").read_text())
    spec["models"]["ode"]["model"]["type"] = "diffeqformer_gtp2"
    (study / "study.yaml").write_text(yaml.safe_dump(spec))
    fake = FakeRuns()
    with pytest.raises(UserError, match="models.ode: .*diffeqformer_gtp2") as e:
        _main(study, monkeypatch, fake)
    assert "\n" not in str(e.value) and fake.calls == [] and not (study / "work").exists()
    spec["models"]["ode"]["model"] = {"type": "diffeqformer_gpt2", "hiden_dim": 8}  # a misspelled key
    (study / "study.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(UserError, match="models.ode: .*hiden_dim"):
        _main(study, monkeypatch, fake)
    assert not (study / "work").exists()
    spec["models"]["ode"]["model"] = {"type": "diffeqformer_gpt2"}
    (study / "study.yaml").write_text(yaml.safe_dump(spec))
    assert _main(study, monkeypatch, FakeRuns()) == 0


def test_a_model_that_has_not_run_may_change_and_one_that_has_may_not(study, monkeypatch):
    """Issue 56 item 5: the whole study is claimed, then interrupted before ode's first run (gpt2's 4 trainings
    and 1 of its 2 tests done); ode's definition changes, and the study continues with it."""
    assert _main(study, monkeypatch, FakeRuns(stop_before=6)) == 130  # stopped as by Ctrl-C
    assert set(json.loads((study / "work" / "study.json").read_text())["models"]) == {"gpt2", "ode"}
    spec = yaml.safe_load((study / "study.yaml").read_text())
    spec["models"]["ode"]["model"]["time_embed_dim"] = 8  # ode has no run in the folder yet
    (study / "study.yaml").write_text(yaml.safe_dump(spec))
    fake = FakeRuns()
    assert _main(study, monkeypatch, fake) == 0
    assert fake.calls[0] == "eval gpt2-lr0.001-s1" and all(" ode-" in c for c in fake.calls[1:])
    held = json.loads((study / "work" / "study.json").read_text())["models"]
    assert held["ode"]["model"]["time_embed_dim"] == 8
    spec["models"]["ode"]["model"]["time_embed_dim"] = 16  # now it has runs
    (study / "study.yaml").write_text(yaml.safe_dump(spec))
    advice = "give the changed model a new name in the study, or use a new --workdir to start over"
    with pytest.raises(UserError, match=rf"differs in model 'ode', which has runs there\): {advice}"):
        _main(study, monkeypatch, FakeRuns())
