"""Levanter's `Sampler` (temperature, 0 = greedy; nucleus top-p) plus top-k, which it lacks.

`TopKSampler` keeps the k largest logits of each row (ties at the k-th value are kept), sets the
rest to -inf, and hands the result to `Sampler.__call__` unchanged, so temperature, top-p and the
log-probabilities stay Levanter's. Greedy decoding (temperature 0) is the argmax either way. One k
serves the whole batch (it is static: `jax.lax.top_k` needs a static k).
"""

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
from levanter.layers.sampler import Sampler


def top_k_mask(logits: jax.Array, k: int) -> jax.Array:
    """logits with every entry below the row's k-th largest set to -inf (last axis = vocabulary)."""
    kth = jax.lax.top_k(logits, k)[0][..., -1:]
    return jnp.where(logits >= kth, logits, -jnp.inf)


class TopKSampler(Sampler):
    """Levanter's `Sampler` (temperature, top-p) with the logits outside each row's `top_k` largest set
    to -inf first."""

    top_k: int = eqx.field(static=True)

    def __init__(self, Vocab, top_k: int):
        super().__init__(Vocab)
        self.top_k = top_k

    def __call__(self, logits, temperatures, *, top_ps=None, key):
        Vocab = logits.resolve_axis(self.Vocab)
        logits = logits.astype(jnp.float32).rearrange((..., Vocab))
        masked = hax.named(top_k_mask(logits.array, min(self.top_k, Vocab.size)), logits.axes)
        return super().__call__(masked, temperatures, top_ps=top_ps, key=key)
