"""GPT-2 flavour: LayerNorm, GELU feed-forward (positions are learned and added by the embedding).

    dx/dt = O(t) Attn(LN_a(x; t)) + W2(t) gelu(W1(t) LN_m(x; t) + b1(t)) + b2(t)

Attention and feed-forward read the same x (in parallel, as in the DiffEqFormer), each through its
own pre-norm with time-dependent scale and shift (no shift when the generator gives none: `variant:
official` with `use_bias: false`).
"""

import haliax.nn as hnn
from haliax import NamedArray

from qkvflow.models.generator import WeightSpec

from .common import affine, attention_specs, self_attention
from .dropout import branch_dropout


def weight_specs(config) -> dict[str, WeightSpec]:
    Embed, Mlp, bias = config.Embed, config.Mlp, config.bias
    specs = {"attn_norm": WeightSpec((Embed,), "norm"), "attn_norm_bias": WeightSpec((Embed,), "bias")}
    specs.update(attention_specs(config, use_bias=bias))
    specs |= {"mlp_norm": WeightSpec((Embed,), "norm"), "mlp_norm_bias": WeightSpec((Embed,), "bias")}
    specs["w1"] = WeightSpec((Mlp,), "matrix", (Embed,))
    if bias:
        specs["w1_bias"] = WeightSpec((Mlp,), "bias")
    specs["w2"] = WeightSpec((Embed,), "matrix", (Mlp,))
    if bias:
        specs["w2_bias"] = WeightSpec((Embed,), "bias")
    return specs


def _norm(x: NamedArray, weights: dict, name: str, config) -> NamedArray:
    norm = hnn.LayerNorm(config.Embed, weights[name], weights.get(f"{name}_bias"), eps=config.layer_norm_epsilon)
    return norm(x)


def vector_field(weights: dict, x: NamedArray, *, config, mask, pos_ids=None, attend_fn=None, key=None) -> NamedArray:
    """F(W(t), x) (module docstring); with `key`, each branch's residual dropout (`fields.dropout`)."""
    attn = self_attention(_norm(x, weights, "attn_norm", config), weights, config, mask, attend_fn=attend_fn)
    h = affine(_norm(x, weights, "mlp_norm", config), weights, "w1", config.Embed)
    ff = affine(config.activation_function.to_fn()(h), weights, "w2", config.Mlp)
    if key is not None:  # a training step (qkvflow.models.fields.dropout)
        attn, ff = branch_dropout(attn, ff, config.resid_pdrop, key)
    return attn + ff
