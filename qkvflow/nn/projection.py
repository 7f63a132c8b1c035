"""The hypernetwork's output map W = Proj(e), with a gradient laid out like the parameter.

    W[..., p] = sum_d e[..., d] P[d, p]            e: (*batch, d_emb)   P: (d_emb, *target)
    dP[d, p]  = sum_batch e[batch, d] g[batch, p]   (one matrix product over every batch axis)
    de[..., d] = sum_p g[..., p] P[d, p]

Why not let JAX differentiate `hax.dot`: its transpose rule for the right operand computes g^T e,
shaped (*target, d_emb), and then transposes it back to P's (d_emb, *target) layout. P is the
largest tensor of a DiffEqFormer (d_emb x one layer's parameters: 12.6M of the 13M parameters of
the benchmark model), and on XLA's CPU backend that transpose is fused into each consumer of the
gradient (the clipping norm, the division, Adam's two moments) as a strided read, which made the
optimizer update the slowest part of a training step. Writing the product above directly gives dP
in P's layout. `benchmarks/README.md` has the before/after step times.

`e` may carry leading axes (e.g. `ode_time` for all evaluation times at once): the batched product
is one matrix multiply, and dP sums over those axes inside it.
"""

import jax
import jax.numpy as jnp
from haliax import NamedArray


def project(e: NamedArray, proj: NamedArray, axis: str) -> NamedArray:
    """sum over `axis` of e * proj; `axis` must be proj's first axis and one of e's axes."""
    if proj.axes[0].name != axis:
        raise ValueError(f"project: expected {axis!r} as the first axis of proj, got {proj.axes}")
    e = e.rearrange((..., axis))
    batch, target = e.axes[:-1], proj.axes[1:]
    out = _project(e.array.astype(proj.dtype), proj.array)
    return NamedArray(out, (*batch, *target))


@jax.custom_vjp
def _project(e: jax.Array, p: jax.Array) -> jax.Array:
    return jnp.tensordot(e, p, axes=1)


def _forward(e, p):
    return _project(e, p), (e, p)


def _backward(residuals, g):
    e, p = residuals
    batch = e.ndim - 1
    # dP: contract the batch axes of e (..., d) and g (..., *target) -> (d, *target).
    dp = jnp.tensordot(jnp.moveaxis(e, -1, 0), g, axes=(tuple(range(1, batch + 1)), tuple(range(batch))))
    # de: contract the target axes; P first keeps P in its own layout, the small result is moved.
    target = p.ndim - 1
    de = jnp.tensordot(p, g, axes=(tuple(range(1, target + 1)), tuple(range(batch, batch + target))))
    return jnp.moveaxis(de, 0, -1), dp.astype(p.dtype)


_project.defvjp(_forward, _backward)


def project_stacked(e: NamedArray, proj: NamedArray, axis: str, stack: str) -> NamedArray:
    """`project` for a stack of projections at once: W[s, ..., p] = sum_d e[s, ..., d] P[s, d, p].

    `proj` is (stack, axis, *target) and `e` carries `stack` and `axis`. One batched product (and one per
    gradient, both in P's layout as above) replaces one product per member of the stack."""
    if proj.axes[0].name != stack or proj.axes[1].name != axis:
        raise ValueError(f"project_stacked: expected ({stack!r}, {axis!r}, ...) as proj's axes, got {proj.axes}")
    e = e.rearrange((stack, ..., axis))
    batch, target = e.axes[1:-1], proj.axes[2:]
    out = jax.vmap(_project)(e.array.astype(proj.dtype), proj.array)
    return NamedArray(out, (proj.axes[0], *batch, *target))
