"""Models for the analysis tests.

`filled` builds any model's structure with `jax.eval_shape` and fills it with seeded normal
numbers: no initialiser runs, so no XLA compilations (Levanter's truncated-normal initialisers
compile for seconds per shape on a CPU). For tests that read or set weights, not for training.
"""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jrandom
import numpy as np

from tests.helpers import Vocab


def filled(config, vocab=Vocab, *, seed: int = 0, std: float = 0.3):
    """Projections get std * d_emb, so that W(t) = Proj(e) / d_emb is as large as the other weights."""
    shape = eqx.filter_eval_shape(config.build, vocab, key=jrandom.PRNGKey(0))
    rng = np.random.default_rng(seed)
    d_emb = getattr(config, "time_embed_dim", 1)

    def fill(path, leaf):
        if isinstance(leaf, jax.ShapeDtypeStruct):
            scale = std * d_emb if re.search(r"\.proj\b|\.projections\[", jax.tree_util.keystr(path)) else std
            return jnp.asarray(rng.normal(scale=scale, size=leaf.shape), leaf.dtype)
        return leaf

    return jax.tree_util.tree_map_with_path(fill, shape)
