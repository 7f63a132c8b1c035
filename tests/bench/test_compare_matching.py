"""`bench compare`'s matched baselines (qkvflow.bench.comparison.matching): a width solved on the study's own
vocabulary, the layer count where the width cannot match, a refusal where nothing can, and the report's ratio.

Expected parameter counts come from GPT-2's formula, not from qkvflow's accounting: with vocabulary V,
context S, L layers of width d (MLP 4d, biases everywhere, a tied head), the embeddings hold V d + S d,
each layer 12 d^2 + 13 d (attention 4 d^2 + 4 d, MLP 8 d^2 + 5 d, two norms 4 d), the final norm 2 d.
"""

import json
from pathlib import Path

import pytest
import yaml

from qkvflow.bench.comparison import compare, matching, run_processes
from qkvflow.errors import UserError
from tests.bench.test_compare import SHAKESPEARE, FakeRuns, _study, _study_configs, needs_shakespeare


def gpt2_params(vocab: int, seq: int, layers: int, width: int) -> int:
    return vocab * width + seq * width + layers * (12 * width**2 + 13 * width) + 2 * width


def _gpt2(**shape) -> dict:
    return {"type": "gpt2", "max_seq_len": 64, "embed_pdrop": 0.0, "resid_pdrop": 0.0, "attn_pdrop": 0.0, **shape}


def _write(folder: Path, corpus, models: dict) -> Path:
    """study.yaml (baseline `deep`, one rate, one seed) and its base.yaml: a bundled `corpus` (a mapping), or
    the text of a whole base config."""
    base = corpus if isinstance(corpus, str) else yaml.safe_dump({"corpus": corpus, "trainer": {"train_batch_size": 2}})
    (folder / "base.yaml").write_text(base)
    spec = {
        "base": "base.yaml",
        "baseline": "deep",
        "iters": 5,
        "learning_rates": [1e-3],
        "seeds": [0],
        "models": models,
    }
    (folder / "study.yaml").write_text(yaml.safe_dump(spec))
    return folder / "study.yaml"


def _resolved(path: Path, workdir: Path) -> dict:
    args = compare._parser().parse_args([str(path), "--workdir", str(workdir)])
    study = compare.load_study(str(path), args)
    compare.resolve(study, workdir, str(workdir))
    return study


VOCABULARIES = [
    pytest.param({"name": "tinyshakespeare"}, 66, marks=needs_shakespeare, id="tinyshakespeare-66"),
    pytest.param({"name": "pydoc", "vocab_size": 4096}, 4096, id="pydoc-4096"),
]


@pytest.mark.parametrize("corpus, vocab", VOCABULARIES)
def test_the_width_is_solved_on_the_studys_own_vocabulary(tmp_path, corpus, vocab):
    """A 1-layer GPT-2 matched to an 8-layer one of width 128: the solved width is the multiple of its 4 heads
    whose parameter count (the formula) is closest to the target's, within 0.9-1.1, and it differs between
    the two vocabularies (the embeddings' share grows with V). The closest lies above the target at 66
    tokens (1.0027x) and below it at 4,096 (0.9957x): neither side of the bisection is always right."""
    models = {"deep": {"model": _gpt2(hidden_dim=128, num_heads=4, num_layers=8)},
              "wide": {"match": {"params": "deep"}, "model": _gpt2(num_heads=4, num_layers=1)}}  # fmt: skip
    study = _resolved(_write(tmp_path, corpus, models), tmp_path / "work")
    target = gpt2_params(vocab, 64, 8, 128)
    widths = range(4, 4096, 4)
    expected = min(widths, key=lambda d: abs(gpt2_params(vocab, 64, 1, d) / target - 1))
    found = study["matched"]["wide"]
    assert found["solved"] == {"hidden_dim": expected} and found["vocab_size"] == vocab
    assert study["models"]["wide"]["model"]["hidden_dim"] == expected  # what every run of `wide` trains
    assert found["ratio"] == pytest.approx(gpt2_params(vocab, 64, 1, expected) / target, rel=1e-12)
    assert 0.9 <= found["ratio"] <= 1.1
    assert expected == {66: 360, 4096: 280}[vocab]  # the formula's answer, pinned: the vocabulary matters


