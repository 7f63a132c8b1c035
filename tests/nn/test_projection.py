import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qkvflow.nn.projection import project

D, A, B, K = hax.Axis("time_embed", 6), hax.Axis("a", 3), hax.Axis("b", 5), hax.Axis("ode_time", 4)


def _inputs(batch_axes):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    e = hax.random.normal(k1, (*batch_axes, D))
    p = hax.random.normal(k2, (D, A, B))
    g = hax.random.normal(k3, (*batch_axes, A, B))
    return e, p, g


@pytest.mark.parametrize("batch_axes", [(), (K,), (K, hax.Axis("extra", 2))])
def test_value_and_gradients_match_autodiff_of_the_plain_product(batch_axes):
    e, p, g = _inputs(batch_axes)

    def ours(e, p):
        return hax.sum(project(e, p, "time_embed") * g).scalar()

    def reference(e, p):
        return hax.sum(hax.dot(e, p, axis="time_embed") * g).scalar()

    out = project(e, p, "time_embed")
    assert out.axes == (*batch_axes, A, B)
    np.testing.assert_allclose(out.array, hax.dot(e, p, axis="time_embed").rearrange(out.axes).array, rtol=1e-5)
    (de, dp), (de_ref, dp_ref) = jax.grad(ours, argnums=(0, 1))(e, p), jax.grad(reference, argnums=(0, 1))(e, p)
    assert dp.axes == p.axes and de.axes == e.axes
    np.testing.assert_allclose(dp.array, dp_ref.array, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(de.array, de_ref.rearrange(de.axes).array, rtol=1e-5, atol=1e-6)


def test_time_embed_axis_may_sit_anywhere_in_e():
    e, p, _ = _inputs((K,))
    moved = e.rearrange((D, K))
    np.testing.assert_allclose(project(moved, p, "time_embed").array, project(e, p, "time_embed").array, rtol=1e-6)


def test_proj_must_lead_with_the_contracted_axis():
    e, p, _ = _inputs(())
    with pytest.raises(ValueError, match="first axis of proj"):
        project(e, p.rearrange((A, D, B)), "time_embed")


def _proj_gradient_hlo(product) -> str:
    e, p, g = _inputs((K,))
    grad = jax.jit(jax.grad(lambda p: jnp.sum(product(e, p).array * g.array)))
    return grad.lower(p).as_text()


def test_gradient_of_proj_is_one_product_in_its_own_layout():
    """The reason for the custom VJP: dP comes out of one dot as (d_emb, *target); autodiff of the
    plain product makes it (*target, d_emb) and transposes that big result back."""
    ours = _proj_gradient_hlo(lambda e, p: project(e, p, "time_embed"))
    dots = [line for line in ours.splitlines() if "dot_general" in line]
    assert len(dots) == 1 and dots[0].rstrip().endswith("-> tensor<6x3x5xf32>")
    big_transposes = [line for line in ours.splitlines() if "transpose" in line and "3x5" in line]
    assert big_transposes == []  # only e (4 x 6) is transposed

    plain = _proj_gradient_hlo(lambda e, p: hax.dot(e, p, axis="time_embed"))
    assert any("transpose" in line and "-> tensor<6x3x5xf32>" in line for line in plain.splitlines())
