"""Every default of the DiffEqFormer model configs, written out.

A default changed by accident (GELU to ReLU, an epsilon, the time scale, tied embeddings) changes every
model trained from the shipped configs, which rarely set them; tests that build tiny models pass the
changed value to both sides and cannot see it. A new field must be added here on purpose.
"""

import dataclasses

import pytest
from levanter.layers.rotary import DefaultRotaryEmbeddingsConfig
from levanter.utils.activation import ActivationFunctionEnum

from qkvflow.integrate.config import OdeConfig
from qkvflow.models.depth_dial import DepthDialConfig
from qkvflow.models.diffeqformer import (
    DiffEqFormerGpt2Config,
    DiffEqFormerLlamaConfig,
    SharedOdeGpt2Config,
    SharedOdeLlamaConfig,
)

COMMON = {
    "max_seq_len": 1024,
    "hidden_dim": 768,
    "num_heads": 12,
    "intermediate_dim": None,
    "time_embed_dim": 64,
    "num_frequencies": 128,
    "time_scale": 1000.0,
    "time_max_period": 1e4,
    "shared_time_mlp": False,
    "time_embed_norm": False,
    # the official implementation's variant is opt-in; its time grid defaults to the variant's own
    "variant": "qkvflow",
    "time_grid": None,
    "ode": OdeConfig(),
    "kinetic_weight": 0.0,
    "dial": DepthDialConfig(
        train_steps=(),
        jitter=0.0,
        random_time=False,
        steer=0.0,
        consistency_weight=0.0,
        consistency_factor=2,
        jacobian_weight=0.0,
    ),
    "exits": "none",
    # no dropout unless asked for (the authors' recipe, configs/paper/*_official.yaml, sets 0.1)
    "embed_pdrop": 0.0,
    "resid_pdrop": 0.0,
    "initializer_range": 0.02,
    "matrix_init": "normal",
    "use_bias": None,
    "tie_word_embeddings": None,
    "rope": DefaultRotaryEmbeddingsConfig(theta=10000, factor=1.0),
    "attn_backend": None,
    "flash_attention_block_size": None,
    "cross_entropy_block_size": None,
}
# GPT-2: "gelu_new" is GPT-2's tanh approximation of GELU (Hendrycks & Gimpel 2016), LayerNorm eps 1e-5
# (transformers' GPT2Config); Llama: SiLU (its SwiGLU gate), RMSNorm eps 1e-6 (LlamaConfig's rms_norm_eps).
GPT2 = COMMON | {"activation_function": ActivationFunctionEnum.gelu_new, "layer_norm_epsilon": 1e-5}
LLAMA = COMMON | {"activation_function": ActivationFunctionEnum.silu, "layer_norm_epsilon": 1e-6}


@pytest.mark.parametrize(
    "cls,expected,derived",
    [
        (DiffEqFormerGpt2Config, GPT2, (3072, True, True, "gpt2", "hyper")),
        (SharedOdeGpt2Config, GPT2, (3072, True, True, "gpt2", "shared")),
        (DiffEqFormerLlamaConfig, LLAMA, (2048, False, False, "llama", "hyper")),
        (SharedOdeLlamaConfig, LLAMA, (2048, False, False, "llama", "shared")),
    ],
)
def test_model_config_defaults_are_pinned(cls, expected, derived):
    config = cls()
    assert {f.name: getattr(config, f.name) for f in dataclasses.fields(config)} == expected
    # the flavour-dependent properties: mlp width (4 h; SwiGLU's 8h/3 rounded up to 64), bias, tied head
    assert (config.mlp_dim, config.bias, config.tied_embeddings, config.flavour, config.generator) == derived


def test_gelu_new_is_the_tanh_approximation():
    """What the GPT-2 default means: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), not the erf GELU."""
    import math

    import numpy as np

    x = np.linspace(-4, 4, 81, dtype=np.float32)
    expected = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    ours = np.asarray(ActivationFunctionEnum.gelu_new.to_fn()(x))
    # |gelu| <= 4 here; a few float32 ulps of that scale (tanh and the cubic each round once or twice)
    np.testing.assert_allclose(ours, expected, rtol=0, atol=8 * np.finfo(np.float32).eps * 4)
