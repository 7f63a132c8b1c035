"""Models for the analysis tests.

`filled` builds any model's structure with `jax.eval_shape` and fills it with seeded normal
numbers: no initialiser runs, so no XLA compilations (Levanter's truncated-normal initialisers
compile for seconds per shape on a CPU). For tests that read or set weights, not for training.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jrandom
import numpy as np

from tests.helpers import Vocab


def filled(config, vocab=Vocab, *, seed: int = 0, std: float = 0.3):
    shape = eqx.filter_eval_shape(config.build, vocab, key=jrandom.PRNGKey(0))
    rng = np.random.default_rng(seed)

    def fill(leaf):
        if isinstance(leaf, jax.ShapeDtypeStruct):
            return jnp.asarray(rng.normal(scale=std, size=leaf.shape), leaf.dtype)
        return leaf

    return jax.tree_util.tree_map(fill, shape)
