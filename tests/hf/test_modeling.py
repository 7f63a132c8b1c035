"""The torch twin's norms against their formulas, on inputs small enough for the epsilon to matter.

The end-to-end export tests compare logits of trained models whose activations have RMS near 1,
where an epsilon of 1e-6 changes the result by less than float32 round-off; here the mean square of
the input equals epsilon, so dropping or misplacing it changes the output by a factor near sqrt(2).
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from qkvflow.export.hf.configuration_qkvflow import QkvflowParallelGpt2Config, QkvflowParallelLlamaConfig  # noqa: E402
from qkvflow.export.hf.modeling_qkvflow import make_norm  # noqa: E402

H = 16


def _input(eps):
    x = np.random.default_rng(0).standard_normal((3, H))
    x *= np.sqrt(eps / np.mean(x**2, axis=-1, keepdims=True))  # mean square = eps in every row
    return x + 0.0


def test_llama_rms_norm_is_the_formula_with_its_epsilon():
    config = QkvflowParallelLlamaConfig(hidden_size=H, num_attention_heads=2, vocab_size=8)
    assert config.layer_norm_eps == 1e-6  # the JAX model's default (tests/models/test_field_reference.py)
    norm = make_norm(config)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, H))
    x = _input(1e-6)
    expected = x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + 1e-6) * np.linspace(0.5, 1.5, H)
    out = norm(torch.tensor(x, dtype=torch.float32)).detach().numpy()
    np.testing.assert_allclose(out, expected, rtol=8 * np.finfo(np.float32).eps, atol=0)


def test_gpt2_layer_norm_is_the_formula_with_its_epsilon():
    config = QkvflowParallelGpt2Config(hidden_size=H, num_attention_heads=2, vocab_size=8)
    assert config.layer_norm_eps == 1e-5
    norm = make_norm(config)
    x = _input(1e-5)
    centred = x - x.mean(-1, keepdims=True)
    expected = centred / np.sqrt(np.mean(centred**2, axis=-1, keepdims=True) + 1e-5)
    out = norm(torch.tensor(x, dtype=torch.float32)).detach().numpy()
    np.testing.assert_allclose(out, expected, rtol=0, atol=16 * np.finfo(np.float32).eps * np.abs(expected).max())
