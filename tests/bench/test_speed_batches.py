"""`qkvflow bench speed`: both models run the attention kernel `--attention` selects (set on both configs,
and reached by both models' attention calls), and `--batch` takes a list whose `max` halves from
`--max_batch` on out-of-memory."""

import json

import haliax as hax
import jax
import pytest
from levanter.layers.attention import AttentionBackend
from levanter.models.lm_model import LmExample

from qkvflow.bench.performance import speed
from qkvflow.errors import UserError
from qkvflow.nn import attention
from qkvflow.training.loss import lm_loss
from tests.bench.test_bench import TINY
from tests.helpers import Vocab, tiny_config


@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
@pytest.mark.parametrize(
    "choice, expected",
    [("auto", AttentionBackend.JAX_FLASH), ("xla", "xla"), ("vanilla", AttentionBackend.VANILLA)],
)
def test_both_models_are_configured_with_the_same_kernel(flavour, choice, expected):
    config = tiny_config(flavour)
    models = {"ode": config, "baseline": speed.baseline_config(config)}
    models, kernel = speed.with_attention(models, choice, "f32")
    assert kernel == str(expected) and {type(m.attn_backend) for m in models.values()} == {type(expected)}
    assert models["ode"].attn_backend == models["baseline"].attn_backend == expected
    assert type(models["baseline"]).__name__ == {"gpt2": "Gpt2Config", "llama": "LlamaConfig"}[flavour]


@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
def test_both_models_reach_the_selected_kernel(flavour, monkeypatch):
    """Traced (no compile), each model's loss calls qkvflow's xla kernel once per attention layer."""
    calls = []
    real = attention.jax_nn_attention
    monkeypatch.setattr(
        attention, "jax_nn_attention", lambda *a, **k: calls.append(k["implementation"]) or real(*a, **k)
    )
    config = tiny_config(flavour)
    models, _ = speed.with_attention({"ode": config, "baseline": speed.baseline_config(config)}, "xla", "f32")
    Batch = hax.Axis("batch", 2)
    for name, c in models.items():
        calls.clear()
        example = hax.vmap(LmExample.causal, Batch)(hax.zeros((Batch, c.max_Pos), dtype=int))
        jax.eval_shape(lambda example, c=c: lm_loss(c.build(Vocab, key=jax.random.PRNGKey(0)), example), example)
        assert calls and set(calls) == {"xla"}, (name, calls)


def test_batch_lists_are_sorted_and_checked():
    assert speed.parse_batches("32,8,max,8") == [8, 32, "max"]
    assert speed.parse_batches(8) == [8]
    for bad in ("0", "eight", "8,,32"):
        with pytest.raises(UserError, match="--batch=.* is invalid: expected an integer >= 1 or max"):
            speed.parse_batches(bad)


class FakeStep:
    """A device that fits at most 2 sequences: above that the step raises XLA's out-of-memory error (the
    search, not the compile, is under test here; the accelerator script's dry run compiles for real)."""

    def __init__(self, config, Vocab, Batch, dtype, vocab_block=None):
        if Batch.size > FakeStep.fits:
            raise RuntimeError(f"RESOURCE_EXHAUSTED: Out of memory while trying to allocate (batch {Batch.size})")
        self.times, self.compile_s, self.parameter_count, self.loss = [], 0.5, 10, 1.0
        self.compiled, self.peak_memory = None, None

    def run(self):
        return 0.25


def test_max_batch_halves_on_out_of_memory(tmp_path, monkeypatch, capsys):
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY)
    monkeypatch.setattr(speed, "Step", FakeStep)
    monkeypatch.setattr(FakeStep, "fits", 2, raising=False)
    out = tmp_path / "speed.json"
    argv = ["--config_path", str(path), "--batch", "max,1", "--max_batch", "8", "--repeats", "2", "--warmup", "0",
            "--no_peak", "--json_out", str(out)]  # fmt: skip
    assert speed.main(argv) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["config"]["batch"] for r in runs] == [1, 2]
    assert [r["config"]["batch_search"] for r in runs] == [None, {"from": 8, "out_of_memory_at": [8, 4]}]
    assert [r["config"]["tokens_per_step"] for r in runs] == [16, 32]
    assert [r["ode"]["tokens_per_s"] for r in runs] == [16 / 0.25, 32 / 0.25]
    assert runs[1]["ode"]["peak_device_memory"]["bytes"] is None  # the failed attempts raised the peak
    for r in runs:
        assert r["config"]["attention"] == {"requested": "auto", "kernel": "jax_flash"}
        assert r["ode"]["attn_backend"] == r["baseline"]["attn_backend"] == "jax_flash"
    err = capsys.readouterr().err
    assert "batch 1 (16 tokens), ode:" in err and "batch 2 (32 tokens), baseline:" in err

    monkeypatch.setattr(FakeStep, "fits", 0)
    with pytest.raises(UserError, match="no batch from 4 down to 1 fits"):
        speed.main([*argv[:3], "max", "--max_batch", "4", "--no_peak"])
