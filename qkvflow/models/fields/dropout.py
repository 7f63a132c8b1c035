"""Dropout for a DiffEqFormer, with Levanter GPT-2's names `embed_pdrop` and `resid_pdrop`.

A discrete GPT-2 drops out the embedding and each residual branch's output before it is added
(Levanter's `Gpt2Embeddings` and `Gpt2Block`). The authors' DiffEqFormer does the same inside its
Euler loop (SDML-KU/qkvflow, qkvflow/nn/dynamic.py: `Block.__call__`, lines 407-427, masks the
attention and the feed-forward outputs with separate keys; the loop, lines 542-554, draws one key per
step): x_{k+1} = x_k + dt (D_a,k * A(t_k, x_k) + D_m,k * M(t_k, x_k)).

Here the solver (diffrax) calls the field at times it chooses, so the masks are made a function of
the time, drawn from a key folded with t:

    x(0) = D_e * embed(tokens),      dx/dt = F(t, x) = D_a(t) * A(W(t), x) + D_m(t) * M(W(t), x)

each D a fresh Bernoulli(1 - p) mask divided by 1 - p (hnn.Dropout), D_a(t), D_m(t) drawn from
fold_in(key, bits of float32 t). So the field stays a function of (t, x) for one training step: stages
of a step at the same t share masks, and a backward pass that re-evaluates the field (checkpointed
solves) sees the masks of the forward pass. On a fixed Euler grid this is the authors' scheme, one
pair of masks per step; a multi-stage solver draws a pair per stage time and averages their fields.
Adaptive solvers are refused (a field that changes at every t defeats step-size control).

Dropout acts only when the model is given a key (a training step, `qkvflow.training.loss`);
evaluation, generation and export pass none, as Levanter's evaluator does.
"""

from typing import Optional

import haliax.nn as hnn
import jax
import jax.numpy as jnp
import jax.random as jrandom
from haliax import NamedArray


def dropout(x: NamedArray, pdrop: float, key) -> NamedArray:
    """x with each entry zeroed with probability pdrop and the rest divided by 1 - pdrop; x itself
    when there is no key or pdrop is 0."""
    if key is None or pdrop == 0:
        return x
    return hnn.Dropout(pdrop)(x, key=key, inference=False)


def time_key(key, t) -> Optional[jax.Array]:
    """The key of the masks at solver time t: `key` folded with the bits of float32 t (None stays None)."""
    if key is None:
        return None
    bits = jax.lax.bitcast_convert_type(jnp.asarray(t, jnp.float32), jnp.uint32)
    return jrandom.fold_in(key, bits)


def branch_dropout(attn: NamedArray, ff: NamedArray, pdrop: float, key) -> tuple[NamedArray, NamedArray]:
    """The residual branches' outputs with their own masks, D_a * attn and D_m * ff (module docstring)."""
    if key is None or pdrop == 0:
        return attn, ff
    k_attn, k_ff = jrandom.split(key)
    return dropout(attn, pdrop, k_attn), dropout(ff, pdrop, k_ff)
