import equinox as eqx
import haliax as hax
import jax
import jax.random as jrandom
import numpy as np
import optax

from qkvflow.nn.time_dependent import TimeDependentWeight, TimeMLP
from qkvflow.nn.time_embedding import SinusoidalTimeEmbedding

A, B = hax.Axis("a", 3), hax.Axis("b", 5)


def test_weight_is_projection_of_silu_mlp():
    emb = SinusoidalTimeEmbedding.init(8)
    w = TimeDependentWeight.init((A, B), emb.TimeFeature, 6, std=0.1, own_mlp=True, key=jrandom.PRNGKey(0))
    s = emb(0.4)
    e = w.mlp.lin2(hax.nn.silu(w.mlp.lin1(s)))
    expected = np.einsum("d,dab->ab", np.asarray(hax.nn.silu(e).array), np.asarray(w.proj.array)) / 6  # 1/d_emb
    out = w(s)
    assert out.axes == (A, B)
    np.testing.assert_allclose(out.array, expected, rtol=1e-5, atol=1e-7)
    # A genuinely time-dependent weight: different t, different W.
    assert not np.allclose(w(emb(0.9)).array, out.array)


def test_norm_offset_and_shared_mlp():
    emb = SinusoidalTimeEmbedding.init(8)
    shared = TimeMLP.init(emb.TimeFeature, 6, key=jrandom.PRNGKey(1))
    w = TimeDependentWeight.init((A,), emb.TimeFeature, 6, std=0.0, own_mlp=False, offset=1.0, key=jrandom.PRNGKey(2))
    assert w.mlp is None
    s = emb(0.2)
    np.testing.assert_array_equal(w(s, shared(s)).array, np.ones(3))  # zero projection at init: W = offset


def _adam_step_on_w(d_emb: int, normalise: bool = False) -> float:
    """RMS change of W(t) after one Adam step on a random linear loss of W."""
    emb = SinusoidalTimeEmbedding.init(8)
    w = TimeDependentWeight.init(
        (A, B), emb.TimeFeature, d_emb, std=0.02, own_mlp=True, normalise=normalise, key=jrandom.PRNGKey(0)
    )
    s = emb(0.3)
    g = hax.random.normal(jrandom.PRNGKey(1), (A, B))
    params, static = eqx.partition(w, eqx.is_inexact_array)

    def loss(params):
        return hax.sum(eqx.combine(params, static)(s) * g).scalar()

    optimizer = optax.adam(1e-3)
    updates, _ = optimizer.update(jax.grad(loss)(params), optimizer.init(params), params)
    moved = eqx.combine(optax.apply_updates(params, updates), static)
    return float(np.sqrt(np.mean(np.square(moved(s).array - w(s).array))))


def test_adam_moves_w_by_order_lr_at_any_d_emb():
    """The 1/d_emb multiplier: one Adam step of lr 1e-3 moves W(t) by O(lr). Measured: 1.8e-4 at
    d_emb 8 and 6.5e-4 at d_emb 64 (the time MLP's own update still grows a little with d_emb);
    without the multiplier 9.7e-4 and 1.1e-2, i.e. 11x from d_emb 8 to 64."""
    small, large = _adam_step_on_w(8), _adam_step_on_w(64)
    assert 1e-5 < small < 2e-3 and 1e-5 < large < 2e-3
    assert large / small < 5


def test_normalised_embedding_has_unit_rms_and_defines_w():
    emb = SinusoidalTimeEmbedding.init(8)
    w = TimeDependentWeight.init(
        (A, B), emb.TimeFeature, 6, std=0.1, own_mlp=True, normalise=True, key=jrandom.PRNGKey(0)
    )
    s = emb(0.4)
    e = np.asarray(hax.nn.silu(w.mlp(s)).array)
    e_hat = e / np.sqrt(np.mean(e**2) + 1e-6)
    rms = np.sqrt(np.mean(np.asarray(w.coefficients(s).array) ** 2))
    np.testing.assert_allclose(rms, 1.0, rtol=1e-3)  # up to the 1e-6 epsilon
    expected = np.einsum("d,dab->ab", e_hat, np.asarray(w.proj.array)) / 6
    np.testing.assert_allclose(w(s).array, expected, rtol=1e-5, atol=1e-7)


def test_normalised_embedding_speeds_up_adam_on_w():
    """time_embed_norm: silu(MLP) starts with mean|e| ~ 0.15, so Proj's share of one Adam step of lr 1e-3
    moves W by ~0.15 lr; dividing e by its RMS makes it ~0.8 lr, and the time MLP's own step adds to
    both. Measured on this 3 x 5 weight at d_emb 64: 6.5e-4 plain, 2.8e-3 normalised (4.4x)."""
    plain, normalised = _adam_step_on_w(64), _adam_step_on_w(64, normalise=True)
    assert 1e-3 < normalised < 3e-3
    assert normalised > 3 * plain