def test_the_layer_count_is_lowered_where_no_width_matches(tmp_path):
    """At 4,096 tokens a 64-head model's narrowest width (64) already outweighs a 1-layer, width-64 target
    at 4 layers (1.47x by the formula), so the layer count goes down until it matches: 1 layer, width 64."""
    target = gpt2_params(4096, 64, 1, 64)
    assert gpt2_params(4096, 64, 4, 64) / target > 1.1 and gpt2_params(4096, 64, 2, 64) / target > 1.1
    models = {"deep": {"model": _gpt2(hidden_dim=64, num_heads=4, num_layers=1)},
              "wide": {"match": {"params": "deep"}, "model": _gpt2(num_heads=64, num_layers=4)}}  # fmt: skip
    study = _resolved(_write(tmp_path, {"name": "pydoc", "vocab_size": 4096}, models), tmp_path / "work")
    assert study["matched"]["wide"]["solved"] == {"hidden_dim": 64, "num_layers": 1}
    assert study["matched"]["wide"]["ratio"] == pytest.approx(1.0, rel=1e-12)


def test_a_match_that_cannot_be_met_is_refused_in_one_line_before_the_work_folder_is_claimed(tmp_path, monkeypatch):
    """128 heads: even one layer of the narrowest width (128) holds 2.3x the target's parameters."""
    assert gpt2_params(4096, 64, 1, 128) / gpt2_params(4096, 64, 1, 64) > 1.1
    models = {"deep": {"model": _gpt2(hidden_dim=64, num_heads=4, num_layers=1)},
              "wide": {"match": {"params": "deep"}, "model": _gpt2(num_heads=128, num_layers=2)}}  # fmt: skip
    path = _write(tmp_path, {"name": "pydoc", "vocab_size": 4096}, models)
    fake = FakeRuns()
    monkeypatch.setattr(run_processes, "_subprocess", fake)
    with pytest.raises(
        UserError, match="models.wide.match: the parameters of deep .* cannot be met within 0.9-1.1"
    ) as e:
        compare.main([str(path), "--workdir", str(tmp_path / "work")])
    assert "\n" not in str(e.value) and "hidden_dim 128, num_layers 1" in str(e.value)
    assert fake.calls == [] and not (tmp_path / "work").exists()


@pytest.mark.parametrize(
    "match, message",
    [
        ({"parameters": "deep"}, "is invalid: expected one of {params: MODEL}, {train_flops: MODEL}"),
        ({"params": "wide"}, "expected another model of the study"),
        ({"params": "nope"}, "expected another model of the study"),
        ({"params": "deep", "train_flops": "deep"}, "is invalid"),
    ],
)
def test_a_bad_match_is_refused_in_one_line(tmp_path, match, message):
    models = {"deep": {"model": _gpt2(hidden_dim=64, num_heads=4, num_layers=1)},
              "wide": {"match": match, "model": _gpt2(num_heads=4, num_layers=1)}}  # fmt: skip
    path = _write(tmp_path, {"name": "pydoc"}, models)
    with pytest.raises(UserError, match=message.replace("{", r"\{").replace("}", r"\}")) as e:
        _resolved(path, tmp_path / "work")
    assert "\n" not in str(e.value) and "models.wide.match" in str(e.value)
    models["wide"] = {"match": {"params": "deep"}, "model": _gpt2(hidden_dim=32, num_heads=4)}
    with pytest.raises(UserError, match="also sets hidden_dim=32: drop it"):
        _resolved(_write(tmp_path, {"name": "pydoc"}, models), tmp_path / "work")


class CountingRuns(FakeRuns):
    """FakeRuns whose trainings report the formula's parameter count of the run's GPT-2, `wide`'s times `off`."""

    def __init__(self, off: float):
        super().__init__()
        self.off = off

    def loss(self, model, lr, seed, split):
        return 2.0 + 0.01 * seed + (0.05 if split == "test" else 0.0) + (0.1 if model == "deep" else 0.0)

    def __call__(self, cmd, log_file, timeout, attention):
        config = yaml.safe_load(Path(cmd[cmd.index("--config_path") + 1]).read_text())
        name, shape = config["trainer"]["id"].split("-lr")[0], config["model"]
        count = gpt2_params(4096, 64, shape["num_layers"], shape["hidden_dim"]) * (self.off if name == "wide" else 1)
        self.parameter_count = {name: round(count)}
        super().__call__(cmd, log_file, timeout, attention)


