"""Token sensitivities: consistent with the plain tangent integrator, causal, and attention maps
that are the ones the model's attention uses."""

import haliax as hax
import jax.numpy as jnp
import numpy as np
import pytest
from haliax import Axis
from levanter.layers.attention import AttentionMask

from qkvflow.analysis.attention_maps import attention_input, attention_probabilities, maps_along
from qkvflow.analysis.lyapunov import token_lyapunov
from qkvflow.analysis.tangent import lyapunov_spectrum
from qkvflow.models.fields.common import self_attention
from tests.analysis.builders import filled
from tests.helpers import tiny_config

IDS = np.array([3, 17, 5, 40, 8, 22, 9, 31, 2])


def test_one_token_equals_the_tangent_integrator_on_its_field(tiny_gpt2):
    # With a single token, J_00 is the whole Jacobian of the field: the vjp-built blocks must give
    # what forward-mode products give in the plain integrator.
    config, model = tiny_gpt2
    result = token_lyapunov(model, IDS[:1])
    Pos = Axis("position", 1)
    pos = hax.arange(Pos)
    x0 = model.embed(hax.named(jnp.asarray(IDS[:1]), Pos), pos).rearrange((Pos, config.Embed))

    def field(t, x):
        w = model.generator(t)
        x = hax.named(x[None], x0.axes)
        dx = model.field.vector_field(w, x, config=config, mask=AttentionMask.causal(), pos_ids=pos)
        return dx.rearrange(x0.axes).array[0]

    expected = np.asarray(lyapunov_spectrum(field, x0.array[0], num_steps=config.ode.num_steps))
    np.testing.assert_allclose(result.exponents[0], expected, rtol=1e-4, atol=1e-4)
    assert result.exponents.shape == (1, config.hidden_dim) and np.ptp(expected) > 0.1
    np.testing.assert_allclose(result.trajectory[0], x0.array, rtol=1e-6)


def test_tokens_after_the_target_change_nothing(tiny_gpt2):
    config, model = tiny_gpt2
    target = 5
    later = IDS.copy()
    later[target + 1 :] = [1, 1, 1]
    earlier = IDS.copy()
    earlier[2] = 50
    a, b, c = (token_lyapunov(model, ids, target=target) for ids in (IDS, later, earlier))
    np.testing.assert_allclose(a.exponents[: target + 1], b.exponents[: target + 1], rtol=1e-5, atol=1e-5)
    # the causal mask makes J_ij = 0 for i > j: those tangents never move
    assert np.all(a.exponents[target + 1 :] == 0.0) and np.all(b.exponents[target + 1 :] == 0.0)
    # ... while the exponents do depend on the tokens up to the target
    assert np.ptp(a.sensitivity[: target + 1]) > 0.1
    assert not np.allclose(a.exponents[: target + 1], c.exponents[: target + 1], atol=1e-3)


def test_more_steps_follow_the_finer_grid(tiny_gpt2):
    config, model = tiny_gpt2
    default, fine = token_lyapunov(model, IDS, target=5), token_lyapunov(model, IDS, target=5, num_steps=8)
    assert default.trajectory.shape[0] == config.ode.num_steps + 1 and fine.trajectory.shape[0] == 9
    np.testing.assert_allclose(fine.times, np.linspace(0, 1, 9))
    np.testing.assert_allclose(fine.trajectory[0], default.trajectory[0])
    assert not np.allclose(fine.exponents, default.exponents, atol=1e-3)


@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
def test_attention_maps_are_the_ones_the_field_uses(flavour, tiny_gpt2):
    config, model = tiny_gpt2 if flavour == "gpt2" else (tiny_config("llama"), filled(tiny_config("llama")))
    n = 7
    Pos = Axis("position", n)
    pos = hax.arange(Pos)
    x = model.embed(hax.named(jnp.asarray(IDS[:n]), Pos), pos).rearrange((Pos, config.Embed))
    weights = model.generator(0.3)
    h = attention_input(model, weights, x)
    p = attention_probabilities(h, weights, config, pos)  # [heads, position, key_position]
    v = hax.dot(h, weights["v"], axis=config.Embed) + weights.get("v_bias", 0.0)
    mixed = hax.dot(p, v.rename({"position": "key_position"}), axis="key_position")
    out = hax.dot(mixed, weights["o"], axis=(config.Heads, config.HeadSize)) + weights.get("o_bias", 0.0)
    rotary = config.rope.build(config.HeadSize) if flavour == "llama" else None
    expected = self_attention(h, weights, config, AttentionMask.causal(), rotary, pos)
    np.testing.assert_allclose(out.rearrange(expected.axes).array, expected.array, rtol=1e-4, atol=1e-5)
    array = np.asarray(p.array)
    np.testing.assert_allclose(array.sum(-1), 1.0, rtol=1e-5)
    assert np.all(np.triu(array, k=1) == 0.0) and array[:, -1, :].min() > 0
    # maps_along evaluates the same thing at the trajectory's states, batched over times
    along = maps_along(model, np.stack([x.array, x.array]), np.array([0.3, 0.9]))
    np.testing.assert_allclose(along[0], array, rtol=1e-4, atol=1e-6)
    assert not np.allclose(along[1], array, atol=1e-3)
