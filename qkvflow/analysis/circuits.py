"""Per-head attention matrices of one model along its depth, as plain arrays.

For head h the attention score between tokens a and b, and what b writes into a, are

    score_h(a, b) = x_a Q_h (x_b K_h)^T = x_a (Q_h K_h^T) x_b^T,        write_h(b) = x_b (V_h O_h)

(row vectors; Q_h, K_h, V_h are embed x head_size, O_h is head_size x embed). `AttentionCircuits`
holds Q_h, K_h, V_h, O_h for every depth point: the times t of a DiffEqFormer's generator W(t), or
the layer index of a discrete Levanter GPT-2 / Llama. Biases, norm scales and rotary embeddings
are left out: the circuits are the weight matrices, as in Fig. 2 of the paper.
"""

from dataclasses import dataclass
from typing import Optional

import haliax as hax
import jax.numpy as jnp
import numpy as np
from haliax import NamedArray

from qkvflow.errors import UserError
from qkvflow.integrate.weight_source import generate_batched
from qkvflow.models.diffeqformer import DiffEqFormerLMHeadModel


@dataclass(frozen=True)
class AttentionCircuits:
    """The attention weights Q, K, V, O of a model at each depth (ODE time t or layer), split by head,
    for the circuit analyses."""

    depth: np.ndarray
    """[depth] the times t, or the layer indices 0..L-1."""
    depth_label: str
    """"t" or "layer"."""
    q: np.ndarray
    """[depth, heads, embed, head_size]; k and v alike."""
    k: np.ndarray
    v: np.ndarray
    o: np.ndarray
    """[depth, heads, head_size, embed]."""


def _array(w: NamedArray, axes: tuple[str, ...]) -> np.ndarray:
    return np.asarray(w.rearrange(axes).array, dtype=np.float64)


def from_generator(generator, times: np.ndarray) -> AttentionCircuits:
    """Circuits of a DiffEqFormer (or weight-shared ODE) generator at `times`, in one vmapped call."""
    w = generate_batched(generator, jnp.asarray(times, dtype=jnp.float32))
    io = ("ode_time", "heads", "embed", "head_size")
    o = _array(w["o"], ("ode_time", "heads", "head_size", "embed"))
    return AttentionCircuits(np.asarray(times), "t", _array(w["q"], io), _array(w["k"], io), _array(w["v"], io), o)


def _per_layer(foldable, get) -> NamedArray:
    """`get(block)` for every layer, with the layer axis first (haliax `Stacked` or `BlockSeq` layers)."""
    if hasattr(foldable, "stacked"):
        return get(foldable.stacked)
    return hax.stack("layer", [get(block) for block in foldable.blocks])


def _layer_axis(w: NamedArray) -> str:
    return w.axes[0].name


def from_gpt2(model) -> AttentionCircuits:
    """Levanter `Gpt2LMHeadModel`: c_attn [layers, embed, qkv, heads, head_size],
    c_proj [layers, heads, head_size, embed]."""
    qkv = _per_layer(model.transformer.blocks, lambda b: b.attn.c_attn.weight)
    proj = _per_layer(model.transformer.blocks, lambda b: b.attn.c_proj.weight)
    L = _layer_axis(qkv)
    q, k, v = (_array(qkv["qkv", i], (L, "heads", "embed", "head_size")) for i in range(3))
    o = _array(proj, (L, "heads", "head_size", "embed"))
    return AttentionCircuits(np.arange(q.shape[0]), "layer", q, k, v, o)


def from_llama(model) -> AttentionCircuits:
    """Levanter `LlamaLMHeadModel`. Grouped-query attention: query head (g, r) of kv group g uses K_g, V_g,
    and heads are numbered g * heads_per_group + r, the order in which Levanter flattens them for o_proj."""
    wq, wk, wv, wo = (
        _per_layer(model.transformer.layers, lambda b, n=n: getattr(b.self_attn, n).weight)
        for n in ("q_proj", "k_proj", "v_proj", "o_proj")
    )
    L = _layer_axis(wq)
    q = _array(wq, (L, "kv_head", "q_heads_per_group", "embed", "head_size"))
    layers, groups, per_group = q.shape[:3]
    q = q.reshape(layers, groups * per_group, *q.shape[3:])
    k, v = (np.repeat(_array(w, (L, "kv_head", "embed", "head_size")), per_group, axis=1) for w in (wk, wv))
    o = _array(wo, (L, "heads", "head_size", "embed"))
    return AttentionCircuits(np.arange(layers), "layer", q, k, v, o)


def circuits_of(model, num_times: int, times: Optional[np.ndarray] = None) -> AttentionCircuits:
    """Circuits of any model `qkvflow train` builds; a time-dependent model is sampled at `times`,
    or at `num_times` evenly spaced t in [0, 1] when `times` is None."""
    from levanter.models.gpt2 import Gpt2LMHeadModel
    from levanter.models.llama import LlamaLMHeadModel

    if isinstance(model, DiffEqFormerLMHeadModel):
        return from_generator(model.generator, np.linspace(0.0, 1.0, num_times) if times is None else times)
    if isinstance(model, Gpt2LMHeadModel):
        return from_gpt2(model)
    if isinstance(model, LlamaLMHeadModel):
        return from_llama(model)
    raise UserError(f"spectra: model type {type(model).__name__} is not a DiffEqFormer, GPT-2 or Llama model")
