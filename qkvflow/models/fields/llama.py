"""Llama flavour: RMSNorm, SwiGLU feed-forward, rotary positions inside attention.

dx/dt = O(t) Attn_rope(RMS_a(x; t)) + W_down(t) (silu(W_gate(t) m) * W_up(t) m),   m = RMS_m(x; t)
"""

import haliax.nn as hnn
import jax.numpy as jnp
from haliax import NamedArray

from qkvflow.models.generator import WeightSpec

from .common import affine, attention_specs, self_attention
from .dropout import branch_dropout


def weight_specs(config) -> dict[str, WeightSpec]:
    Embed, Mlp = config.Embed, config.Mlp
    specs = {"attn_norm": WeightSpec((Embed,), "norm")}
    specs.update(attention_specs(config, use_bias=config.bias))
    specs["mlp_norm"] = WeightSpec((Embed,), "norm")
    specs["w_gate"] = WeightSpec((Mlp,), "matrix", (Embed,))
    specs["w_up"] = WeightSpec((Mlp,), "matrix", (Embed,))
    specs["w_down"] = WeightSpec((Embed,), "matrix", (Mlp,))
    return specs


def _norm(x: NamedArray, weights: dict, name: str, config) -> NamedArray:
    return hnn.RmsNorm(config.Embed, weights[name], None, eps=config.layer_norm_epsilon, dtype=jnp.float32)(x)


def vector_field(weights: dict, x: NamedArray, *, config, mask, pos_ids=None, attend_fn=None, key=None) -> NamedArray:
    """F(W(t), x) (module docstring); with `key`, each branch's residual dropout (`fields.dropout`)."""
    rotary = config.rope.build(config.HeadSize)
    attn = self_attention(_norm(x, weights, "attn_norm", config), weights, config, mask, rotary, pos_ids, attend_fn)
    m = _norm(x, weights, "mlp_norm", config)
    gate = hnn.silu(affine(m, weights, "w_gate", config.Embed))
    ff = affine(gate * affine(m, weights, "w_up", config.Embed), weights, "w_down", config.Mlp)
    if key is not None:  # a training step (qkvflow.models.fields.dropout)
        attn, ff = branch_dropout(attn, ff, config.resid_pdrop, key)
    return attn + ff
