import math

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np

from qkvflow.nn.time_embedding import SinusoidalTimeEmbedding


def test_features_match_formula():
    emb = SinusoidalTimeEmbedding.init(num_frequencies=4, time_scale=10.0, max_period=100.0)
    out = emb(0.3)
    assert out.axes == (emb.TimeFeature,) and emb.TimeFeature.size == 9
    w = np.array([math.exp(-math.log(100.0) * i / 4) for i in range(4)])
    expected = np.concatenate([[0.3], np.sin(10.0 * 0.3 * w), np.cos(10.0 * 0.3 * w)])
    np.testing.assert_allclose(out.array, expected, rtol=1e-6)


def test_accepts_named_scalar_under_vmap():
    emb = SinusoidalTimeEmbedding.init(num_frequencies=8)
    T = hax.Axis("ode_time", 3)
    times = hax.named(jnp.array([0.0, 0.5, 1.0]), T)
    batched = hax.vmap(emb, T)(times)
    assert batched.axes == (T, emb.TimeFeature)
    np.testing.assert_allclose(batched["ode_time", 1].array, emb(0.5).array, rtol=1e-6)


def test_time_scale_separates_nearby_layers():
    # Without rescaling, features of t=0.25 and t=0.5 are nearly collinear; with 1000 they are not.
    def cos_sim(scale):
        emb = SinusoidalTimeEmbedding.init(128, time_scale=scale)
        a, b = emb(0.25).array[1:], emb(0.5).array[1:]
        return float(jnp.dot(a, b) / (jnp.linalg.norm(a) * jnp.linalg.norm(b)))

    assert cos_sim(1.0) > 0.99
    assert cos_sim(1000.0) < 0.9
    assert jax.numpy.isfinite(cos_sim(1000.0))


def test_defaults_are_the_papers_and_reach_the_model():
    """Pinned defaults: F = 128 frequencies, time scale 1000, maximum period 1e4 (Vaswani et al.), and the
    model's generator is built with them. The formula is written out here for t = 0.3."""
    from qkvflow.models.diffeqformer import DiffEqFormerGpt2Config
    from tests.helpers import tiny_model

    emb = SinusoidalTimeEmbedding.init()
    w = np.exp(-np.log(1e4) * np.arange(128) / 128)
    expected = np.concatenate([[0.3], np.sin(1000 * 0.3 * w), np.cos(1000 * 0.3 * w)])
    # |angle| <= 300 rad: float32 holds it to ~300 * eps32 = 2e-5 rad, the error of sin and cos too
    np.testing.assert_allclose(emb(0.3).array, expected, rtol=0, atol=300 * np.finfo(np.float32).eps * 2)

    # the class's own field defaults too (a module built without `init`, e.g. by eqx.tree_at or a subclass)
    direct = SinusoidalTimeEmbedding(emb.Frequencies)
    assert (direct.time_scale, direct.max_period) == (1000.0, 1e4)
    assert emb.Frequencies.size == 128 and (emb.time_scale, emb.max_period) == (1000.0, 1e4)

    config = DiffEqFormerGpt2Config(max_seq_len=8, hidden_dim=16, num_heads=2, time_embed_dim=4)
    assert (config.num_frequencies, config.time_scale) == (128, 1000.0)
    model_embedding = tiny_model(config).generator.time_embedding
    np.testing.assert_array_equal(model_embedding(0.3).array, emb(0.3).array)


def test_config_sets_scale_period_and_frequencies_of_the_model():
    """`time_scale`, `time_max_period` and `num_frequencies` of the model config reach the generator's
    embedding (a slow embedding for the depth-dial study): the formula written out for t = 0.7 with s = 2,
    P = 50 and F = 3, whose fastest sinusoid has period 2 pi / 2 ~ 3.1 in t."""
    from qkvflow.models.diffeqformer import DiffEqFormerGpt2Config
    from tests.helpers import tiny_model

    config = DiffEqFormerGpt2Config(
        max_seq_len=8, hidden_dim=16, num_heads=2, time_embed_dim=4, num_frequencies=3, time_scale=2.0,
        time_max_period=50.0,
    )  # fmt: skip
    emb = tiny_model(config).generator.time_embedding
    w = np.array([50.0 ** (-i / 3) for i in range(3)])
    expected = np.concatenate([[0.7], np.sin(2.0 * 0.7 * w), np.cos(2.0 * 0.7 * w)])
    np.testing.assert_allclose(emb(0.7).array, expected, rtol=0, atol=4 * np.finfo(np.float32).eps)
