"""`qkvflow bench`: the speed harness's JSON, the scaling CSV, the quality table, and bad input."""

import csv
import json
import math
import os
from pathlib import Path

import pytest

from qkvflow import cli
from qkvflow.bench import quality
from qkvflow.bench.performance import speed

ROOT = Path(__file__).resolve().parents[2]
TINY = """\
model:
  type: diffeqformer_gpt2
  max_seq_len: 16
  hidden_dim: 32
  num_heads: 4
  time_embed_dim: 8
  num_frequencies: 16
  ode:
    num_steps: 2
bench:
  batch: 2
  vocab_size: 61
"""


@pytest.fixture
def tiny_config(tmp_path):
    path = tmp_path / "tiny_bench.yaml"
    path.write_text(TINY)
    return str(path)


def test_speed_json_has_consistent_positive_numbers(tiny_config, tmp_path, capsys):
    out = tmp_path / "speed.json"
    argv = [
        "--config_path",
        tiny_config,
        "--repeats",
        "3",
        "--warmup",
        "1",
        "--json_out",
        str(out),
        "--peak-flops",
        "1e12",
    ]
    assert speed.main(argv) == 0
    result = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == result  # stdout: the same one JSON object
    assert result["nominal_peak"] == {"flops_per_s": 1e12, "source": "--peak-flops"}
    tokens = result["config"]["tokens_per_step"]
    assert tokens == 2 * 16
    assert result["matmul_peak"]["flops_per_s"] > 0
    for name in ("ode", "baseline"):
        r = result[name]
        t = r["step_time_s"]
        assert r["step_time_s"]["n"] == 3
        assert 0 < t["min"] <= t["iqr"][0] <= t["median"] <= t["iqr"][1] <= t["max"]
        assert math.isclose(r["tokens_per_s"], tokens / t["median"], rel_tol=1e-9)
        assert math.isclose(r["achieved_flops_per_s"], r["flops"]["train_per_token"] * r["tokens_per_s"], rel_tol=1e-9)
        assert r["compile_s"] > 0 and r["parameter_count"] > 0 and math.isfinite(r["final_loss"])
        assert 0 < r["fraction_of_matmul_peak"]
        assert r["xla_memory"] is None or r["xla_memory"]["temp_bytes"] >= 0
        assert math.isclose(r["mfu"], r["achieved_flops_per_s"] / 1e12, rel_tol=1e-9)
        assert r["peak_device_memory"]["bytes"] is None  # the CPU backend reports no allocator peak
    assert result["ode"]["flops"]["hypernetwork_forward_per_token"] > 0
    assert result["baseline"]["flops"]["hypernetwork_forward_per_token"] == 0
    assert result["baseline"]["num_layers"] == 2  # one layer per Euler step
    assert math.isclose(
        result["ratio_ode_over_baseline"], result["ode"]["tokens_per_s"] / result["baseline"]["tokens_per_s"]
    )
    assert result["process_peak_memory"]["bytes"] > 0 and result["process_peak_memory"]["kind"]


def test_speed_mfu_and_device_memory_are_n_a_on_the_cpu():
    """On the CPU there is no nominal peak (MFU n/a unless --peak-flops) and no allocator peak."""
    assert speed.nominal_peak_flops("bf16", None)["flops_per_s"] is None
    assert speed.nominal_peak_flops("f32", 2e12) == {"flops_per_s": 2e12, "source": "--peak-flops"}
    r = {"tokens_per_s": 12345.6, "mfu": None, "peak_device_memory": {"bytes": None}}
    assert speed.report_line("ode", r) == "ode: 12,346 tokens/s, MFU n/a, peak device memory n/a"
    r = {"tokens_per_s": 1e6, "mfu": 0.4567, "peak_device_memory": {"bytes": 3 * 2**30}}
    assert speed.report_line("baseline", r) == "baseline: 1,000,000 tokens/s, MFU 45.7%, peak device memory 3,072.0 MiB"


