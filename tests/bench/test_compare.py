"""`qkvflow bench compare`: the statistics, selection on one split and report on another, resume of an
interrupted grid, and one real run through `qkvflow train` and `qkvflow eval`."""

import copy
import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from qkvflow.bench.comparison import compare, run_processes, stats
from qkvflow.data.corpora import default_shared_dir
from qkvflow.errors import UserError
from qkvflow.outputs import MARKER
from qkvflow.runs.tracking import metrics_file
from tests import warm
from tests.timescale import limit

T_975_4 = 2.7764451051977987  # Student t, 97.5% quantile, 4 degrees of freedom (statistical tables)


def test_paired_interval_is_the_t_interval_of_the_per_seed_differences():
    baseline = {0: 2.00, 1: 2.10, 2: 1.95, 3: 2.05, 4: 1.90}
    shift = {0: -0.31, 1: -0.28, 2: -0.33, 3: -0.27, 4: -0.30}
    model = {s: baseline[s] + shift[s] for s in baseline}
    d = list(shift.values())
    mean = sum(d) / 5
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / 4)
    got = stats.paired_difference(model, baseline)
    eps = 8 * np.finfo(np.float64).eps * 2.1  # a few roundings of numbers about 2
    assert got.seeds == (0, 1, 2, 3, 4)
    assert got.mean == pytest.approx(mean, abs=eps)
    assert got.low == pytest.approx(mean - T_975_4 * sd / math.sqrt(5), abs=1e-9)
    assert got.high == pytest.approx(mean + T_975_4 * sd / math.sqrt(5), abs=1e-9)
    assert got.verdict == "lower"
    assert stats.paired_difference(baseline, model).verdict == "higher"
    # only the seeds both sides have are paired; one seed gives no interval
    assert stats.paired_difference({0: 1.0, 7: 3.0}, {0: 1.5, 1: 9.0}).verdict == "one seed: no interval"
    s = stats.summarise([1.0, 2.0, 4.0])
    assert (s.n, s.mean) == (3, pytest.approx(7 / 3)) and s.std == pytest.approx(
        math.sqrt(((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2 + (4 - 7 / 3) ** 2) / 2)
    )


def test_intervals_cover_a_known_difference_95_percent_of_the_time():
    """Synthetic studies with a known true difference of 0.1 and 3 seeds: the 95% interval must hold
    it in 95% of them (4,000 studies: the binomial standard error is 0.0034). A normal quantile (1.96)
    instead of Student's would cover only about 80%; no pairing would widen it and over-cover."""
    rng = np.random.default_rng(0)
    studies, covered, verdicts = 4000, 0, {"lower": 0, "higher": 0, "no clear difference": 0}
    for _ in range(studies):
        seed_effect = rng.normal(0, 0.2, size=3)  # shared by both models of a seed (init, data order)
        base = 2.0 + seed_effect + rng.normal(0, 0.01, size=3)
        model = 2.1 + seed_effect + rng.normal(0, 0.01, size=3)
        d = stats.paired_difference(dict(enumerate(model)), dict(enumerate(base)))
        covered += d.low <= 0.1 <= d.high
        verdicts[d.verdict] += 1
    assert abs(covered / studies - 0.95) < 4.5 * math.sqrt(0.95 * 0.05 / studies)
    assert verdicts["higher"] > 0.9 * studies  # 0.1 against per-seed noise of 0.014: resolved by 3 paired seeds


# --- the grid, with training and evaluation replaced by a deterministic stand-in -----------------


def _loss(model: str, lr: float, seed: int, split: str) -> float:
    """A made-up loss surface: `ode` is best at lr 2e-3, `gpt2` at 1e-3; the test split is 0.05 higher."""
    best = {"gpt2": 1e-3, "ode": 2e-3}[model]
    return (
        1.8
        + (0.0 if model == "ode" else 0.1)
        + 0.2 * abs(math.log2(lr / best))
        + 0.01 * seed
        + (0.05 if split == "test" else 0.0)
    )


class FakeRuns:
    """Stands in for `run_processes._subprocess`: writes what `qkvflow train` / `qkvflow eval` would, and can
    be told to stop (as an interruption) before its n-th call. A subclass may change the losses (`loss`)
    and the parameter counts a training reports (`parameter_count`, by model)."""

    parameter_count = {"gpt2": 10, "ode": 40}

    def loss(self, model: str, lr: float, seed: int, split: str) -> float:
        return _loss(model, lr, seed, split)

    def __init__(self, stop_before: int | None = None):
        self.calls: list[str] = []
        self.attention: set[str] = set()
        self.stop_before = stop_before

    def __call__(self, cmd, log_file, timeout, attention):
        self.attention.add(attention)
        if self.stop_before is not None and len(self.calls) + 1 >= self.stop_before:
            raise KeyboardInterrupt
        config = yaml.safe_load(Path(cmd[cmd.index("--config_path") + 1]).read_text())
        rid = config["trainer"]["id"]
        model, lr, seed = rid.split("-lr")[0], float(rid.split("-lr")[1].split("-s")[0]), int(rid.rsplit("-s", 1)[1])
        if cmd[3] == "train":
            assert config["corpus"]["eval_split"] == "selection" and config["optimizer"]["learning_rate"] == lr
            assert config["trainer"]["seed"] == config["data_seed"] == seed
            file = Path(metrics_file(config["trainer"]["tracker"]["path"], rid))
            file.parent.mkdir(parents=True, exist_ok=True)
            step = config["trainer"]["num_train_steps"] - 1
            records = [{"event": "summary", "metrics": {"parameter_count": self.parameter_count[model]}},
                       {"event": "log", "step": step, "metrics": {"eval/loss": self.loss(model, lr, seed, "selection"), "train/loss": 1.0}}]  # fmt: skip
            file.write_text("".join(json.dumps(r) + "\n" for r in records))
            (Path(config["trainer"]["checkpointer"]["base_path"]) / rid / "step-1").mkdir(parents=True)
        else:
            assert cmd[cmd.index("--corpus.eval_split") + 1] == "test"
            out = Path(cmd[cmd.index("--output") + 1])
            out.mkdir(parents=True)
            (out / "depth.json").write_text(json.dumps({"rows": [{"loss": self.loss(model, lr, seed, "test")}]}))
        self.calls.append(f"{cmd[3]} {rid}")


@pytest.fixture
def study(tmp_path):
    base = {"corpus": {"name": "pydoc"}, "model": {"type": "gpt2"}, "trainer": {"train_batch_size": 2}}
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    spec = {"base": "base.yaml", "baseline": "gpt2", "iters": 5, "learning_rates": [1e-3, 2e-3], "seeds": [0, 1, 2],
            "models": {"gpt2": {"model": {"type": "gpt2", "hidden_dim": 8}}, "ode": {"model": {"type": "diffeqformer_gpt2"}}}}  # fmt: skip
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(spec))
    return tmp_path


