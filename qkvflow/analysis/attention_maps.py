"""Per-head attention probabilities of a DiffEqFormer along a trajectory (the paper's appendix F).

At time t, with h = LN_a(x(t); t) the attention pre-norm of the field,

    P_h(t)[a, b] = softmax_b( (h_a Q_h(t) + q_h(t)) . (h_b K_h(t) + k_h(t)) / sqrt(head_size) ),   b <= a

(rotary embeddings applied to both sides in the Llama flavour), the weights with which
`qkvflow.models.fields.common.self_attention` mixes the values.
"""

import math

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from haliax import Axis, NamedArray

from qkvflow.models.fields.common import affine


def attention_input(model, weights: dict, x: NamedArray) -> NamedArray:
    """LN_a(x; t): the pre-norm the model's vector field applies before attention."""
    return model.field._norm(x, weights, "attn_norm", model.config)


def attention_probabilities(h: NamedArray, weights: dict, config, pos_ids: NamedArray) -> NamedArray:
    """P [heads, position, key_position] for normed inputs h [position, embed], causal."""
    q = affine(h, weights, "q", config.Embed)
    k = affine(h, weights, "k", config.Embed)
    if config.flavour_spec.rotary:
        rotary = config.rope.build(config.HeadSize)
        q, k = rotary(q, pos_ids), rotary(k, pos_ids)
    Pos = h.resolve_axis(config.max_Pos.name)
    KeyPos = Pos.alias(config.KeyPos.name)
    k = k.rename({Pos.name: KeyPos.name})
    scores = hax.dot(q, k, axis=config.HeadSize) / math.sqrt(config.HeadSize.size)
    causal = hax.arange(Pos).broadcast_axis(KeyPos) >= hax.arange(KeyPos)
    scores = hax.where(causal, scores, -jnp.inf)
    return hax.nn.softmax(scores, axis=KeyPos).rearrange(("heads", Pos.name, KeyPos.name))


@eqx.filter_jit
def _maps(model, times: jax.Array, trajectory: jax.Array) -> jax.Array:
    config = model.config
    Pos = Axis(config.max_Pos.name, trajectory.shape[1])
    pos = hax.arange(Pos)

    def one(t, x):
        weights = model.generator(t)
        h = attention_input(model, weights, hax.named(x, (Pos, config.Embed)))
        return attention_probabilities(h, weights, config, pos).array

    return jax.vmap(one)(times, trajectory)


def maps_along(model, trajectory: np.ndarray, times: np.ndarray) -> np.ndarray:
    """[len(times), heads, n, n] attention maps at x(times[k]) = trajectory[k] ([n, embed] each)."""
    return np.asarray(_maps(model, jnp.asarray(times, jnp.float32), jnp.asarray(trajectory)))
