"""qkvflow.nn.random.normal draws haliax.random.normal's values bit for bit (it only compiles faster)."""

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qkvflow.nn.random import normal

AXES = {
    "rank1": (hax.Axis("a", 7),),
    "rank2": (hax.Axis("a", 3), hax.Axis("b", 5)),
    "rank4": (hax.Axis("e", 2), hax.Axis("embed", 3), hax.Axis("heads", 5), hax.Axis("head", 4)),
}


@pytest.mark.parametrize("partitionable", [True, False])
@pytest.mark.parametrize("rank", list(AXES))
def test_equals_haliax_normal_bit_for_bit(rank, partitionable):
    """Both counter schemes of JAX's threefry, several ranks, an odd size per axis (a transposed or
    column-major reshape, or another key, moves entries and fails); float32 and bfloat16."""
    key = jax.random.PRNGKey(3)
    with jax.threefry_partitionable(partitionable):
        for dtype in (jnp.float32, jnp.bfloat16):
            ours, theirs = normal(key, AXES[rank], dtype), hax.random.normal(key, AXES[rank], dtype)
            assert ours.axes == theirs.axes and ours.dtype == theirs.dtype == dtype
            np.testing.assert_array_equal(np.asarray(ours.array), np.asarray(theirs.array))
    assert float(jnp.std(normal(key, hax.Axis("n", 4096)).array)) == pytest.approx(1.0, abs=0.05)
