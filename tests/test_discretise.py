"""`discretise`: the M-layer parallel transformer is the M-step Euler solve of the ODE model."""

import numpy as np
import pytest

from qkvflow.errors import UserError
from qkvflow.models.diffeqformer import SharedOdeLlamaConfig
from qkvflow.models.discretise import discretise, step_times
from tests.analysis.builders import filled
from tests.helpers import Vocab, random_tokens, tiny_config

N = 4  # the tiny configs' ode.num_steps (Euler)


def _logits(model, tokens) -> np.ndarray:
    return np.asarray(model(tokens).array)


CASES = {
    "gpt2 (bias, tied)": lambda: tiny_config("gpt2"),
    "gpt2 (no bias, untied)": lambda: tiny_config("gpt2", use_bias=False, tie_word_embeddings=False),
    "llama (untied)": lambda: tiny_config("llama"),
    "llama (bias, tied)": lambda: tiny_config("llama", use_bias=True, tie_word_embeddings=True),
    "shared_ode_llama": lambda: SharedOdeLlamaConfig(
        max_seq_len=12, hidden_dim=32, num_heads=4, ode=tiny_config("llama").ode
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_n_layers_give_the_ode_models_logits(case):
    config = CASES[case]()
    model = filled(config, std=0.1)
    discrete = discretise(model, N)
    assert discrete.config.num_layers == N and discrete.config.flavour == config.flavour
    assert (discrete.lm_head is None) == config.tied_embeddings
    tokens = random_tokens(config)
    expected = _logits(model, tokens)
    assert np.abs(_logits(discrete, tokens) - expected).max() <= 1e-5 * np.abs(expected).max()


@pytest.mark.parametrize("steps", [N // 2, 2 * N])
def test_other_depths_hold_w_at_their_step_times_with_dt_folded(steps):
    import haliax as hax

    config = tiny_config("gpt2")
    model = filled(config, std=0.1)
    discrete = discretise(model, steps)
    dt = 1.0 / steps
    block = discrete.model.layers.stacked
    for k, t in enumerate(step_times(steps)):
        w = model.generator(np.float32(t))

        def same(a, b, k=k):
            layer = a["layers", k]
            np.testing.assert_allclose(np.asarray(layer.array), np.asarray(b.rearrange(layer.axes).array), atol=1e-6)

        same(block.self_attn.q_proj.weight, w["q"])
        same(block.self_attn.q_proj.bias, w["q_bias"])
        same(block.attn_norm.weight, w["attn_norm"])
        same(block.mlp.up_proj.weight, w["w1"])
        same(block.self_attn.o_proj.weight, w["o"] * dt)
        same(block.self_attn.o_proj.bias, w["o_bias"] * dt)
        same(block.mlp.down_proj.weight, w["w2"] * dt)
        same(block.mlp.down_proj.bias, w["w2_bias"] * dt)
    tokens = random_tokens(config)
    logits = discrete(tokens)
    log_probs = hax.nn.log_softmax(logits, axis=Vocab)
    loss = -hax.mean(hax.take(log_probs, Vocab, tokens)).item()  # a finite number, not a model check
    assert np.isfinite(loss) and np.all(np.isfinite(np.asarray(logits.array)))


def test_step_times_are_the_euler_grid():
    np.testing.assert_allclose(step_times(4), [0.0, 0.25, 0.5, 0.75])


@pytest.mark.parametrize("steps", [0, -3, 2.5, True])
def test_bad_steps_are_refused(steps):
    model = filled(tiny_config("gpt2"))
    with pytest.raises(UserError, match="expected an integer >= 1"):
        discretise(model, steps)


def test_other_solvers_are_refused():
    with pytest.raises(UserError, match=r"solver='rk4' is invalid: expected one of \['euler'\]"):
        discretise(filled(tiny_config("gpt2")), 4, solver="rk4")


def test_only_ode_models_are_discretised():
    with pytest.raises(UserError, match="needs a DiffEqFormerLMHeadModel"):
        discretise(object(), 4)


def test_parallel_types_parse_as_levanter_model_configs():
    import draccus
    from levanter.models.lm_model import LmConfig

    from qkvflow.models.discrete import ParallelGpt2Config, ParallelLlamaConfig

    gpt2 = draccus.decode(LmConfig, {"type": "parallel_gpt2", "hidden_dim": 32, "num_heads": 4, "num_layers": 3})
    llama = draccus.decode(LmConfig, {"type": "parallel_llama", "hidden_dim": 32, "num_heads": 4})
    assert type(gpt2) is ParallelGpt2Config and gpt2.Layers.size == 3 and gpt2.tied_embeddings
    assert type(llama) is ParallelLlamaConfig and not llama.has_attention_bias and llama.layer_norm_epsilon == 1e-6