def _main(study_dir, monkeypatch, fake, *extra):
    monkeypatch.setattr(run_processes, "_subprocess", fake)
    monkeypatch.setattr(compare, "training_flops", lambda path, iters: 1.0e9 * iters)
    argv = [
        str(study_dir / "study.yaml"),
        "--workdir",
        str(study_dir / "work"),
        "--out_dir",
        str(study_dir / "out"),
        "--overwrite",  # the tests run a study again into the same folder (its refusal: the test below)
        *extra,
    ]
    return compare.main(argv)


def test_chooses_on_selection_reports_test_and_resumes_an_interrupted_grid(study, monkeypatch):
    fake = FakeRuns(stop_before=8)  # 6 gpt2 runs, the test of its first chosen seed, then stop
    assert _main(study, monkeypatch, fake) == 130  # 128 + SIGINT, as after Ctrl-C
    assert fake.calls == [f"train gpt2-lr{lr:g}-s{s}" for lr in (1e-3, 2e-3) for s in (0, 1, 2)] + [
        "eval gpt2-lr0.001-s0"
    ]
    again = FakeRuns()
    assert _main(study, monkeypatch, again) == 0
    # nothing finished is redone: the other two gpt2 tests, then ode's grid and its chosen tests
    assert again.calls == ["eval gpt2-lr0.001-s1", "eval gpt2-lr0.001-s2"] + [
        f"train ode-lr{lr:g}-s{s}" for lr in (1e-3, 2e-3) for s in (0, 1, 2)
    ] + [f"eval ode-lr0.002-s{s}" for s in (0, 1, 2)]
    result = json.loads((study / "out" / "study.json").read_text())
    gpt2, ode = result["models"]["gpt2"], result["models"]["ode"]
    assert (gpt2["best_learning_rate"], ode["best_learning_rate"]) == (1e-3, 2e-3)
    assert ode["test"]["per_seed"] == {str(s): pytest.approx(1.85 + 0.01 * s) for s in (0, 1, 2)}
    diff = ode["difference_to_baseline"]
    assert (
        diff["mean"] == pytest.approx(-0.1) and diff["verdict"] == "lower"
    )  # identical per-seed shifts: a zero-width interval
    assert (gpt2["parameter_count"], ode["parameter_count"]) == (10, 40)
    assert not any((study / "work" / "checkpoints").iterdir())  # this study's checkpoints, removed once evaluated
    assert (
        "| ode | 0.00M | 5e+09 | 0.002 (at the grid's edge) | 1.8600 ± 0.0100 | -0.1000"
        in (study / "out" / "study.md").read_text()
    )
    assert (study / "out" / "study.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the figure beside the table
    # a third invocation trains nothing
    third = FakeRuns()
    assert _main(study, monkeypatch, third) == 0 and third.calls == []
    # nor does one that pairs with another baseline: gpt2 is now 0.1 above ode in every seed
    assert _main(study, monkeypatch, third, "--baseline", "ode", "--name", "vs_ode") == 0 and third.calls == []
    result = json.loads((study / "out" / "vs_ode.json").read_text())
    assert result["baseline"] == "ode" and "difference_to_baseline" not in result["models"]["ode"]
    diff = result["models"]["gpt2"]["difference_to_baseline"]
    assert diff["mean"] == pytest.approx(0.1) and diff["verdict"] == "higher"


def test_a_work_folder_of_another_study_or_of_other_files_is_refused(study, monkeypatch, tmp_path):
    assert _main(study, monkeypatch, FakeRuns(), "--models", "gpt2") == 0
    with pytest.raises(UserError, match="holds another study .*differs in base or iters"):
        _main(study, monkeypatch, FakeRuns(), "--iters", "7", "--models", "gpt2")
    # a model added later joins the study; gpt2's finished runs are not redone
    added = FakeRuns()
    assert _main(study, monkeypatch, added) == 0
    assert added.calls and all(" ode-" in call for call in added.calls)
    assert set(json.loads((study / "work" / "study.json").read_text())["models"]) == {"gpt2", "ode"}
    # but a model whose definition changed is another study
    spec = yaml.safe_load((study / "study.yaml").read_text())
    spec["models"]["gpt2"]["model"]["hidden_dim"] = 16
    (study / "study.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(UserError, match="differs in model 'gpt2'"):
        _main(study, monkeypatch, FakeRuns())
    other = tmp_path / "other"
    (other / "work").mkdir(parents=True)
    (other / "work" / "notes.txt").write_text("mine")
    for name in ("study.yaml", "base.yaml"):
        (other / name).write_text((study / name).read_text())
    with pytest.raises(UserError, match="not empty and holds no study.json"):
        _main(other, monkeypatch, FakeRuns())
    assert (other / "work" / "notes.txt").read_text() == "mine"


def test_a_model_with_its_own_grid_is_chosen_within_it(study, monkeypatch):
    """`models.ode.learning_rates` replaces the study's grid for ode alone; `--learning_rates` is every model's."""
    spec = yaml.safe_load((study / "study.yaml").read_text())
    spec["models"]["ode"]["learning_rates"] = [2e-3, 4e-3]
    (study / "study.yaml").write_text(yaml.safe_dump(spec))
    fake = FakeRuns()
    assert _main(study, monkeypatch, fake) == 0
    trained = [c for c in fake.calls if c.startswith("train")]
    assert trained == [f"train gpt2-lr{lr:g}-s{s}" for lr in (1e-3, 2e-3) for s in (0, 1, 2)] + [
        f"train ode-lr{lr:g}-s{s}" for lr in (2e-3, 4e-3) for s in (0, 1, 2)
    ]
    result = json.loads((study / "out" / "study.json").read_text())
    assert (
        result["models"]["ode"]["learning_rates"] == [2e-3, 4e-3]
        and result["models"]["ode"]["best_learning_rate"] == 2e-3
    )
    assert result["models"]["gpt2"]["learning_rates"] == [1e-3, 2e-3]
    assert "ode from [0.002, 0.004]" in (study / "out" / "study.md").read_text()
    # the grid is not part of the model's definition: the same work folder takes the command line's grid
    fake = FakeRuns()
    assert _main(study, monkeypatch, fake, "--learning_rates", "1e-3", "--name", "one") == 0
    assert [c for c in fake.calls if c.startswith("train")] == [f"train ode-lr0.001-s{s}" for s in (0, 1, 2)]
    spec["models"]["ode"]["learning_rates"] = [0]
    (study / "study.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(UserError, match=r"models.ode.learning_rates=\[0\] is invalid: expected numbers in \(0, 1\)"):
        _main(study, monkeypatch, FakeRuns())


def test_jobs_run_trainings_at_once_and_report_what_one_job_reports(study, monkeypatch, tmp_path):
    """`--jobs 4`: every model's grid is queued at the start and four runs are in flight together (a barrier
    of four parties is passed only if they are); the report equals the sequential study's."""
    import threading

    gate, lock, started = threading.Barrier(4, timeout=limit(20)), threading.Lock(), []

    class Together(FakeRuns):
        def __call__(self, cmd, log_file, timeout, attention):
            with lock:
                started.append(cmd[3])
                first = len(started) <= 4
            if first:
                gate.wait()  # BrokenBarrierError after 20 s unless the first four trainings run at once
            super().__call__(cmd, log_file, timeout, attention)

    parallel = Together()
    assert _main(study, monkeypatch, parallel, "--jobs", "4") == 0
    assert sorted(parallel.calls) == sorted(
        [f"train {m}-lr{lr:g}-s{s}" for m in ("gpt2", "ode") for lr in (1e-3, 2e-3) for s in (0, 1, 2)]
        + [f"eval gpt2-lr0.001-s{s}" for s in (0, 1, 2)]
        + [f"eval ode-lr0.002-s{s}" for s in (0, 1, 2)]
    )
    assert not any((study / "work" / "checkpoints").iterdir())
    together = json.loads((study / "out" / "study.json").read_text())
    (tmp_path / "seq").mkdir()
    for name in ("base.yaml", "study.yaml"):
        (tmp_path / "seq" / name).write_text((study / name).read_text())
    assert _main(tmp_path / "seq", monkeypatch, FakeRuns()) == 0
    alone = json.loads((tmp_path / "seq" / "out" / "study.json").read_text())
    for report in (together, alone):  # everything but the runs' wall times
        for entry in report["models"].values():
            entry.pop("wall_s")
    assert together == alone
    with pytest.raises(SystemExit):
        _main(study, monkeypatch, FakeRuns(), "--jobs", "0")


def test_with_jobs_a_models_test_evaluations_go_before_later_models_trainings(study, monkeypatch):
    """`--jobs 2`: gpt2's three test evaluations start as soon as its grid is trained, ahead of the ode
    trainings still queued (in submission order they would wait for all twelve trainings)."""
    import time

    class Slow(FakeRuns):
        def __call__(self, cmd, log_file, timeout, attention):
            time.sleep(0.2)  # time for the main thread to choose gpt2's rate and queue its tests
            super().__call__(cmd, log_file, timeout, attention)

    fake = Slow()
    assert _main(study, monkeypatch, fake, "--jobs", "2") == 0
    evals = [i for i, c in enumerate(fake.calls) if c.startswith("eval gpt2")]
    ode_trains = [i for i, c in enumerate(fake.calls) if c.startswith("train ode")]
    assert len(evals) == 3 and len(ode_trains) == 6
    assert max(evals) < ode_trains[-2], fake.calls  # at most one ode run slipped in before each test began


@pytest.mark.parametrize(
    "change, message",
    [
        ({"baseline": "llama"}, "baseline='llama' is not one of the models"),
        ({"seeds": [0, 0]}, "seeds=[0, 0] is invalid"),
        ({"learning_rates": [3]}, "learning_rates=[3] is invalid"),
        ({"iters": 0}, "iters=0 is invalid"),
        ({"base": "nope.yaml"}, "base='nope.yaml': no such file"),
        ({"modles": {}}, "unknown key(s) ['modles']"),
    ],
)
def test_bad_studies_are_refused_in_one_line(study, monkeypatch, change, message):
    spec = yaml.safe_load((study / "study.yaml").read_text()) | change
    (study / "study.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")) as e:
        _main(study, monkeypatch, FakeRuns())
    assert "\n" not in str(e.value)


def test_every_run_gets_the_one_attention_kernel(study, monkeypatch):
    fake = FakeRuns()
    assert _main(study, monkeypatch, fake, "--attention", "xla", "--seeds", "0") == 0
    assert fake.attention == {"xla"} and len(fake.calls) == 6  # 2 models x 2 rates, then 2 test evaluations
    assert json.loads((study / "out" / "study.json").read_text())["attention"] == "xla"
    with pytest.raises(UserError, match="--attention=flash9 is invalid"):
        _main(study, monkeypatch, FakeRuns(), "--attention", "flash9")
    spec = yaml.safe_load((study / "study.yaml").read_text())
    spec["models"]["gpt2"]["model"]["attn_backend"] = "vanilla"
    (study / "study.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(UserError, match="model gpt2 sets model.attn_backend=vanilla"):
        _main(study, monkeypatch, FakeRuns())


# --- one real run ----------------------------------------------------------------------------------


def test_a_real_run_trains_on_selection_and_is_evaluated_on_test(tmp_path, corpus_root, monkeypatch):
    """The smallest study through the real verbs: one tiny GPT-2, one seed, three steps on pydoc (its
    `python -m qkvflow` command lines started from the suite's warm interpreter, tests/warm.py)."""
    runs = warm.Subprocess()
    monkeypatch.setattr(run_processes, "subprocess", runs)
    base = Path(__file__).resolve().parents[2] / "benchmarks" / "compare" / "base_pydoc.yaml"
    spec = {"base": str(base), "baseline": "tiny", "iters": 3, "learning_rates": [1e-3], "seeds": [0],
            "models": {"tiny": {"model": {"type": "gpt2", "max_seq_len": 32, "hidden_dim": 32, "num_heads": 2, "num_layers": 1},
                                "trainer": {"train_batch_size": 4, "per_device_eval_parallelism": 4, "max_eval_batches": 2,
                                            "log_jaxprs": False, "log_xla_hlo": False}}}}  # fmt: skip
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(spec))
    argv = [str(tmp_path / "study.yaml"), "--workdir", str(tmp_path / "work"), "--out_dir", str(tmp_path / "out"),
            "--corpus_root", str(corpus_root)]  # fmt: skip
    assert compare.main(argv) == 0
    assert runs.verbs == ["train", "eval"]
    run = json.loads((tmp_path / "work" / "results" / "tiny-lr0.001-s0.json").read_text())
    test = json.loads((tmp_path / "work" / "results" / "tiny-lr0.001-s0.test.json").read_text())["test_loss"]
    assert 0 < run["selection_loss"] < 9 and 0 < test < 9 and run["selection_loss"] != test  # two different halves
    assert run["parameter_count"] == 32 * 2048 + 32 * 32 + 1 * (12 * 32 * 32 + 13 * 32) + 2 * 32
    result = json.loads((tmp_path / "out" / "study.json").read_text())
    (seq, batch, steps) = (32, 4, 3)
    flops = result["models"]["tiny"]["training_flops"]
    assert flops > 3 * 2 * 12 * 32 * 32 * seq * batch * steps  # at least the layers' matmuls, forward and backward
    assert not (tmp_path / "work" / "checkpoints" / "tiny-lr0.001-s0").exists()


def test_the_report_goes_to_the_work_folder_and_an_out_dir_is_checked_like_every_output(study, monkeypatch, capsys):
    """Issue 31: the report is written into --workdir (never into the repository's benchmarks/results
    implicitly) and its paths are printed; an --out_dir that holds files qkvflow did not write (as the
    shipped benchmarks/results does) is refused in one line before the work folder is claimed or any
    run trains, and its files survive."""
    results = compare.ROOT / "benchmarks" / "results"
    shipped = {p.name: p.stat().st_mtime_ns for p in results.iterdir()} if results.is_dir() else {}
    monkeypatch.setattr(run_processes, "_subprocess", FakeRuns())
    monkeypatch.setattr(compare, "training_flops", lambda path, iters: 1.0e9 * iters)
    work = study / "work"
    assert compare.main([str(study / "study.yaml"), "--workdir", str(work), "--models", "gpt2"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[-3:] == [f"bench compare: wrote {work / 'report' / f'study.{ext}'}" for ext in ("json", "md", "png")]
    assert (work / "report" / "study.md").read_text().startswith("study: 5 steps")
    assert "models" in json.loads((work / "study.json").read_text())  # the work folder's marker, not the report
    if results.is_dir():
        assert {p.name: p.stat().st_mtime_ns for p in results.iterdir()} == shipped

    theirs = study / "theirs"
    theirs.mkdir()
    (theirs / "compare_x.md").write_text("shipped")
    fake = FakeRuns()
    with pytest.raises(UserError, match="--out_dir=.* is not empty and was not written by qkvflow") as e:
        _main(study, monkeypatch, fake, "--out_dir", str(theirs), "--workdir", str(study / "fresh"))
    assert "\n" not in str(e.value) and fake.calls == [] and not (study / "fresh").exists()
    assert (theirs / "compare_x.md").read_text() == "shipped"

    out = study / "out"  # an earlier report of qkvflow's: replaced only with --overwrite (issue 62)
    argv = [str(study / "study.yaml"), "--workdir", str(work), "--models", "gpt2", "--out_dir", str(out)]
    assert compare.main(argv) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    fake = FakeRuns()
    monkeypatch.setattr(run_processes, "_subprocess", fake)
    with pytest.raises(UserError, match=f"--out_dir={str(out)!r} holds an earlier qkvflow bench compare report: pass "):
        compare.main([*argv, "--name", "again"])
    assert fake.calls == [] and {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert compare.main([*argv, "--name", "again", "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == [f"again.{e}" for e in ("json", "md", "png")] + [MARKER]


# --- a study on the user's own corpus -----------------------------------------------------------------


def _own_corpus(folder: Path) -> None:
    """A tiny corpus as `qkvflow tokenizer` makes it (a 300-token byte-level BPE, train/validation jsonl)."""
    from qkvflow.data.tokenizer_folder import build_tokenizer_folder

    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly boxers".split()
    docs = [" ".join(words[(i * 7 + j) % len(words)] for j in range(40)) for i in range(60)]
    source = folder / "mytext.jsonl"
    source.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    build_tokenizer_folder([str(source)], str(folder / "cache" / "own"), vocab_size=300, validation_fraction=0.2)


OWN_BASE = """data:
  tokenizer: cache/own
  cache_dir: cache/own/levanter_cache
  shuffle: false
  components:
    own:
      source:
        type: url
        train_urls: [cache/own/train.jsonl]
        validation_urls: [cache/own/validation.jsonl]
trainer:
  train_batch_size: 4
  per_device_eval_parallelism: 4
  max_eval_batches: 2
  mp: p=f32,c=f32
  require_accelerator: false
  log_jaxprs: false
  log_xla_hlo: false
  watch: {interval: 0}
"""


def test_a_study_on_the_users_own_corpus_end_to_end(tmp_path, monkeypatch):
    """Issue 31: a base config with a `data:` section (a corpus made by `qkvflow tokenizer`, paths relative
    to the folder the study starts in): the selection and test halves are the validation documents at even
    and odd positions (built here from the file), the run trains evaluating on the first and is tested on
    the second, and the report is written. A tiny GPT-2, one seed, three steps (tests/warm.py starts its
    command lines)."""
    monkeypatch.chdir(tmp_path)
    runs = warm.Subprocess()
    monkeypatch.setattr(run_processes, "subprocess", runs)
    _own_corpus(tmp_path)
    (tmp_path / "base.yaml").write_text(OWN_BASE)
    spec = {"base": "base.yaml", "baseline": "tiny", "iters": 3, "learning_rates": [1e-3], "seeds": [0],
            "models": {"tiny": {"model": {"type": "gpt2", "max_seq_len": 32, "hidden_dim": 32, "num_heads": 2,
                                          "num_layers": 1}}}}  # fmt: skip
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(spec))
    work = tmp_path / "work"
    assert compare.main([str(tmp_path / "study.yaml"), "--workdir", str(work)]) == 0
    assert runs.verbs == ["train", "eval"]
    validation = [line for line in (tmp_path / "cache" / "own" / "validation.jsonl").read_text().splitlines() if line]
    assert len(validation) >= 4
    assert (work / "data" / "own.selection.jsonl").read_text().splitlines() == validation[0::2]
    assert (work / "data" / "own.test.jsonl").read_text().splitlines() == validation[1::2]
    train = yaml.safe_load((work / "configs" / "tiny-lr0.001-s0.yaml").read_text())
    test = yaml.safe_load((work / "configs" / "tiny-lr0.001-s0.test.yaml").read_text())
    assert train["data"]["components"]["own"]["source"]["validation_urls"] == [
        str(work / "data" / "own.selection.jsonl")
    ]
    assert test["data"]["components"]["own"]["source"]["validation_urls"] == [str(work / "data" / "own.test.jsonl")]
    assert train["data"]["tokenizer"] == str(tmp_path / "cache" / "own")  # relative to where the study started
    run = json.loads((work / "results" / "tiny-lr0.001-s0.json").read_text())
    tested = json.loads((work / "results" / "tiny-lr0.001-s0.test.json").read_text())["test_loss"]
    assert 0 < run["selection_loss"] < 9 and 0 < tested < 9 and run["selection_loss"] != tested  # two halves
    result = json.loads((work / "report" / "study.json").read_text())
    assert result["models"]["tiny"]["test"]["per_seed"] == {"0": tested}


@pytest.mark.parametrize(
    "base, message",
    [
        ("model: {type: gpt2}\n", "expected a `corpus:` section or a `data:` section with `components`"),
        ("corpus: {name: mine}\n", "corpus.name: expected one of"),
        (OWN_BASE.replace("validation_urls: [cache/own/validation.jsonl]", "validation_urls: []"),
         "data.components.own.source.validation_urls is empty"),
        (OWN_BASE.replace("cache/own/validation.jsonl", "cache/own/missing.jsonl"), "'cache/own/missing.jsonl' is not a local .jsonl file"),
    ],
)  # fmt: skip
def test_a_bad_base_config_is_refused_before_the_work_folder_is_claimed(tmp_path, monkeypatch, base, message):
    monkeypatch.chdir(tmp_path)
    _own_corpus(tmp_path)
    (tmp_path / "base.yaml").write_text(base)
    spec = {"base": "base.yaml", "baseline": "a", "iters": 3, "learning_rates": [1e-3], "seeds": [0],
            "models": {"a": {"model": {"type": "gpt2"}}}}  # fmt: skip
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(spec))
    monkeypatch.setattr(run_processes, "_subprocess", FakeRuns())
    with pytest.raises(UserError) as e:
        compare.main([str(tmp_path / "study.yaml"), "--workdir", str(tmp_path / "work")])
    assert message in str(e.value) and "\n" not in str(e.value) and str(tmp_path / "base.yaml") in str(e.value)
    assert not (tmp_path / "work").exists()


# --- the shipped studies ----------------------------------------------------------------------------


def _study(name, tmp_path):
    """The shipped study `name` as `bench compare` reads it, its matched widths solved (`compare.resolve`)."""
    args = compare._parser().parse_args([str(STUDIES / f"{name}.yaml"), "--workdir", str(tmp_path)])  # no overrides
    study = compare.load_study(str(STUDIES / f"{name}.yaml"), args)
    compare.resolve(study, tmp_path, str(tmp_path))
    return study


def _study_configs(name, tmp_path):
    """Each model's full run config of the shipped study `name`, parsed as `qkvflow train` parses it."""
    from qkvflow.runs.config import TrainConfig
    from qkvflow.runs.configfile import parse

    study = _study(name, tmp_path)
    out = {}
    for model in study["models"]:
        path = tmp_path / f"{name}-{model}.yaml"
        path.write_text(yaml.safe_dump(compare.run_config(study, model, 1e-3, 0, tmp_path, str(tmp_path))))
        out[model] = (parse(TrainConfig, ["--config_path", str(path)], "train"), path)
    return out


STUDIES = Path(__file__).resolve().parents[2] / "benchmarks" / "compare"
SHAKESPEARE = default_shared_dir() / "data" / "tinyshakespeare" / "input.txt"  # $QKVFLOW_SHARED_DIR, as the corpus
needs_shakespeare = pytest.mark.skipif(
    not SHAKESPEARE.is_file(),
    reason=f"{SHAKESPEARE} absent: set QKVFLOW_SHARED_DIR to the folder holding data/tinyshakespeare/input.txt",
)


@needs_shakespeare
def test_the_shipped_studies_match_what_their_comments_claim(tmp_path):
    """Same data, budget and optimizer for every model of a study; the parameter-matched GPT-2 within 5%
    of the DiffEqFormer's parameters, the FLOP-matched one within 3% of its training FLOPs."""
    from qkvflow.data.corpora import corpus_vocab_size
    from qkvflow.models import accounting, registry

    studies = ("tinyshakespeare", "pydoc", "beta2", "rk_blocks", "transevolve", "exits", "finetune_pretrain")
    dial = ("depth_dial", "depth_dial_pydoc", "depth_dial_screen", "depth_dial_screen_pydoc", "depth_dial_confirm",
            "depth_dial_confirm_pydoc", "depth_dial_impulse", "depth_dial_rest", "depth_dial_rest_pydoc", "depth_dial_lr",
            "depth_dial_lr_wide", "depth_dial_lr_pydoc")  # fmt: skip
    for name in (*studies, *dial):
        configs, study = _study_configs(name, tmp_path), _study(name, tmp_path)
        reference = next(iter(configs.values()))[0]
        for model, (config, _) in configs.items():
            same_trainer = dataclasses.replace(config.trainer, id=reference.trainer.id) == reference.trainer
            assert config.corpus == reference.corpus and same_trainer, (name, model)
            assert config.model.max_seq_len == 64 and config.optimizer.learning_rate == 1e-3, (name, model)
            grid = compare.learning_rates(study, model)
            own = {"depth_dial_lr": {"ode": [4e-3]}, "depth_dial_lr_wide": {"ode": [8e-3]}}.get(
                name, {"gpt2_params": [2.5e-4, 5e-4, 1e-3, 2e-3]}
            )
            assert grid == own.get(model, study["learning_rates"]), model
        if name == "tinyshakespeare":
            vocab = corpus_vocab_size("tinyshakespeare")
            params = {
                m: accounting.count(accounting.model_shapes(configs[m][0].model, vocab))
                for m in ("gpt2", "gpt2_params", "ode")
            }
            assert abs(params["gpt2_params"] / params["ode"] - 1) < 0.05, params
            assert params["gpt2"] < params["ode"] / 10  # why the matched baselines are needed
            flops = {m: compare.training_flops(configs[m][1], 2000) for m in ("gpt2_flops", "ode")}
            assert abs(flops["gpt2_flops"] / flops["ode"] - 1) < 0.03, flops
            assert [configs[m][0].model.time_embed_dim for m in ("ode_d16", "ode_d32", "ode")] == [16, 32, 64]
            llama, ode_llama = configs["llama"][0].model, configs["ode_llama"][0].model
            assert registry.type_name(ode_llama) == "diffeqformer_llama" and ode_llama.ode.num_steps == llama.num_layers
            assert (ode_llama.hidden_dim, ode_llama.intermediate_dim) == (llama.hidden_dim, llama.intermediate_dim)
        if name.startswith("depth_dial"):  # every recipe on today's DiffEqFormer at N = 4 Euler steps
            assert all(c.model.ode == configs["ode"][0].model.ode for c, _ in configs.values())
            assert configs["ode"][0].model.ode.num_steps == 4 and not configs["ode"][0].model.dial.active
            if "steps_drawn" in configs:
                assert configs["steps_drawn"][0].model.dial.train_steps == (2, 4, 8)
            if "slow_time" in configs:
                assert configs["slow_time"][0].model.time_scale == 4.0
            if "steps_wide" in configs:
                assert configs["steps_wide"][0].model.dial.train_steps == (2, 4, 8, 16)
            if "wide_jitter" in configs:  # steps_wide's counts, only the grid's inner times moved
                wide, jittered = configs["steps_wide"][0].model, configs["wide_jitter"][0].model
                assert jittered.dial == dataclasses.replace(wide.dial, jitter=0.9) and wide.dial.jitter == 0
            if "wide_random" in configs:  # wide_jitter with the random Euler scheme, nothing else changed
                jittered, drawn = configs["wide_jitter"][0].model, configs["wide_random"][0].model
                assert drawn.dial == dataclasses.replace(jittered.dial, random_time=True)
            if (
                "wide_slow" in configs and "steps_wide" in configs
            ):  # steps_wide's counts, jitter 0.9 and slow_time's features
                wide, slow = configs["steps_wide"][0].model, configs["wide_slow"][0].model
                features = {"time_scale": 4.0, "num_frequencies": 16, "time_max_period": 100.0}
                jittered = dataclasses.replace(wide, dial=dataclasses.replace(wide.dial, jitter=0.9))
                assert slow == dataclasses.replace(jittered, **features)
            if name.startswith("depth_dial_rest"):  # each recipe alone on today's model: one change each
                base = configs["ode"][0].model
                alone = {"jitter": {"jitter": 0.5}, "consistency": {"consistency_weight": 1.0}, "steer": {"steer": 0.25},
                         "jacobian": {"jacobian_weight": 0.01}}  # fmt: skip
                for model, change in alone.items():
                    assert configs[model][0].model == dataclasses.replace(
                        base, dial=dataclasses.replace(base.dial, **change)
                    ), model
                slow, features = configs["slow_consistency"][0].model, {"time_scale": 4.0, "num_frequencies": 16}
                consistency = dataclasses.replace(configs["consistency"][0].model, time_max_period=100.0, **features)
                assert slow == consistency  # slow_time's features, nothing else changed
            if name in ("depth_dial_lr", "depth_dial_lr_wide"):  # the impulse screen's models, budget and grids
                impulse, screen = _study_configs("depth_dial_impulse", tmp_path), _study("depth_dial_impulse", tmp_path)
                assert {m: configs[m][0].model for m in configs} == {m: impulse[m][0].model for m in configs}
                assert (study["iters"], study["depth"], study["seeds"]) == (
                    screen["iters"],
                    screen["depth"],
                    screen["seeds"],
                )
                rates = {m: {*compare.learning_rates(study, m), *compare.learning_rates(screen, m)} for m in configs}
                expected = {  # the impulse screen's 2e-3 and each study's own rates, per model
                    "depth_dial_lr": {"ode": {2e-3, 4e-3}, "wide_slow": {1e-3, 2e-3, 4e-3}},
                    "depth_dial_lr_wide": {
                        "ode": {2e-3, 8e-3},
                        "steps_wide": {2e-3, 4e-3},
                        "wide_jitter": {2e-3, 4e-3},
                    },
                }
                assert rates == expected[name], rates
            if name == "depth_dial_lr_pydoc":  # the pydoc screen's models, budget and seeds; its 2e-3 runs
                name_of_screen = "depth_dial_screen_pydoc"
                screen_configs, screen = _study_configs(name_of_screen, tmp_path), _study(name_of_screen, tmp_path)
                assert {m: c.model for m, (c, _) in configs.items()} == {m: screen_configs[m][0].model for m in configs}
                budget = ("iters", "seeds", "base")
                assert [study[k] for k in budget] == [screen[k] for k in budget]
                rates = {m: {*compare.learning_rates(study, m), *compare.learning_rates(screen, m)} for m in configs}
                assert rates == {"ode": {2e-3, 4e-3, 8e-3}, "steps_wide": {2e-3, 4e-3, 8e-3}}, rates
            if name.startswith("depth_dial_confirm"):  # enough passes over the data for 2000 steps
                assert study["iters"] == 2000 and all(
                    c.epochs >= (20 if "pydoc" in name else 10) for c, _ in configs.values()
                )
        if name == "finetune_pretrain":  # N = 6 steps, GPT-2 at N and 4N/3 layers, one width
            depth = {
                m: c.model.ode.num_steps if m.startswith("ode") else c.model.num_layers for m, (c, _) in configs.items()
            }
            assert depth == {"ode_n6": 6, "gpt2_l6": 6, "gpt2_l8": 8}
            assert {c.model.hidden_dim for c, _ in configs.values()} == {128}
        if name == "beta2":
            assert {m: c.optimizer.beta2 for m, (c, _) in configs.items()} == {
                "gpt2_b999": 0.999, "gpt2_b95": 0.95, "ode_b999": 0.999, "ode_b95": 0.95,
            }  # fmt: skip
        if name == "exits":  # n-layer baselines and one aligned model with an exit after each of its 6 blocks
            assert {m: (registry.type_name(c.model), c.model.num_layers) for m, (c, _) in configs.items()} == {
                "layers_1": ("parallel_gpt2", 1), "layers_2": ("parallel_gpt2", 2), "layers_3": ("parallel_gpt2", 3),
                "layers_6": ("parallel_gpt2", 6), "aligned_6": ("adaptive_gpt2", 6),
            }  # fmt: skip
            assert (configs["aligned_6"][0].model.exit_heads, configs["aligned_6"][0].model.exit_training) == (
                "tied", "aligned",
            )  # fmt: skip
        if name == "rk_blocks":
            assert {m: (c.model.num_layers, c.model.block_scheme) for m, (c, _) in configs.items()} == {
                "euler_1": (1, "euler"), "rk2_1": (1, "rk2"), "rk2_unit_1": (1, "rk2_unit"),
                "rk2_gated_1": (1, "rk2_gated"), "rk4_1": (1, "rk4"), "euler_2": (2, "euler"),
                "seq_euler_1": (1, "euler"), "seq_rk2_1": (1, "rk2"), "seq_euler_2": (2, "euler"),
            }  # fmt: skip
            sequential = {m for m, (c, _) in configs.items() if c.model.sequential}
            assert sequential == {"seq_euler_1", "seq_rk2_1", "seq_euler_2"}
        if name == "transevolve":
            shapes = {
                m: (c.model.num_layers, getattr(c.model, "num_blocks", 1), getattr(c.model, "ffn", "-"))
                for m, (c, _) in configs.items()
            }
            assert shapes == {
                "gpt2": (6, 1, "-"), "fullff_2": (6, 2, "full"), "fullff_1": (6, 1, "full"),
                "randomff_2": (6, 2, "random"), "randomff_1": (6, 1, "random"),
            }  # fmt: skip
            assert all(compare.training_flops(path, 300) > 0 for _, path in configs.values())


class DepthRuns(FakeRuns):
    """FakeRuns whose `qkvflow eval` with --steps writes one row per grid: the trained N = 2 at the test
    loss, N = 1 at +0.3 + 0.01 seed, N = 4 at -0.01 seed (grid rows as qkvflow.evaluation.depth labels them)."""

    def __call__(self, cmd, log_file, timeout, attention):
        super().__call__(cmd, log_file, timeout, attention)
        if cmd[3] != "eval" or "--steps" not in cmd:
            return
        assert cmd[cmd.index("--steps") + 1] == "N/2,N,2N" and cmd[cmd.index("--solver") + 1] == "euler"
        out = Path(cmd[cmd.index("--output") + 1])
        (loss,) = (r["loss"] for r in json.loads((out / "depth.json").read_text())["rows"])
        seed = int(self.calls[-1].rsplit("-s", 1)[1])
        rows = [{"solver": "euler", "grid": f"N={n}", "steps": n, "tolerance": None, "nfe": n, "trained": n == 2,
                 "loss": loss + {1: 0.3 + 0.01 * seed, 2: 0.0, 4: -0.01 * seed}[n]} for n in (1, 2, 4)]  # fmt: skip
        (out / "depth.json").write_text(json.dumps({"rows": rows}))


def test_a_depth_section_evaluates_ode_runs_at_every_grid_and_reports_intervals(study, monkeypatch):
    spec = yaml.safe_load((study / "study.yaml").read_text())
    spec["depth"] = {"steps": "N/2,N,2N", "solver": "euler"}
    (study / "study.yaml").write_text(yaml.safe_dump(spec))
    fake = DepthRuns()
    assert _main(study, monkeypatch, fake) == 0
    result = json.loads((study / "out" / "study.json").read_text())
    # the test loss of a run is its row at the trained grid
    assert result["models"]["ode"]["test"]["per_seed"] == {str(s): _loss("ode", 2e-3, s, "test") for s in (0, 1, 2)}
    curves = json.loads((study / "out" / "study_depth.json").read_text())
    assert list(curves["models"]) == ["ode"]  # gpt2 has a fixed depth: no grids asked of it
    by_grid = {g["grid"]: g for g in curves["models"]["ode"]}
    coarse = [0.3 + 0.01 * s for s in (0, 1, 2)]  # N = 1 minus N = 2, per seed
    half = T_975_2 * np.std(coarse, ddof=1) / math.sqrt(3)
    assert by_grid["N=1"]["minus_trained"]["mean"] == pytest.approx(0.31, abs=1e-12)
    assert by_grid["N=1"]["minus_trained"]["ci95"] == pytest.approx([0.31 - half, 0.31 + half], abs=1e-12)
    assert by_grid["N=2"]["trained"] and by_grid["N=2"]["minus_trained"]["mean"] == 0.0
    losses = [_loss("ode", 2e-3, s, "test") - 0.01 * s for s in (0, 1, 2)]
    half = T_975_2 * np.std(losses, ddof=1) / math.sqrt(3)
    assert by_grid["N=4"]["loss"]["ci95"] == pytest.approx([np.mean(losses) - half, np.mean(losses) + half])
    assert (study / "out" / "study_depth.png").is_file() and "| ode | euler | N=2 (trained) |" in (
        study / "out" / "study_depth.md"
    ).read_text()
    spec["depth"] = {"step": "N"}
    (study / "study.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(UserError, match="depth=.* is invalid: expected a mapping with keys among"):
        _main(study, monkeypatch, DepthRuns())


T_975_2 = 4.302652729911275  # Student t, 97.5% quantile, 2 degrees of freedom (statistical tables)


def test_training_flops_of_a_dial_model_average_its_drawn_solves(tmp_path):
    """A step count drawn per batch costs the mean of the drawn solves; a consistency term adds a solve at
    twice the count. The reference: runs of the plain DiffEqFormer at each count (training FLOPs linear in
    the solves a batch runs: 3 x forward, each forward's embedding, field and hypernetwork)."""
    configs = _study_configs("depth_dial_confirm_pydoc", tmp_path)
    base = yaml.safe_load(configs["ode"][1].read_text())

    def flops(**changes):
        config = copy.deepcopy(base)
        config["model"]["ode"]["num_steps"] = changes.pop("num_steps", 4)
        config["model"]["dial"] = changes
        path = tmp_path / f"run-{len(list(tmp_path.iterdir()))}.yaml"
        path.write_text(yaml.safe_dump(config))
        return compare.training_flops(path, 300)

    plain = {n: flops(num_steps=n) for n in (2, 4, 8, 16)}
    assert plain[8] > 1.5 * plain[4]  # the field's FLOPs dominate: a count that is ignored shows
    assert flops(train_steps=[2, 4, 8, 16]) == pytest.approx(sum(plain.values()) / 4, rel=1e-12)
    assert compare.training_flops(configs["steps_wide"][1], 300) == pytest.approx(sum(plain.values()) / 4, rel=1e-12)
    assert flops(consistency_weight=1.0) == pytest.approx(plain[4] + plain[8], rel=1e-12)
    assert flops(train_steps=[2, 4], consistency_weight=1.0) == pytest.approx(
        (plain[2] + plain[4] + plain[4] + plain[8]) / 2, rel=1e-12
    )
    assert flops(jitter=0.5) == pytest.approx(plain[4], rel=1e-12)  # a jittered grid: the same solves
