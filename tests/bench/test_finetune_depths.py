"""benchmarks/finetune_depths.py: the depths of the paper's fractions, a fine-tuning config `qkvflow sweep`
accepts, and a report that pairs the ODE at M with GPT-2 at max(N, M) layers (synthetic sweep results
with known differences)."""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("fd", Path(__file__).parents[2] / "benchmarks" / "finetune_depths.py")
fd = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fd)


def test_depths_are_the_paper_fractions():
    assert fd.depths(18) == [9, 12, 18, 24]  # the paper's Fig. 6
    assert fd.depths(6) == [3, 4, 6, 8]
    with pytest.raises(ValueError, match="N=4"):
        fd.depths(4)


def test_the_study_names_one_ode_and_gpt2_at_n_and_4n_over_3():
    import yaml

    ode, n, gpts = fd.layers(yaml.safe_load(fd.STUDY.read_text()))
    assert (ode, n) == ("ode_n6", 6) and gpts == {6: "gpt2_l6", 8: "gpt2_l8"}


def test_the_config_parses_as_a_sweep_of_both_methods(tmp_path):
    import yaml

    from qkvflow.finetune.run import FinetuneConfig
    from tests.helpers import parse_config

    corpora = {"train": [str(tmp_path / "train.jsonl")], "test": str(tmp_path / "test.jsonl"), "tokenizer": "tok"}
    raw = fd.finetune_config(tmp_path / "pre", "ode_n6-lr0.002-s1", tmp_path / "ft", [3, 4, 6, 8], 1, 150, corpora)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    config = parse_config(path, FinetuneConfig)
    assert config.sweep.depths == [3, 4, 6, 8] and config.sweep.methods == ["lora", "full"]
    assert config.sweep.learning_rate == {"lora": 1e-3, "full": 3e-4}
    assert config.pretrained.checkpoint == str(tmp_path / "pre" / "checkpoints" / "ode_n6-lr0.002-s1")
    (component,) = config.data.components.values()
    assert component.source.validation_urls == [str(tmp_path / "test.jsonl")]  # reported on the test half
    assert config.trainer.seed == config.data_seed == 1 and config.trainer.num_train_steps == 150


def test_the_report_pairs_the_ode_at_m_with_gpt2_at_the_larger_depth():
    seeds = [0, 1, 2]
    noise = {0: 0.01, 1: -0.02, 2: 0.015}
    gpt = {6: "gpt2_l6", 8: "gpt2_l8"}
    results = {
        "gpt2_l6": {
            s: {(m, 6): {"initial_eval_loss": 9.0, "eval_loss": 3.0 + noise[s]} for m in fd.METHODS} for s in seeds
        },
        "gpt2_l8": {
            s: {(m, 8): {"initial_eval_loss": 9.0, "eval_loss": 2.5 + noise[s]} for m in fd.METHODS} for s in seeds
        },
    }
    # the ODE: 0.2 below GPT-2 at 6 layers for M <= 6 and 0.3 above GPT-2 at 8 layers for M = 8, same noise per seed
    results["ode_n6"] = {
        s: {(m, k): {"initial_eval_loss": 5.0, "eval_loss": 2.8 + noise[s]} for m in fd.METHODS for k in (3, 4, 6, 8)}
        for s in seeds
    }
    result = fd.report(results, "ode_n6", 6, gpt, seeds)
    rows = {(r["method"], r["M"]): r for r in result["rows"]}
    assert len(rows) == 8
    for method in fd.METHODS:
        for m in (3, 4, 6):
            r = rows[(method, m)]
            assert r["baseline"] == "gpt2_l6" and r["difference"] == pytest.approx(-0.2, abs=1e-12)
            assert r["ode_before"][0] == 5.0 and r["gpt2_before"][0] == 9.0
            assert r["verdict"] == "lower" and r["ci95"][1] - r["ci95"][0] == pytest.approx(0, abs=1e-9)
        r = rows[(method, 8)]
        assert (
            r["baseline"] == "gpt2_l8" and r["difference"] == pytest.approx(0.3, abs=1e-12) and r["verdict"] == "higher"
        )
    assert result["claim"] == "did not hold"
    assert "| lora | 8 |" in fd.markdown(result)
