import haliax as hax
import jax.random as jrandom
import numpy as np

from qkvflow.nn.time_dependent import TimeDependentWeight, TimeMLP
from qkvflow.nn.time_embedding import SinusoidalTimeEmbedding

A, B = hax.Axis("a", 3), hax.Axis("b", 5)


def test_weight_is_projection_of_silu_mlp():
    emb = SinusoidalTimeEmbedding.init(8)
    w = TimeDependentWeight.init((A, B), emb.TimeFeature, 6, std=0.1, own_mlp=True, key=jrandom.PRNGKey(0))
    s = emb(0.4)
    e = w.mlp.lin2(hax.nn.silu(w.mlp.lin1(s)))
    expected = np.einsum("d,dab->ab", np.asarray(hax.nn.silu(e).array), np.asarray(w.proj.array))
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