def test_nominal_peaks_come_from_levanters_table():
    """The accelerators' peaks come from fray.device_flops (what Levanter's trainer divides by for its
    MFU): fails loudly if that table moves or changes the H100's dense bf16 figure."""
    from fray.device_flops import device_flops_for_jax_device

    assert device_flops_for_jax_device("NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(989.5e12)
    assert device_flops_for_jax_device("NVIDIA H200", "bf16") == pytest.approx(989.5e12)
    assert device_flops_for_jax_device("NVIDIA H100 80GB HBM3", "tf32") == pytest.approx(
        494.5e12
    )  # f32 at DEFAULT precision
    assert device_flops_for_jax_device("cpu", "bf16") is None


def _scaling(tiny_config, tmp_path, values, variants):
    code = cli.main(
        [
            "bench",
            "scaling",
            "--what",
            "steps",
            "--config_path",
            tiny_config,
            "--values",
            values,
            "--variants",
            variants,
            "--checkpoints",
            "1",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--out_dir",
            str(tmp_path),
        ]
    )
    assert code == 0
    with open(tmp_path / "scaling_steps.csv") as f:
        return list(csv.DictReader(f))


def test_scaling_writes_a_csv_row_per_point(tiny_config, tmp_path):
    rows = _scaling(tiny_config, tmp_path, "2", "rc_fixed_otf")  # one point: each is a fresh process
    assert [(r["value"], r["variant"]) for r in rows] == [("2", "rc_fixed_otf")]
    assert float(rows[0]["step_time_median_s"]) > 0 and int(rows[0]["process_peak_bytes"]) > 0
    assert (tmp_path / "scaling_steps.png").stat().st_size > 0


@pytest.mark.slow
def test_scaling_sweeps_every_variant_and_value(tiny_config, tmp_path):
    rows = _scaling(tiny_config, tmp_path, "2,3", "rc_fixed_otf,direct_otf")
    expected = [(v, k) for k in ("rc_fixed_otf", "direct_otf") for v in ("2", "3")]
    assert [(r["value"], r["variant"]) for r in rows] == expected
    for r in rows:
        assert float(r["step_time_median_s"]) > 0 and int(r["process_peak_bytes"]) > 0
    assert (tmp_path / "scaling_steps.png").stat().st_size > 0


def test_quality_table_lists_every_model():
    result = {
        "iters": 5,
        "max_eval_batches": 1,
        "models": {
            name: {
                "label": quality.LABELS[name],
                "val_loss": 3.0 + i,
                "train_loss": 3.5,
                "parameter_count": 10,
                "wall_s": 1.0,
            }
            for i, name in enumerate(quality.MODELS)
        },
    }
    table = quality.markdown(result)
    for name in quality.MODELS:
        assert quality.LABELS[name] in table
    assert "| 3.0000 |" in table and "nanoGPT" in table


def test_quality_grid_reports_each_models_best_learning_rate(monkeypatch, tmp_path):
    losses = {("ode", 1e-3): 2.0, ("ode", 2e-3): 1.9, ("gpt2", 1e-3): 1.8, ("gpt2", 2e-3): None}  # None: diverged

    def fake_train_one(name, args, workdir, learning_rate=None):
        val = losses[(name, learning_rate)]
        return {
            "label": quality.LABELS[name],
            "val_loss": val,
            "train_loss": val,
            "parameter_count": 1,
            "wall_s": 1.0,
            "learning_rate": learning_rate,
        }

    monkeypatch.setattr(quality, "train_one", fake_train_one)
    code = cli.main(
        [
            "bench",
            "quality",
            "--models",
            "ode,gpt2",
            "--learning_rates",
            "1e-3,2e-3",
            "--out_dir",
            str(tmp_path),
            "--workdir",
            str(tmp_path / "work"),
        ]
    )
    assert code == 0
    result = json.loads((tmp_path / "quality.json").read_text())
    assert result["models"]["ode"]["learning_rate"] == 2e-3 and result["models"]["ode"]["val_loss"] == 1.9
    assert result["models"]["gpt2"]["learning_rate"] == 1e-3 and result["models"]["gpt2"]["val_loss"] == 1.8
    table = (tmp_path / "quality.md").read_text()
    assert "| ode | 2.0000 | 1.9000 |" in table and "| gpt2 | 1.8000 | - |" in table


def test_quality_never_reuses_or_removes_an_existing_checkpoint(monkeypatch, tmp_path, capsys):
    """The benchmark deletes each run's checkpoints afterwards: an existing checkpoint folder in
    --workdir (which the run would resume, then delete) is refused before anything trains."""
    run = tmp_path / "work" / "checkpoints" / "quality_gpt2_lr0.002"
    (run / "step-100").mkdir(parents=True)
    (run / "step-100" / "metadata.json").write_text("{}")
    monkeypatch.setattr(quality, "train_one", lambda *a, **k: pytest.fail("trained"))
    code = cli.main(
        [
            "bench",
            "quality",
            "--models",
            "ode,gpt2",
            "--learning_rates",
            "1e-3,2e-3",
            "--out_dir",
            str(tmp_path),
            "--workdir",
            str(tmp_path / "work"),
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"--workdir {tmp_path / 'work'} already holds {run}" in err
    assert (run / "step-100" / "metadata.json").read_text() == "{}"


@pytest.mark.slow
def test_quality_trains_each_model_a_few_steps(tmp_path):
    if not (ROOT.parent / "shared" / "data" / "tinyshakespeare" / "input.txt").is_file() and not os.environ.get(
        "QKVFLOW_SHARED_DIR"
    ):
        pytest.skip("tinyshakespeare source not available")
    code = cli.main(
        [
            "bench",
            "quality",
            "--iters",
            "5",
            "--max_eval_batches",
            "1",
            "--corpus_root",
            str(tmp_path / "corpora"),
            "--out_dir",
            str(tmp_path),
            "--workdir",
            str(tmp_path / "work"),
        ]
    )
    assert code == 0
    result = json.loads((tmp_path / "quality.json").read_text())
    assert set(result["models"]) == set(quality.MODELS)
    for r in result["models"].values():
        assert r["steps"] == 5 and math.isfinite(r["val_loss"]) and r["parameter_count"] > 0
    assert "| val loss |" in (tmp_path / "quality.md").read_text()


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["bench", "scaling", "--what", "depth"], "--what='depth' is invalid"),
        (["bench", "speed", "--config_path", "does/not/exist.yaml"], "does/not/exist.yaml"),
        (["bench", "flops"], "unknown bench mode 'flops'"),
        (["bench", "quality", "--models", "ode,rnn"], "--models='ode,rnn' is invalid"),
        (["bench", "quality", "--learning_rates", "fast"], "--learning_rates='fast' is invalid"),
        (["bench", "quality", "--learning_rates", "3"], "--learning_rates='3' is invalid"),
        (["bench", "speed", "--config_path", "{gpt2}"], "model.type must be an ODE model"),
        (["bench", "speed", "--config_path", "{tiny}", "--batch", "0"], "--batch=0 is invalid"),
        (["bench", "speed"], "--config_path"),
        (
            ["bench", "speed", "--config_path", "{old}"],
            "model.seq_len was removed in marin-levanter; use model.max_seq_len",
        ),
        (["bench", "speed", "--config_path", "{tiny}", "--peak-flops", "0"], "--peak-flops=0.0 is invalid"),
        (["bench", "speed", "--config_path", "{tiny}", "--loss_vocab_block", "0"], "--loss_vocab_block=0 is invalid"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, expected, tmp_path, tiny_config, capsys):
    gpt2 = tmp_path / "gpt2.yaml"
    gpt2.write_text("model:\n  type: gpt2\n  hidden_dim: 32\n  num_heads: 4\n  num_layers: 2\n")
    old = tmp_path / "old.yaml"
    old.write_text(Path(tiny_config).read_text().replace("max_seq_len:", "seq_len:"))
    argv = [a.format(gpt2=gpt2, tiny=tiny_config, old=old) for a in argv]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("qkvflow bench: error:") and expected in err


def test_quality_configs_share_one_budget():
    """Every quality_<model>.yaml the bench can run parses, exists for each model name, and differs from
    the DiffEqFormer's only in `model` and the run id: same data, budget and optimizer for all."""
    import yaml

    from qkvflow.runs.config import TrainConfig
    from tests.helpers import parse_config

    configs = quality.ROOT / "benchmarks" / "configs"
    reference = yaml.safe_load((configs / "quality_ode.yaml").read_text())
    for name in quality.MODELS + quality.EXTRA_MODELS:
        path = configs / f"quality_{name}.yaml"
        raw = yaml.safe_load(path.read_text())
        parsed = parse_config(path, TrainConfig)
        assert parsed.trainer.num_train_steps == 2000 and parsed.trainer.train_batch_size == 12
        strip = lambda c: {k: v for k, v in c.items() if k not in ("model", "trainer", "optimizer")}  # noqa: E731
        assert strip(raw) == strip(reference), path
        assert {**raw["trainer"], "id": None} == {**reference["trainer"], "id": None}, path
        assert raw["optimizer"] == reference["optimizer"], path  # the decay mask too: qkvflow's default for all
    tuned = parse_config(configs / "quality_ode_tuned.yaml", TrainConfig)
    assert tuned.model.time_embed_norm and tuned.model.matrix_init == "fan_in"


def test_speed_dial_option_sets_the_recipes_and_refuses_unknown_keys():
    """`bench speed --dial` times the DiffEqFormer with its depth-dial recipes on (qkvflow.models.depth_dial)."""
    from qkvflow.bench.performance.config import apply_overrides, dial_config, load_config
    from qkvflow.bench.performance.speed import parser
    from qkvflow.errors import UserError
    from qkvflow.models.depth_dial import DepthDialConfig

    args = parser().parse_args(
        ["--config_path", str(ROOT / "benchmarks/configs/speed.yaml"), "--dial", "{train_steps: [2, 4], jitter: 0.5}"]
    )
    model = apply_overrides(load_config(args.config_path)[0], args)
    assert model.dial == DepthDialConfig(train_steps=(2, 4), jitter=0.5) and model.dial.active
    for bad in ("{train_step: [2]}", "[1, 2]", "{jitter: 2.0}"):
        with pytest.raises(UserError, match="dial"):
            dial_config(bad)