def test_the_report_prints_the_achieved_ratio_from_its_own_rows_and_marks_one_outside_the_tolerance(
    tmp_path, monkeypatch
):
    models = {"deep": {"model": _gpt2(hidden_dim=128, num_heads=4, num_layers=8)},
              "wide": {"match": {"params": "deep"}, "model": _gpt2(num_heads=4, num_layers=2)}}  # fmt: skip
    path = _write(tmp_path, {"name": "pydoc", "vocab_size": 4096}, models)
    monkeypatch.setattr(compare, "training_flops", lambda path, iters: 1.0e9 * iters)
    for off, name in ((1.0, "right"), (1.25, "wrong")):  # the runs' own counts: as solved, then 25% more
        monkeypatch.setattr(run_processes, "_subprocess", CountingRuns(off))
        argv = [str(path), "--workdir", str(tmp_path / f"work-{name}"), "--out_dir", str(tmp_path / name)]
        assert compare.main(argv) == 0
        result = json.loads((tmp_path / name / "study.json").read_text())
        match = result["models"]["wide"]["match"]
        ratio = off * gpt2_params(4096, 64, 2, 224) / gpt2_params(4096, 64, 8, 128)
        assert match["ratio"] == pytest.approx(ratio, rel=1e-6) and match["ratio_from"] == "report"
        assert match["within"] == (off == 1.0) and match["solved"] == {"hidden_dim": 224}
        table = (tmp_path / name / "study.md").read_text()
        cell = f"params {ratio:.3f}x deep" + ("" if off == 1.0 else " (outside 0.9-1.1)")
        assert f"| {cell} |" in table, table
        assert "| 5e+09 | - | 0.001 |" in table  # the target's row has no ratio of its own


@pytest.mark.parametrize(
    "name",
    [pytest.param("tinyshakespeare", marks=needs_shakespeare), "pydoc"],
)
def test_the_shipped_matched_baselines_are_matched_on_their_own_corpus(tmp_path, name):
    """tinyshakespeare.yaml and pydoc.yaml: gpt2_params within 0.9-1.1 of ode's parameters and gpt2_flops of its
    training FLOPs (the report's own measures: accounting's count, `compare.training_flops`) at the corpus's
    vocabulary (66 and 2,048 tokens), each the closest of its neighbours (one head count narrower or wider),
    with its heads dividing the width."""
    import dataclasses

    from qkvflow.bench.comparison import run_configs
    from qkvflow.models import accounting

    assert SHAKESPEARE.is_file() or name == "pydoc"
    configs, study = _study_configs(name, tmp_path), _study(name, tmp_path)
    vocab = run_configs.vocab_size(configs["ode"][0])
    assert vocab == {"tinyshakespeare": 66, "pydoc": 2048}[name]

    def params(model):
        return accounting.count(accounting.model_shapes(model, vocab))

    def flops(model):
        return run_configs.training_flops(dataclasses.replace(configs["ode"][0], model=model), study["iters"])

    for matched, measure in (("gpt2_params", params), ("gpt2_flops", flops)):
        model, target = configs[matched][0].model, measure(configs["ode"][0].model)
        assert model.hidden_dim % model.num_heads == 0 and study["matched"][matched]["solved"] == {
            "hidden_dim": model.hidden_dim
        }
        ratio = measure(model) / target
        assert matching.within(ratio), (matched, ratio)
        for other in (model.hidden_dim - model.num_heads, model.hidden_dim + model.num_heads):
            assert abs(measure(dataclasses.replace(model, hidden_dim=other)) / target - 1) >= abs(ratio - 1)
    assert compare.training_flops(configs["gpt2_flops"][1], study["iters"]) == pytest.approx(
        flops(configs["gpt2_flops"][0].model), rel=1e-12
    )


def test_a_study_on_the_users_own_corpus_is_matched_at_its_tokenizers_vocabulary(tmp_path, monkeypatch):
    """A `data:` base config (a `qkvflow tokenizer` folder): the vocabulary is the tokenizer's length, read
    here with transformers, and the width is the formula's closest at it."""
    from transformers import AutoTokenizer

    from tests.bench.test_compare import OWN_BASE, _own_corpus

    monkeypatch.chdir(tmp_path)
    _own_corpus(tmp_path)
    vocab = len(AutoTokenizer.from_pretrained(str(tmp_path / "cache" / "own")))
    models = {"deep": {"model": _gpt2(hidden_dim=64, num_heads=4, num_layers=4)},
              "wide": {"match": {"params": "deep"}, "model": _gpt2(num_heads=4, num_layers=1)}}  # fmt: skip
    study = _resolved(_write(tmp_path, OWN_BASE, models), tmp_path / "work")
    target = gpt2_params(vocab, 64, 4, 64)
    expected = min(range(4, 2048, 4), key=lambda d: abs(gpt2_params(vocab, 64, 1, d) / target - 1))
    assert study["matched"]["wide"]["vocab_size"] == vocab and study["matched"]["wide"]["solved"] == {
        "hidden_dim": expected
    }
    assert not (tmp_path / "work").exists()  # solved before anything is written
