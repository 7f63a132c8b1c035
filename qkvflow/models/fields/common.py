"""Pieces both vector fields share: affine maps on named weights and causal self-attention."""

from typing import Optional

import haliax as hax
from haliax import NamedArray
from levanter.layers.attention import AttentionMask

from qkvflow.models.generator import WeightSpec
from qkvflow.nn.attention import dot_product_attention


def affine(x: NamedArray, weights: dict, name: str, In) -> NamedArray:
    """x @ W[name] (+ W[name_bias] when the generator supplies one)."""
    y = hax.dot(x, weights[name], axis=In)
    bias = weights.get(f"{name}_bias")
    return y if bias is None else y + bias


def attention_specs(config, *, use_bias: bool) -> dict[str, WeightSpec]:
    Embed, Heads, HeadSize = config.Embed, config.Heads, config.HeadSize
    specs = {}
    for name in ("q", "k", "v"):
        specs[name] = WeightSpec((Heads, HeadSize), "matrix", (Embed,))
        if use_bias:
            specs[f"{name}_bias"] = WeightSpec((Heads, HeadSize), "bias")
    specs["o"] = WeightSpec((Embed,), "matrix", (Heads, HeadSize))
    if use_bias:
        specs["o_bias"] = WeightSpec((Embed,), "bias")
    return specs


def self_attention(
    h: NamedArray,
    weights: dict,
    config,
    mask: Optional[AttentionMask | NamedArray],
    rotary=None,
    pos_ids: Optional[NamedArray] = None,
    attend_fn=None,
) -> NamedArray:
    """Multi-head attention with Q_h(t), K_h(t), V_h(t), O(t); Levanter's kernels do the softmax.

    `attend_fn(q, k, v, config, mask)` replaces `attend` (default): KV-cached decoding
    (`qkvflow.inference`) passes one that appends k, v to a paged cache and attends over it."""
    q = affine(h, weights, "q", config.Embed)
    k = affine(h, weights, "k", config.Embed)
    v = affine(h, weights, "v", config.Embed)
    if rotary is not None:
        q, k = rotary(q, pos_ids), rotary(k, pos_ids)
    out = (attend_fn or attend)(q, k, v, config, mask)
    return affine(out.astype(h.dtype), weights, "o", (config.Heads, config.HeadSize))


def attend(q: NamedArray, k: NamedArray, v: NamedArray, config, mask) -> NamedArray:
    """softmax(q k^T / sqrt(head_size)) v over positions, by Levanter's attention kernels or qkvflow's
    (`config.attn_backend`, qkvflow.nn.attention); shared by the ODE fields and the discretised blocks
    (qkvflow.models.discrete), so both compute the same thing."""
    k = k.rename({config.max_Pos.name: config.KeyPos.name})
    v = v.rename({config.max_Pos.name: config.KeyPos.name})
    return dot_product_attention(
        config.max_Pos.name,
        config.KeyPos.name,
        config.HeadSize.name,
        q,
        k,
        v,
        mask=mask,
        attn_backend=config.attn_backend,
        flash_block_size=config.flash_attention_block_size,
    )
